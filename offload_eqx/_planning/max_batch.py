"""The largest batch whose step fits a device, found by compiling the step.

`ox.max_batch(step, make_args, target="h100")` compiles `step` at a few batches with
`ox.memory_report` (for an H100 or a TPU without the hardware, or this CPU) and returns the
largest batch whose device total (temp + argument + output - alias, per device) is within
the target's device memory, or a given budget.

Device memory grows nearly linearly with the batch, but not exactly (XLA picks other
fusions, layouts and schedules at other sizes), so the answer is decided by compiles,
never by the line alone: the batch returned was compiled and fits, and the batch after it
was compiled and does not. The line only chooses where to compile next (a secant step,
kept inside the bracket of known fits and misfits); bisection takes over when it stops
halving the bracket, and doubling when there is no line yet. Near a nearly linear answer
that is two or three compiles after the first two.
"""

import time
from collections.abc import Callable
from typing import Any

import jax

from .._base.options import checks_options
from .._base.progress import reporting
from .._base.table import format_bytes
from .._declare.strategy import Strategy
from .._inspect.memory_report import MemoryReport, memory_report
from .._jit.aot import refuse_ahead_of_time
from .._jit.jit import FilterJit, filter_jit
from .._plan.plan import Plan
from .._targets.devices import require_compiler
from .._targets.targets import Target, get_target
from .batch_budgets import SCALE, host_limit_of, host_words, pressure, progress_line, within

# A batch this large that still fits means memory hardly grows with the batch (a peak set
# by something else, say an optimizer update): searching further only makes the compiler
# fail to tile enormous GEMMs.
LARGEST_BATCH = 2**20
# Without a misfit, never probe more than this many times the largest fit: a nearly flat
# line predicts batches far past any that compiles.
_JUMP = 64

_NO_CAPACITY = (
    "ox.max_batch(target={target!r}): the device memory of {target!r} is unknown "
    "(`Target.capacity` is None), so there is nothing to fit the step into. Pass the bytes "
    "one device may use, e.g. `device_budget=8 * 2**30`."
)
_NOT_FILTER_JIT = (
    "ox.max_batch(strategy={strategy!r}): the step is re-wrapped with the strategy, which "
    "needs an `ox.filter_jit` function; got {step!r}. Wrap it first: "
    "`ox.max_batch(ox.filter_jit(step), ...)`."
)
_NOT_TUPLE = (
    "ox.max_batch: `make_args({batch})` returned {kind}; expected a tuple of the step's "
    "positional arguments at that batch (arrays or `jax.ShapeDtypeStruct`s), e.g. "
    "`lambda batch: (model, jax.ShapeDtypeStruct((batch, 512), jnp.float32))`."
)
_BATCH_ONE = (
    "ox.max_batch: `{name}` does not fit {target!r} even at batch 1: {needs} on the device, "
    "budget {budget}{host}. Offload more (a strategy that recomputes or offloads "
    "activations, parameters or optimizer state on the host), shard it over more devices, "
    "or raise `device_budget` / `host_budget` if the machine has more memory."
)
_COMPILE_FAILED = (
    "ox.max_batch: compiling `{name}` for {target!r} at batch {batch} failed for a reason "
    "other than memory: {error}. Reproduce it with `ox.memory_report(step, "
    "*make_args({batch}), target={target!r})`; the original error is chained below."
)
_TOO_FEW_COMPILES = (
    "ox.max_batch: {count} compiles (`max_compiles={count}`) did not settle the largest "
    "batch of `{name}` on {target!r}: {known}. Raise `max_compiles`, or pass `start=` near "
    "the answer. Probes (batch: device bytes, None = refused): {probes}."
)
_IGNORES_BATCH = (
    "ox.max_batch: `make_args` ignores the batch: `make_args({first})` and "
    "`make_args({second})` return arguments of the same shapes, and `{name}` compiles to "
    "{outcome} at both, so the batch it was given does not reach the arguments. Make "
    "`make_args(batch)` build the batch axis from `batch`, e.g. `lambda batch: (model, "
    "jax.ShapeDtypeStruct((batch, 512), jnp.float32))`."
)
_FLAT = (
    "ox.max_batch: `{name}` still fits {target!r} at batch {batch} ({needs} of {budget}), "
    "the largest batch the search compiles "
    "(`offload_eqx._planning.max_batch.LARGEST_BATCH`). Either the budget is far above "
    "what the step needs, or its memory hardly grows with the batch: check "
    "`device_budget` and that the batch axis of `make_args` is the one the step scales "
    "with."
)


