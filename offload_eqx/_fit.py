"""`ox.fit`: the fastest plan whose compiled memory fits the device and the host.

The search (candidates in `_fit_space`):

1. **Price by composition.** A handful of traces, no compile: the plan that recomputes
   every value (every name `remat`, everything on the device); that plan with one name
   saved, and with one name offloaded, for each searchable name; the plan that saves
   everything, and it with one name offloaded; and the first plan with each other
   placement of parameters and optimizer state. Each candidate's load (`_estimate.Load`)
   is its base's plus the difference each of its choices made alone, and the time
   model prices it. Names interact little (each is its own tensor), so the composed
   price is close; the plans that matter are then traced exactly.
2. **Bound the memory.** A candidate needs at least its device-resident arguments and
   the named values it saves; one that keeps at least what a compiled plan of its base
   and placement kept, where that one did not fit, does not fit either. Neither is
   compiled; after a plan does not fit, the plan of its family that keeps no named value
   is compiled next, to rule out the whole family at once.
3. **Compile in order of predicted time** (ties: fewer bytes moved, then fewer FLOPs
   recomputed): each candidate is traced exactly and compiled for the target; the
   compile decides whether it fits, and what does not fit prunes its family
   (`_fit_search`). The loop stops at the first candidate predicted
   slower than the best plan that fits, or after `max_compiles` compiles.
4. **Refine** (`_fit_refine`): between the best plan that fits and each faster plan that
   does not, the amount in between (a name saved in `k` of `L` layers, the `h` largest
   leaves on the host) is found by bisection over compiles.
5. **Explain**: the result, or an error saying what was shown: that no plan fits (the
   least memory found, by the most frugal plan), or which plans that might fit were left
   untried when the compiles ran out, and which compiles crashed.
"""

import dataclasses
import time
from collections.abc import Callable
from typing import Any

from ._activations import Policy
from ._estimate import Delta, Load, load_of, predict
from ._fit_refine import MIN_GAIN, refine
from ._fit_result import FitResult
from ._fit_search import Search, key_of
from ._fit_space import (
    EXHAUSTIVE_NAMES,
    Choice,
    carry_note,
    choices,
    describe_part,
    frontier,
    named_values,
)
from ._host_compute import host_update_problem
from ._jit import FilterJit, filter_jit
from ._options import checks_options
from ._table import format_bytes
from ._targets import get_target

_FRONTIER = (
    "{count} names are searched along a frontier, not every combination (more than "
    "{limit} names would make 3^n candidates): from every name saved, names switch one at "
    "a time to their cheaper way of leaving the device (offload or remat), in order of "
    "the time each adds per byte it frees."
)
_NO_BUDGET = "ox.fit: target {target!r} has no known device memory; pass `device_budget=` in bytes."
_NO_PLAN = (
    "ox.fit: no plan of this step fits {target!r} within a device budget of {budget} and "
    "a host budget of {host_budget}."
)
_SHOWN = (
    " The least device memory found was {least} ({host} on the host), by the plan {plan}, "
    "which keeps least on the device: lower the batch (`ox.max_batch` finds the largest "
    "that fits) or raise a budget."
)
_UNTRIED = (
    " The {compiles} compiles allowed ran out with {count} plans untried that might fit "
    "(their predicted memory is within the budgets), the fastest: {plans}. Raise "
    "`max_compiles`."
)
_LEAST = " The least device memory measured was {least} ({host} on the host), by {plan}."
_CRASHED = (
    " {count} more plans were not compiled because plans of the same placement crashed "
    "the compiler (listed below): a compiler limit, not a memory one; another target or "
    "placement may avoid it."
)


