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
   the named values it saves; after a compile of a plan of the same base the bound is
   raised by what XLA added there (the least seen). A candidate whose bound exceeds a
   budget is not compiled.
3. **Compile in order of predicted time** (ties: fewer bytes moved, then fewer FLOPs
   recomputed): each candidate is traced exactly and compiled for the target; the
   compile decides whether it fits. The search stops at the first candidate predicted
   slower than the best plan that fits, or after `max_compiles` compiles.
"""

import dataclasses
import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from ._activations import Policy
from ._errors import ContractError
from ._estimate import (
    Costs,
    Delta,
    Load,
    StepEstimate,
    estimate_from,
    load_of,
    predict,
    speeds_of,
    trace_costs,
)
from ._fit_result import Candidate, FitResult
from ._fit_space import (
    Choice,
    NamedValue,
    carry_note,
    choices,
    describe_part,
    named_values,
)
from ._host_compute import host_update_problem
from ._jit import FilterJit, filter_jit
from ._memory_report import memory_report
from ._options import checks_options
from ._table import format_bytes
from ._targets import Target, get_target

_NO_BUDGET = "ox.fit: target {target!r} has no known device memory; pass `device_budget=` in bytes."
_NOTHING_FITS = (
    "ox.fit: no plan of this step fits {target!r} within a device budget of {budget} and "
    "a host budget of {host_budget}. The least device memory found was {least} ({host} "
    "on the host), by the plan {plan}. {hint}"
)


def _key(seconds: float, load: Load) -> tuple:
    # Equal times (to 6 significant digits) go to the plan that moves and recomputes least.
    return (float(f"{seconds:.6g}"), load.moved, load.recompute_flops)


def _is_out_of_memory(error: Exception) -> bool:
    text = str(error)
    return "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower()


class _Search:
    def __init__(self, step: FilterJit, args: tuple, kwargs: dict, target: Target, progress):
        self.step, self.args, self.kwargs, self.target = step, args, kwargs, target
        self.speeds = speeds_of(target)
        self.progress = progress or (lambda line: None)
        self.costs: dict[Choice, Costs | Exception] = {}
        self.wrappers: dict[Choice, FilterJit] = {}
        self.traces = self.compiles = 0
        self.fixed: dict[str, Any] = {}
        self.best_label = "none yet"

    def wrapper(self, choice: Choice) -> FilterJit:
        # One wrapper per plan: its trace, plan and compile are asked for several times.
        if choice not in self.wrappers:
            self.wrappers[choice] = filter_jit(
                self.step.fn,
                strategy=choice.strategy(self.fixed),
                donate=self.step.donate,
                mesh=self.step.mesh,
            )
        return self.wrappers[choice]

    def trace(self, choice: Choice) -> Costs | Exception:
        if choice not in self.costs:
            try:
                self.costs[choice] = trace_costs(
                    self.wrapper(choice), self.args, self.kwargs, self.speeds
                )
            except ContractError as error:  # e.g. a name with nothing to offload
                self.costs[choice] = error
            except ValueError as error:  # a streamed optimizer cannot update on the host
                if choice.optimizer != "host":
                    raise
                self.costs[choice] = error
            self.traces += 1
            self.report()
        return self.costs[choice]

    def report(self) -> None:
        self.progress(
            f"ox.fit {self.target.name}: {self.traces} traced, {self.compiles} compiled, "
            f"best so far: {self.best_label}"
        )

    def argument_bytes(self, choice: Choice, memory: str) -> int:
        """Bytes of the arguments a plan puts in `memory` ("device" counts unmanaged
        leaves too: they stay where they are, on the device)."""
        plan = self.wrapper(choice).plan(*self.args, **self.kwargs)
        memories = (None, "device") if memory == "device" else (memory,)
        return sum(
            int(np.prod(leaf.shape, dtype=np.int64)) * np.dtype(leaf.dtype).itemsize
            for leaf in plan.leaves
            if leaf.memory in memories
        )

    def device_arguments(self, choice: Choice) -> int:
        return self.argument_bytes(choice, "device")


@checks_options
def fit(
    step: Callable[..., Any],
    *args: Any,
    target: "str | Target",
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
    state live (device, pinned_host). A name that is a scan's loop carry is not searched
    (`FitResult.notes` says why). See the module doc for the search.

    **Returns:** an `ox.FitResult`: `.strategy` (an `ox.Strategy` for `ox.filter_jit`),
    `.estimate`, `.candidates`.

    **Raises:** `ValueError` when no plan fits, naming the least device memory found and
    its plan. Before any work: `TypeError`/`ValueError` for a budget or `max_compiles`
    that is not a positive int of any integer type (the host budget may be 0).
    """
    resolved = get_target(target)
    budget = device_budget if device_budget is not None else resolved.capacity
    if budget is None:
        raise ValueError(_NO_BUDGET.format(target=resolved.name))
    wrapper = step if isinstance(step, FilterJit) else filter_jit(step)
    search = _Search(wrapper, args, kwargs, resolved, progress)
    host_limit = host_budget if host_budget is not None else search.speeds.host_memory
    start = time.perf_counter()

    plan = wrapper.plan(*args, **kwargs)
    roles = {leaf.role for leaf in plan.leaves}
    declared = {name: policy for name, (policy, _) in plan.declared_activations.items()}
    params = ("device", "pinned_host") if "param" in roles else ("device",)
    # "host": the state in host memory, updated there, where the target can compute.
    host = ("host",) if host_update_problem(resolved.platform) is None else ()
    optimizer = ("device", "pinned_host", *host) if "optimizer" in roles else ("device",)

    # The plan that recomputes everything: which names the forward pass produces, which
    # of them are loop carries.
    everything: tuple[tuple[str, Policy], ...] = tuple((n, "remat") for n in sorted(declared))
    remat = Choice("remat", everything, "device", "device")
    first = search.trace(remat)
    if isinstance(first, Exception):
        raise first
    produced = named_values(first.jaxpr)
    notes = []
    for name in sorted(declared):
        value = produced.get(name)
        if value is not None and value.carry:
            search.fixed[name] = "remat"
            notes.append(carry_note(name, "remat"))
    names = [n for n in sorted(declared) if n in produced and n not in search.fixed]
    remat = Choice("remat", tuple((n, "remat") for n in names), "device", "device")
    save = Choice("save", tuple((n, "save") for n in names), "device", "device")
    all_choices = choices(names, params, optimizer)

    # Step 1: price every candidate from one-choice variants.
    loads, not_searched = _compose(search, remat, save, names, params, optimizer, all_choices)
    notes += not_searched
    priced = []
    for choice, load in loads.items():
        seconds, _ = predict(load, search.speeds)
        priced.append((_key(seconds, load), seconds, choice, load))
    priced.sort(key=lambda item: item[0])

    # Steps 2 and 3: bound, compile in order, stop when the rest is slower.
    offsets: dict[str, int] = {}
    # What a refused compile (XLA:TPU raises instead of reporting memory) says of its base:
    # XLA adds at least this much; used for a base that no compile has measured.
    refused: dict[str, int] = {}
    rows: dict[Choice, Candidate] = {}
    best: tuple[tuple, Choice, StepEstimate] | None = None
    least: tuple[int, int, str] | None = None
    pruned: list[tuple[int, Choice]] = []  # (predicted device bytes, plan) not compiled
    for key, seconds, choice, load in priced:
        label = choice.label
        if best is not None and key > best[0]:
            rows[choice] = Candidate(
                label, None, seconds, load.moved, load.recompute_flops, None, None,
                "not compiled: predicted slower than the best plan that fits",
            )  # fmt: skip
            continue
        offset = offsets.get(choice.base, refused.get(choice.base))
        bound = search.device_arguments(choice) + (
            offset + _saved(choice, produced) if offset is not None else 0
        )
        host_bound = _host_bound(search, choice, produced)
        if bound > budget or host_bound > host_limit or search.compiles >= max_compiles:
            why = (
                f"not compiled: predicted to need {format_bytes(bound)} of device memory"
                if bound > budget
                else f"not compiled: needs at least {format_bytes(host_bound)} of host memory"
                if host_bound > host_limit
                else f"not compiled: the {max_compiles} compiles allowed were used"
            )
            rows[choice] = Candidate(
                label, None, seconds, load.moved, load.recompute_flops, None, None, why
            )
            if bound > budget:
                pruned.append((bound, choice))
            continue
        costs = search.trace(choice)
        if isinstance(costs, Exception):
            rows[choice] = Candidate(label, None, seconds, 0, 0, None, None, str(costs)[:120])
            continue
        exact = estimate_from(search.wrapper(choice), args, kwargs, resolved, costs, compile=False)
        exact_key = _key(exact.seconds, load_of(costs))
        search.compiles += 1
        try:
            report = memory_report(search.wrapper(choice), *args, target=resolved, **kwargs)
        except Exception as error:
            if not _is_out_of_memory(error):
                # A compiler crash on one plan (XLA:TPU crashes on some host-resident
                # layouts) is that plan's answer, shown in its row, not the search's end.
                first = str(error).strip().splitlines()[0][:160] if str(error).strip() else ""
                status = f"compile failed: {type(error).__name__}: {first}"
                rows[choice] = Candidate(
                    label, None, exact.seconds, load.moved, exact.recompute_flops, None, None,
                    status,
                )  # fmt: skip
                search.report()
                continue
            # More than the budget: plans of this base needing as much before what XLA
            # adds are not compiled again (without this, every one of them would be).
            needed = budget + 1 - search.device_arguments(choice) - _saved(choice, produced)
            refused[choice.base] = max(refused.get(choice.base, needed), needed)
            status = "does not fit: the compiler ran out of device memory"
            rows[choice] = Candidate(
                label, None, exact.seconds, load.moved, exact.recompute_flops, None, None, status
            )
            search.report()
            continue
        device, host = report.total, report.host_total
        added = device - search.device_arguments(choice) - _saved(choice, produced)
        offsets[choice.base] = min(offsets.get(choice.base, added), added)
        if least is None or device < least[0]:
            least = (device, host, label)
        fits = device <= budget and host <= host_limit
        status = (
            "fits"
            if fits
            else f"over the device budget by {format_bytes(device - budget)}"
            if device > budget
            else f"over the host budget by {format_bytes(host - host_limit)}"
        )
        rows[choice] = Candidate(
            label, None, exact.seconds, exact.h2d_bytes + exact.d2h_bytes,
            exact.recompute_flops, device, host, status,
        )  # fmt: skip
        if fits and (best is None or exact_key < best[0]):
            best = (
                exact_key,
                choice,
                dataclasses.replace(exact, device_bytes=device, host_bytes=host),
            )
            search.best_label = f"{label} ({exact.seconds * 1e3:.3f} ms)"
        search.report()

    if best is None and least is None and pruned:
        # Every plan was predicted too large: compile the smallest of each base, so that
        # the error names a measured least memory rather than a prediction.
        for base in ("remat", "save"):
            of_base = [item for item in pruned if item[1].base == base]
            if not of_base:
                continue
            _, smallest = min(of_base, key=lambda item: (item[0], _saved(item[1], produced)))
            search.compiles += 1
            try:
                report = memory_report(search.wrapper(smallest), *args, target=resolved, **kwargs)
            except Exception as error:
                if _is_out_of_memory(error):
                    continue
                raise
            if least is None or report.total < least[0]:
                least = (report.total, report.host_total, smallest.label)
            rows[smallest] = dataclasses.replace(
                rows[smallest],
                device_bytes=report.total,
                host_bytes=report.host_total,
                status="does not fit: compiled as its base's plan predicted smallest",
            )
    if best is None:
        outcomes: dict[str, int] = {}
        for row in rows.values():
            if row.status.startswith(("does not fit", "compile failed")):
                kind = row.status.split(":")[0]
                outcomes[kind] = outcomes.get(kind, 0) + 1
        tried = "; ".join(f"{n} {kind}" for kind, n in outcomes.items())
        if least is None:
            compiled = (
                f"The {search.compiles} compiles measured no memory ({tried}). "
                if search.compiles
                else "No candidate was compiled: each one's bound exceeds a budget. "
            )
            hint = (
                compiled + f"Raise `max_compiles` (now {max_compiles}) or a budget, lower the "
                "batch (`ox.max_batch`), or see the first failing compile's message."
            )
            raise ValueError(
                f"ox.fit: no plan of this step fits {resolved.name!r} within a device budget "
                f"of {format_bytes(budget)} and a host budget of {format_bytes(host_limit)}. "
                + hint
                + "".join(
                    f"\n  {row.label}: {row.status}"
                    for row in rows.values()
                    if row.status.startswith(("does not fit", "compile failed"))
                )
            )
        hint = "Lower the batch (`ox.max_batch` finds the largest that fits) or raise a budget."
        raise ValueError(
            _NOTHING_FITS.format(
                target=resolved.name, budget=format_bytes(budget),
                host_budget=format_bytes(host_limit), least=format_bytes(least[0]),
                host=format_bytes(least[1]), plan=least[2], hint=hint,
            )
        )  # fmt: skip
    _, choice, chosen = best
    candidates = []
    for c, row in rows.items():
        status = "best" if c == choice else row.status
        candidates.append(
            dataclasses.replace(row, strategy=c.strategy(search.fixed), status=status)
        )
    return FitResult(
        strategy=choice.strategy(search.fixed),
        estimate=chosen,
        candidates=tuple(candidates),
        traces=search.traces,
        compiles=search.compiles,
        seconds_searching=time.perf_counter() - start,
        notes=tuple(notes),
    )