class _CompileBudgetSpent(Exception):
    pass


def _out_of_memory(error: Exception) -> bool:
    # XLA refuses a program larger than the device with a status text, not an exception
    # type (XLA:TPU: "RESOURCE_EXHAUSTED: ... out of memory").
    text = str(error)
    return "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower()


def _crossing(points: list[tuple[int, int]], budget: int) -> int | None:
    """The largest batch on or under the line through two (batch, bytes) points, exactly
    (integer arithmetic); None when the line does not rise."""
    (b1, t1), (b2, t2) = sorted(points)
    if t2 <= t1:
        return None
    return b1 + (budget - t1) * (b2 - b1) // (t2 - t1)


def _predict(measured: dict[int, int], low: int, high: int | None, budget: int) -> int | None:
    """Where the line through two measurements meets the budget: through the bracket's
    ends when both were measured, else through the two measurements nearest the budget."""
    if low in measured and high in measured:
        return _crossing([(low, measured[low]), (high, measured[high])], budget)
    if len(measured) < 2:
        return None
    nearest = sorted(measured.items(), key=lambda bt: abs(bt[1] - budget))[:2]
    return _crossing(nearest, budget)


def _largest_fit(
    measure: Callable[[int], int | None],
    budget: int,
    start: int = 1,
    max_compiles: int | None = None,
) -> tuple[int, int | None]:
    """The search, on any measurement: `measure(batch)` is the device bytes at `batch`, or
    None when the compiler refused it (does not fit). Called at most once per batch.

    Returns `(low, high)`: `high == low + 1` with `low` fitting (0: batch 1 does not) and
    `high` not, or `high` None when `low == LARGEST_BATCH` still fits. Raises
    `_CompileBudgetSpent` after `max_compiles` measurements.
    """
    fits: dict[int, bool] = {}
    measured: dict[int, int] = {}
    widths = [_width(0, None)]  # the bracket's width before each probe
    on_line = False  # whether the last candidate was read off the line
    # How many probes in a row inside the bracket landed on the same side (+: fits, -:
    # misfits): a line that keeps missing the same way is followed twice as far past its
    # answer each time.
    run = 0

    def bracket() -> tuple[int, int | None]:
        # The smallest misfit and the largest fit below it: a bracket even if memory is
        # not monotone in the batch.
        high = min((b for b, ok in fits.items() if not ok), default=None)
        low = max((b for b, ok in fits.items() if ok and (high is None or b < high)), default=0)
        return low, high

    candidate = start
    while True:
        if max_compiles is not None and len(fits) >= max_compiles:
            raise _CompileBudgetSpent
        total = measure(candidate)
        fits[candidate] = total is not None and total <= budget
        if total is not None:
            measured[candidate] = total
        low, high = bracket()
        if high == low + 1 or (high is None and low == LARGEST_BATCH):
            return low, high
        widths.append(_width(low, high))
        if widths[-2] == _width(0, None):
            run = 0  # the bracket has just formed: the line has not missed yet
        elif fits[candidate]:
            run = max(run, 0) + 1
        else:
            run = min(run, 0) - 1
        # Two probes that did not halve the bracket (the line bends): bisect.
        stalled = on_line and len(widths) > 2 and widths[-1] * 2 > widths[-3]
        predicted = None if stalled else _predict(measured, low, high, budget)
        if high is not None and high not in measured and (predicted or 0) >= high - 1:
            # The compiler refused `high` before the line reached the budget: the line
            # says nothing about where the refusals start.
            predicted = None
        on_line = predicted is not None
        if high is None:
            # No misfit yet: follow the line, at most `_JUMP` times the largest fit, or
            # double when there is no rising line.
            if predicted is None:
                candidate = min(2 * low, LARGEST_BATCH)
            else:
                candidate = min(max(predicted, low + 1), _JUMP * low, LARGEST_BATCH)
        elif predicted is None:
            candidate = (low + high) // 2
        else:
            # The line says `predicted` is the answer: compile it or its neighbour,
            # whichever is still unknown, pushed further when the line keeps missing.
            if run > 0:
                predicted += 2 ** (run - 1)
            elif run < -1:
                predicted -= 2 ** (-run - 1) - 1
            candidate = min(max(predicted, low + 1), high - 1)


def _width(low: int, high: int | None) -> int | float:
    return float("inf") if high is None else high - low