@dataclasses.dataclass(frozen=True)
class _Space:
    """What the search ranges over, found on the step's first trace."""

    names: tuple[str, ...]  # searchable names (not loop carries)
    params: tuple[str, ...]
    optimizer: tuple[str, ...]
    notes: tuple[str, ...]

    @property
    def host_allowed(self) -> tuple[str, ...]:
        return tuple(
            attr for attr in ("params", "optimizer") if "pinned_host" in getattr(self, attr)
        )

    def frugal(self) -> Choice:
        """The plan that keeps least on the device: everything recomputed, parameters and
        state on the host (updated there, where the target can)."""
        optimizer = "host" if "host" in self.optimizer else self.optimizer[-1]
        names = tuple((n, "remat") for n in self.names)
        return Choice("remat", names, self.params[-1], optimizer)


def _space(search: Search) -> _Space:
    """The names and placements to search; loop-carry names fixed and noted."""
    wrapper = search.step
    plan = wrapper.plan(*search.args, **search.kwargs)
    roles = {leaf.role for leaf in plan.leaves}
    declared = sorted(plan.declared_activations)
    params = ("device", "pinned_host") if "param" in roles else ("device",)
    # "host": the state in host memory, updated there, where the target can compute.
    host = ("host",) if host_update_problem(search.target.platform) is None else ()
    optimizer = ("device", "pinned_host", *host) if "optimizer" in roles else ("device",)
    everything = Choice("remat", tuple((n, "remat") for n in declared), "device", "device")
    first = search.trace(everything)
    if isinstance(first, Exception):
        raise first
    search.produced = named_values(first.jaxpr)
    notes = []
    for name in declared:
        value = search.produced.get(name)
        if value is not None and value.carry:
            search.fixed[name] = "remat"
            notes.append(carry_note(name, "remat"))
    names = tuple(n for n in declared if n in search.produced and n not in search.fixed)
    return _Space(names, params, optimizer, tuple(notes))


def _price(search: Search, space: _Space) -> tuple[dict[Choice, Load], list[str]]:
    """Every candidate's load (or why it cannot run), composed from the loads of the
    plans that differ from its base in one choice each."""
    names, params, optimizer = space.names, space.params, space.optimizer
    remat = Choice("remat", tuple((n, "remat") for n in names), "device", "device")
    save = Choice("save", tuple((n, "save") for n in names), "device", "device")
    base_loads: dict[str, Load | str] = {}
    deltas: dict[tuple, Delta | str] = {}
    for base in (remat, save):
        base_load = base_loads[base.base] = _load(search.trace(base))
        for name in names:
            for policy in ("save", "offload") if base is remat else ("offload",):
                variant = base.with_policy(name, policy)
                deltas[(base.base, name, policy)] = _delta(search.trace(variant), base_load)
    for p in params:
        for o in optimizer:
            if (p, o) != ("device", "device"):
                variant = remat.with_(params=p, optimizer=o)
                deltas[("placement", p, o)] = _delta(search.trace(variant), base_loads["remat"])
    notes = [
        f"Not searched: {describe_part(part)}, which {reason}."
        for part, reason in [(("base", b, ""), v) for b, v in base_loads.items()]
        + list(deltas.items())
        if isinstance(reason, str)
    ]

    def compose(choice: Choice) -> Load | None:
        load = base_loads[choice.base]
        parts = [(choice.base, n, p) for n, p in choice.names if p != choice.base]
        if (choice.params, choice.optimizer) != ("device", "device"):
            parts.append(("placement", choice.params, choice.optimizer))
        for part in parts:
            delta = deltas[part]
            if isinstance(load, str) or isinstance(delta, str):
                return None
            load = load + delta
        return load if isinstance(load, Load) else None

    if len(names) <= EXHAUSTIVE_NAMES:
        candidates = choices(names, params, optimizer)
    else:

        def seconds(choice: Choice) -> float | None:
            load = compose(choice)
            return None if load is None else predict(load, search.speeds)[0]

        sizes = {n: search.produced[n].bytes for n in names}
        candidates = frontier(names, params, optimizer, seconds, sizes)
        notes.append(_FRONTIER.format(count=len(names), limit=EXHAUSTIVE_NAMES))
    loads = {c: load for c in candidates if (load := compose(c)) is not None}
    return loads, notes


def _load(costs: Any) -> Load | str:
    if isinstance(costs, Exception):
        return "fails: " + _first_sentence(str(costs))
    return load_of(costs)