def _compose(search, remat, save, names, params, optimizer, all_choices) -> tuple[dict, list]:
    """Every candidate's load (or why it cannot run), composed from one-choice variants."""
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
    loads: dict[Choice, Load] = {}
    for choice in all_choices:
        load = base_loads[choice.base]
        parts = [(choice.base, n, p) for n, p in choice.names if p != choice.base]
        if (choice.params, choice.optimizer) != ("device", "device"):
            parts.append(("placement", choice.params, choice.optimizer))
        for part in parts:
            delta = deltas[part]
            if isinstance(load, str) or isinstance(delta, str):
                load = None
                break
            load = load + delta
        if isinstance(load, Load):
            loads[choice] = load
    return loads, notes


def _load(costs: Costs | Exception) -> Load | str:
    if isinstance(costs, Exception):
        return "fails: " + str(costs).split(". ")[0][:200]
    return load_of(costs)


def _delta(costs: Costs | Exception, base: Load | str) -> Delta | str:
    """What a variant changes from its base (or why the variant, or its base, fails)."""
    load = _load(costs)
    if isinstance(base, str):
        return base
    return load if isinstance(load, str) else load - base


def _saved(choice: Choice, produced: Mapping[str, NamedValue]) -> int:
    """Bytes of the named values a plan recomputing everything else saves."""
    if choice.base == "save":
        return 0  # the save base keeps whatever XLA's residuals are, not the names
    return sum(produced[n].bytes for n, p in choice.names if p == "save" and n in produced)


def _host_bound(search: _Search, choice: Choice, produced: Mapping[str, NamedValue]) -> int:
    offloaded = sum(produced[n].bytes for n, p in choice.names if p == "offload" and n in produced)
    return search.argument_bytes(choice, "pinned_host") + offloaded