@checks_options
def max_batch(
    step: Callable[..., Any],
    make_args: Callable[[int], tuple],
    *,
    target: "str | Target",
    device_budget: int | None = None,
    host_budget: int | None = None,
    strategy: "str | Strategy | Plan | None" = None,
    start: int | None = None,
    max_compiles: int | None = None,
    progress: Callable[[str], Any] | bool | None = None,
    probes: list | None = None,
) -> int:
    """The largest batch at which `step` fits one device of `target`, found by compiling.

    **Arguments:**

    - `step`: an `ox.filter_jit` function (compiled from its plan, as it would run), or
        any function `ox.memory_report` takes.
    - `make_args`: `make_args(batch)` returns the tuple of the step's positional arguments
        at that batch: arrays or `jax.ShapeDtypeStruct`s (nothing is allocated).
    - `target`: a target name (`"h100"`, `"tpu-v5p"`, `"cpu"`, ...; see
        `ox.memory_report`) or an `ox.Target`.
    - `device_budget`: bytes one device may use, an int of any integer type
        (`8 * 2**30`); default the target's device memory (`Target.capacity`; required
        for `"cpu"`, whose capacity is unknown).
    - `host_budget`: bytes of host memory one device may use (the compiled host total),
        0 for none; default the target's host memory per device (`Speeds.host_memory`;
        unchecked for `"cpu"`, whose host is its device). A batch fits when both do.
    - `strategy`: compile the step under this strategy instead of its own (a name, an
        `ox.Strategy` or an `ox.Plan`): `ox.filter_jit(step.fn, strategy=strategy, ...)`
        with the step's donation and mesh.
    - `start`: the first batch compiled (default 1); near the answer saves compiles.
    - `max_compiles`: fail rather than compile more than this (default: no limit; the
        search needs about 2 log2 of the answer compiles at worst, usually 4 to 6).
    - `progress`: called with one line per compile (batch, device bytes, fits), e.g.
        `progress=print`; by default a status line on stderr when it is a terminal (none
        under pytest or with `CI` set); `True` always shows it, `False` never.
    - `probes`: a list to which one dict per compile is appended, in order: `batch`,
        `total` (device bytes, None when the compiler refused the program for lack of
        memory), `host_total` (host bytes, or None), `fits`, `seconds`, `report` (the
        `ox.MemoryReport`, or None).

    **Returns:** the batch `b >= 1` that was compiled and fits, while `b + 1` was compiled
    and does not: exact, not read off a line. (If memory were not monotone in the batch,
    a larger batch could fit again; the search assumes it is.)

    **Raises:** `ValueError` when batch 1 does not fit, or the budget is unknown, or
    `make_args` ignores the batch (two batches give arguments of the same shapes that
    compile to the same total: the search stops there); before any compile, `TypeError`
    for a budget or count that is not an int and `ValueError` for one below 1;
    `RuntimeError` when `max_compiles` is spent first, when a batch of `LARGEST_BATCH`
    (2**20) still fits, or when a compile fails for a reason other than memory (the
    batch is named, the compiler's error chained).
    """
    refuse_ahead_of_time(step, "ox.max_batch")
    resolved = get_target(target)
    require_compiler(resolved)  # a missing extra, before any trace
    budget = resolved.capacity if device_budget is None else device_budget
    if budget is None:
        raise ValueError(_NO_CAPACITY.format(target=resolved.name))
    host_limit = host_limit_of(resolved, host_budget)
    if start is not None and start > LARGEST_BATCH:
        raise ValueError(
            f"ox.max_batch(start={start}): the search stops at batch {LARGEST_BATCH} "
            "(`offload_eqx._planning.max_batch.LARGEST_BATCH`); start at or below it."
        )
    if strategy is not None:
        if not isinstance(step, FilterJit):
            raise TypeError(_NOT_FILTER_JIT.format(strategy=strategy, step=step))
        step = filter_jit(step.fn, strategy=strategy, donate=step.donate, mesh=step.mesh)
    name = _name_of(step.fn if isinstance(step, FilterJit) else step)
    log: list[dict[str, Any]] = []
    shapes: dict[int, Any] = {}  # each batch's arguments, as `_shapes` sees them

    def measure(batch: int, say: Callable[[str], Any]) -> int | None:
        args = make_args(batch)
        if not isinstance(args, tuple):
            raise TypeError(_NOT_TUPLE.format(batch=batch, kind=_kind(args)))
        started = time.perf_counter()
        report: MemoryReport | None = None
        try:
            report = memory_report(step, *args, target=resolved)
        except ImportError:
            raise  # a missing compiler: its message names the extra to install
        except Exception as error:
            if not _out_of_memory(error):
                first_line = (str(error).strip().splitlines() or [type(error).__name__])[0]
                raise RuntimeError(
                    _COMPILE_FAILED.format(
                        name=name, target=resolved.name, batch=batch, error=first_line
                    )
                ) from error
        total = None if report is None else report.total
        host = None if report is None else report.host_total
        entry = {
            "batch": batch,
            "total": total,
            "host_total": host,
            "fits": total is not None and total <= budget and within(host, host_limit),
            "seconds": time.perf_counter() - started,
            "report": report,
        }
        log.append(entry)
        if probes is not None:
            probes.append(entry)
        say(progress_line(entry, resolved.name, budget, host_limit))
        shapes[batch] = _shapes(args)
        _check_batch_reaches_args(log, shapes, name)
        return pressure(total, budget, host, host_limit)

    try:
        with reporting("ox.max_batch", progress) as say:
            low, high = _largest_fit(
                lambda batch: measure(batch, say),
                budget if host_limit is None else SCALE,
                start or 1,
                max_compiles,
            )
    except _CompileBudgetSpent:
        raise RuntimeError(
            _TOO_FEW_COMPILES.format(
                count=max_compiles,
                name=name,
                target=resolved.name,
                known=_known(log),
                probes=", ".join(f"{p['batch']}: {p['total']}" for p in log),
            )
        ) from None
    if high is None:
        at = next(p for p in log if p["batch"] == low)
        raise RuntimeError(
            _FLAT.format(
                name=name,
                target=resolved.name,
                batch=low,
                needs=format_bytes(at["total"]),
                budget=format_bytes(budget),
            )
        )
    if low == 0:
        at = next(p for p in log if p["batch"] == 1)
        needs = "refused by the compiler (out of memory)"
        if at["total"] is not None:
            needs = f"{format_bytes(at['total'])} ({at['total']} bytes)"
        raise ValueError(
            _BATCH_ONE.format(
                name=name,
                target=resolved.name,
                needs=needs,
                budget=f"{format_bytes(budget)} ({budget} bytes)",
                host=host_words(at["host_total"], host_limit),
            )
        )
    return low