def _first_sentence(text: str, limit: int = 400) -> str:
    """The error's first sentence, whole (cut at a word, with an ellipsis, only if it is
    longer than `limit`)."""
    first = text.split(". ")[0].strip().removesuffix(".")
    if len(first) <= limit:
        return first
    return first[:limit].rsplit(" ", 1)[0] + " ..."


def _delta(costs: Any, base: Load | str) -> Delta | str:
    """What a variant changes from its base (or why the variant, or its base, fails)."""
    load = _load(costs)
    if isinstance(base, str):
        return base
    return load if isinstance(load, str) else load - base


def _compile_in_order(search: Search, loads: dict[Choice, Load]) -> None:
    """Compile the candidates in order of predicted time until the rest are slower than
    the best plan that fits; a candidate bounded over a budget is not compiled."""
    priced = sorted(
        ((key_of(predict(load, search.speeds)[0], load), choice) for choice, load in loads.items()),
        key=lambda item: item[0],
    )
    for key, choice in priced:
        load = loads[choice]
        if choice in search.rows:
            continue  # compiled already, as a probe
        if search.best is not None and key > search.best[0]:
            why = "not compiled: predicted slower than the best plan that fits"
            search.skip(choice, key[0], load, why)
            continue
        if search.best is not None and key[0] > search.best[2].seconds * (1 - MIN_GAIN):
            # Near the best: a compile is better spent on the plans between (`refine`).
            why = "not compiled: predicted within 0.5% of the best plan that fits"
            search.skip(choice, key[0], load, why)
            continue
        why = search.why_not_compiled(choice)
        if why is not None:
            search.skip(choice, key[0], load, why)
            continue
        row = search.compile(choice)
        if row.device_bytes is None or row.device_bytes > search.budget:
            _probe_frugal(search, choice, loads)


def _probe_frugal(search: Search, over: Choice, loads: dict[Choice, Load]) -> None:
    """After a plan does not fit, the plan of its base and placement that keeps no named
    value on the device: if that does not fit either, no plan of the family does, and
    none is compiled."""
    relaxed = "remat" if over.base == "remat" else "offload"
    frugal = over.with_(names=tuple((n, relaxed) for n, _ in over.names))
    if frugal != over and frugal not in search.rows and frugal in loads:
        if search.why_not_compiled(frugal) is None:
            search.compile(frugal)


def _explain(search: Search, space: _Space) -> ValueError:
    """Why no plan fits: shown by the most frugal plan's compile, or not shown (plans that
    might fit were left untried), with the compiler's crashes listed."""
    message = _NO_PLAN.format(
        target=search.target.name,
        budget=format_bytes(search.budget),
        host_budget=format_bytes(search.host_limit),
    )
    frugal = search.rows.get(space.frugal())
    untried = [
        (row.seconds, row.label)
        for choice, row in search.rows.items()
        if row.status.startswith("not compiled: the")
        and search.bound(choice) <= search.budget
        and search.host_bound(choice) <= search.host_limit
    ]
    if untried:
        shown = "; ".join(label for _, label in sorted(untried)[:3])
        message += _UNTRIED.format(compiles=search.max_compiles, count=len(untried), plans=shown)
    elif frugal is not None and frugal.device_bytes is not None:
        message += _SHOWN.format(
            plan=frugal.label,
            least=format_bytes(frugal.device_bytes),
            host=format_bytes(frugal.host_bytes or 0),
        )
    if search.least is not None and not (frugal is not None and frugal.device_bytes):
        device, host, label = search.least
        message += _LEAST.format(least=format_bytes(device), host=format_bytes(host), plan=label)
    failed = [
        f"\n  {row.label}: {row.status}"
        for row in search.rows.values()
        if row.status.startswith(("does not fit", "compile failed"))
    ]
    skipped = sum("crashed the compiler" in row.status for row in search.rows.values())
    if skipped:
        message += _CRASHED.format(count=skipped)
    return ValueError(message + "".join(failed))