def _known(log: list[dict[str, Any]]) -> str:
    """What the probes so far say about the answer, in words."""
    high = min((p["batch"] for p in log if not p["fits"]), default=None)
    low = max(
        (p["batch"] for p in log if p["fits"] and (high is None or p["batch"] < high)), default=0
    )
    if high is None:
        return f"batch {low} fits and no larger batch was compiled that does not"
    if low == 0:
        return f"batch {high} does not fit and no smaller batch was compiled"
    return f"batch {low} fits and batch {high} does not, so the answer is in [{low}, {high - 1}]"


def _shapes(args: tuple) -> tuple:
    """What of the arguments can carry the batch: their structure, each array's shape and
    dtype, each number or string (other objects by type: a fresh closure per batch is not
    a different batch)."""
    leaves, treedef = jax.tree.flatten(args)
    return treedef, tuple(
        (tuple(leaf.shape), str(leaf.dtype))
        if hasattr(leaf, "shape") and hasattr(leaf, "dtype")
        else leaf
        if isinstance(leaf, (bool, int, float, complex, str))
        else type(leaf)
        for leaf in leaves
    )


def _same(first: tuple, second: tuple) -> bool:
    try:
        return bool(first == second)
    except Exception:  # a static field whose `==` is not a bool (an array): not provably equal
        return False


def _name_of(fn: Any) -> str:
    return getattr(fn, "__name__", None) or type(fn).__name__


def _kind(value: Any) -> str:
    return "None" if value is None else f"a {type(value).__name__}"


def _check_batch_reaches_args(log: list[dict[str, Any]], shapes: dict[int, Any], name: str) -> None:
    """Raise when the last batch compiled gave the same total as an earlier one for
    arguments of the same shapes: `make_args` ignores the batch. Memory may stay flat
    over many batches (a peak set by something else), so equal totals alone do not."""
    batch, total = log[-1]["batch"], log[-1]["total"]
    for earlier in log[:-1]:
        if earlier["total"] == total and _same(shapes[earlier["batch"]], shapes[batch]):
            outcome = "an out-of-memory refusal"
            if total is not None:
                outcome = f"the same {format_bytes(total)} ({total} bytes)"
            raise ValueError(
                _IGNORES_BATCH.format(
                    first=earlier["batch"], second=batch, name=name, outcome=outcome
                )
            )