def _result(search: Search, notes: list[str], started: float) -> FitResult:
    assert search.best is not None
    _, choice, chosen = search.best
    candidates = [
        dataclasses.replace(
            row, strategy=c.strategy(search.fixed), status="best" if c == choice else row.status
        )
        for c, row in search.rows.items()
    ]
    return FitResult(
        strategy=choice.strategy(search.fixed),
        estimate=chosen,
        candidates=tuple(candidates),
        traces=search.traces,
        compiles=search.compiles,
        seconds_searching=time.perf_counter() - started,
        notes=tuple(notes),
    )


@checks_options
def fit(
    step: Callable[..., Any],
    *args: Any,
    target: "str | Any",
    device_budget: int | None = None,
    host_budget: int | None = None,
    max_compiles: int = 12,
    progress: Callable[[str], None] | None = None,
    **kwargs: Any,
) -> FitResult:
    """The plan with the least predicted step time whose compiled memory fits.

    **Arguments:**

    - `step`: an `ox.filter_jit` training step (its function, donation and mesh are kept;
        its strategy is what the search replaces).
    - `*args`, `**kwargs`: its arguments at the batch to plan for (arrays or
        `jax.ShapeDtypeStruct`s).
    - `target`: a name in `ox.TARGETS` or a `Target`.
    - `device_budget`: bytes of device memory per device (default: the target's capacity).
    - `host_budget`: bytes of host memory per device, 0 for none (default: the target's
        `speeds.host_memory`).
    - `max_compiles`: at most this many compiles (each candidate that is priced exactly
        is compiled once).
    - `progress`: called with one line after every trace and compile (e.g. `print`).

    Searched: each declared activation name's policy (save, offload, remat) over a base
    that saves or recomputes everything else, and where managed parameters and optimizer
    state live (device, pinned_host, or updated on the host); then, between the best plan
    that fits and faster ones that do not, a name's policy in a number of layers
    (`("save", k, "offload")`) and the largest leaves on the host. A name that is a scan's
    loop carry is not searched (`FitResult.notes` says why).

    How: every candidate is priced from a few traces (no compile), candidates are
    compiled in order of predicted time until the rest are predicted slower than the
    best plan that fits, and a plan that keeps at least what an over-budget plan of the
    same base and placement kept is not compiled. The planning guide of the
    documentation site ("Planning: estimate, fit, max_batch") has an example.

    **Returns:** an `ox.FitResult`: `.strategy` (an `ox.Strategy` for `ox.filter_jit`),
    `.estimate`, `.candidates`.

    **Raises:** `ValueError` when no plan fits, saying what was shown: the memory of the
    most frugal plan, or the plans left untried when the compiles ran out; and the
    compiles that failed. Before any work: `TypeError`/`ValueError` for a budget or
    `max_compiles` that is not a positive int of any integer type (the host budget may
    be 0).
    """
    resolved = get_target(target)
    budget = device_budget if device_budget is not None else resolved.capacity
    if budget is None:
        raise ValueError(_NO_BUDGET.format(target=resolved.name))
    wrapper = step if isinstance(step, FilterJit) else filter_jit(step)
    started = time.perf_counter()
    search = Search(
        wrapper, args, kwargs, resolved, budget, 0, max_compiles, progress or (lambda line: None)
    )
    search.host_limit = host_budget if host_budget is not None else search.speeds.host_memory
    space = _space(search)
    loads, not_searched = _price(search, space)
    _compile_in_order(search, loads)
    if search.best is not None:
        refine(search, loads, search.best[2].seconds)
    frugal = search.rows.get(space.frugal())
    measured = frugal is not None and frugal.device_bytes is not None
    if search.best is None and not measured and search.compiles < max_compiles:
        search.compile(space.frugal())  # it may fit; if not, it shows what the least is
    if search.best is None:
        raise _explain(search, space)
    return _result(search, [*space.notes, *not_searched], started)


# `Policy` is part of this module's vocabulary for readers of `_Space.frugal`.
__all__ = ["fit", "Policy"]
