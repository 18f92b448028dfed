"""What `ox.fit` returns: the chosen plan, its estimate, and every candidate it weighed."""

import dataclasses
import time
from typing import Any

from .._base.compiler_faults import CompilerFaultError
from .._base.table import format_bytes, format_table
from .._planning.estimate import StepEstimate, with_simulation
from .search import Search
from .space import Candidate, Space

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
_EVERY_PLAN_FAULTED = (
    "ox.fit: each of the {count} plans compiled for {target!r} failed through a known "
    "fault of this release's compiler, so no plan can be measured here and more compiles "
    "cannot help. The first: "
)
_LEAST = " The least device memory measured was {least} ({host} on the host), by {plan}."
_UNPRICED = (
    "The step calls {count} kernel{s} no rule prices: {kernels}. Each is priced by the bytes "
    "it reads and writes alone, its FLOPs not counted, so every plan's time leaves that "
    "work out (a Pallas kernel is priced by the `pl.CostEstimate` it declares)."
)
# What each status that rules a plan out by memory says, and the budget it is over.
_BUDGET_OF = {
    "over the device budget": "device",
    "not compiled: predicted to need": "device",
    "not compiled: keeps at least what": "device",
    "does not fit: the compiler ran out of device memory": "device",
    "over the host budget": "host",
    "not compiled: needs at least": "host",
}
_CRASHED = (
    " {count} more plans were not compiled because plans of the same placement crashed "
    "the compiler (listed below): a compiler limit, not a memory one; another target or "
    "placement may avoid it."
)


@dataclasses.dataclass(frozen=True)
class FitResult:
    """What `ox.fit` chose, and every candidate with why it was or was not chosen.

    - `strategy`: the chosen plan as an `ox.Strategy`: give it to
        `ox.filter_jit(fn, strategy=...)`.
    - `estimate`: its `ox.StepEstimate`, compiled: device and host bytes, and `seconds`
        from its compiled program's schedule (`traced_seconds`: the jaxpr count the
        search ordered and pruned candidates by, the `ms` column of `table()`).
    - `candidates`: every `ox.Candidate` considered, in the order the search met them.
    - `traces`, `compiles`, `seconds_searching`: what the search cost.
    - `notes`: what was not searched, and why (a plain scan's loop carry, a plan that fails),
        and the kernels no rule prices when the step calls any.
    - `device_budget`, `host_budget`: the budgets searched within, in bytes per device.
    - `binds`: which budgets ruled out a plan predicted faster than the chosen one,
        `"device"`, `"host"`, both, or neither (`()`: the fastest plan fits);
        `binding()` says it in a sentence, with the chosen plan's headroom.

    `table()` prints the chosen plan, the binding budget, the notes and the candidates;
    `to_dict()` for JSON.
    """

    strategy: Any
    estimate: StepEstimate
    candidates: tuple[Candidate, ...]
    traces: int
    compiles: int
    seconds_searching: float
    notes: tuple[str, ...] = ()
    device_budget: int | None = None
    host_budget: int | None = None

    @property
    def binds(self) -> tuple[str, ...]:
        """The budgets that ruled out a plan the count predicts faster than the chosen
        one: a candidate over the device budget (compiled, or bounded before compiling)
        binds the device, one over the host budget binds the host."""
        found = {budget for _, budget in self._faster_over_budget()}
        return tuple(budget for budget in ("device", "host") if budget in found)

    def binding(self) -> str:
        """Which budget binds, in a sentence, with the chosen plan's memory against each."""
        binds, count = self.binds, len(self._faster_over_budget())
        what = (
            "neither budget binds: the fastest plan fits"
            if not binds
            else f"the {' and the '.join(binds)} budget{'s bind' if len(binds) > 1 else ' binds'}"
            f" ({count} faster plan{'s' if count > 1 else ''} over it)"
        )
        return f"{what}; chosen plan: {self._against('device')}, {self._against('host')}."

    def _faster_over_budget(self) -> list[tuple[Candidate, str]]:
        chosen = next((c for c in self.candidates if c.status == "best"), None)
        fastest = chosen.seconds if chosen is not None else self.estimate.seconds
        return [
            (c, budget)
            for c in self.candidates
            if c.seconds < fastest
            for prefix, budget in _BUDGET_OF.items()
            if c.status.startswith(prefix)
        ]

    def _against(self, memory: str) -> str:
        used = self.estimate.device_bytes if memory == "device" else self.estimate.host_bytes
        budget = self.device_budget if memory == "device" else self.host_budget
        text = f"{memory} {format_bytes(used or 0)}"
        return text if budget is None else f"{text} of {format_bytes(budget)}"

    def to_dict(self) -> dict[str, Any]:
        """The result as plain values (the strategy by its name), for JSON."""
        return {
            "strategy": self.strategy.name,
            "estimate": self.estimate.to_dict(),
            "candidates": [c.as_dict() for c in self.candidates],
            "traces": self.traces,
            "compiles": self.compiles,
            "seconds_searching": self.seconds_searching,
            "notes": list(self.notes),
            "device_budget": self.device_budget,
            "host_budget": self.host_budget,
            "binds": list(self.binds),
        }

    def table(self, limit: int = 10) -> str:
        """The chosen plan, the notes, every compiled candidate and the `limit` next
        fastest others (the rest counted by status)."""
        shown = [c for c in self.candidates if c.device_bytes is not None or c.status == "best"]
        rest = [c for c in self.candidates if c not in shown]
        shown += rest[:limit]
        counts: dict[str, int] = {}
        for c in rest[limit:]:
            counts[c.status] = counts.get(c.status, 0) + 1
        rows = [
            (
                c.label,
                f"{c.seconds * 1e3:.3f}",
                "-" if c.simulated_seconds is None else f"{c.simulated_seconds * 1e3:.3f}",
                format_bytes(int(c.moved)),
                "-" if c.device_bytes is None else format_bytes(c.device_bytes),
                "-" if c.host_bytes is None else format_bytes(c.host_bytes),
                c.status,
            )
            for c in shown
        ]
        more = [f"... and {n} more: {status}" for status, n in counts.items()]
        return "\n".join(
            [
                f"ox.fit on {self.estimate.target!r}: {self.strategy.name} "
                f"({self.estimate.seconds * 1e3:.3f} ms predicted{self._traced()}; "
                f"{self.traces} traces, {self.compiles} compiles, "
                f"{self.seconds_searching:.1f} s)",
                f"Budgets: {self.binding()}",
                *self.notes,
                format_table(
                    ("plan", "ms", "sim ms", "moved", "device", "host", "status"),
                    rows,
                    numeric=False,
                ),
                *more,
            ]
        )

    def _traced(self) -> str:
        traced = self.estimate.traced_seconds
        if self.estimate.simulation is None or traced is None:
            return ""
        return (
            f" from its compiled program, the sim ms column; the jaxpr count, the ms "
            f"column, says {traced * 1e3:.3f}"
        )

    def __str__(self) -> str:
        return self.table()

    __repr__ = __str__


def explain(search: Search, space: Space) -> Exception:
    """Why no plan fits: shown by the most frugal plan's compile, or not shown (plans that
    might fit were left untried), with the compiler's crashes listed; the known compiler
    fault every compiled plan met, where they all met one (more compiles cannot help)."""
    if search.faults and len(search.faults) == search.compiles:
        return CompilerFaultError(
            _EVERY_PLAN_FAULTED.format(count=search.compiles, target=search.target.name)
            + str(search.faults[0])
        )
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
        if row.status.startswith(("does not fit", "compile failed", "XLA aborted"))
    ]
    skipped = sum("crashed the compiler" in row.status for row in search.rows.values())
    if skipped:
        message += _CRASHED.format(count=skipped)
    return ValueError(message + "".join(failed))


def result_of(search: Search, notes: list[str], started: float) -> FitResult:
    fastest = search.fastest_simulated()
    assert fastest is not None
    choice, chosen = fastest
    candidates = [
        dataclasses.replace(
            row, strategy=c.strategy(search.fixed), status="best" if c == choice else row.status
        )
        for c, row in search.rows.items()
    ]
    assert chosen.simulation is not None
    chosen = with_simulation(chosen, chosen.simulation)
    unpriced = chosen.unpriced
    if unpriced:
        kernels = "; ".join(unpriced[:3]) + ("; ..." if len(unpriced) > 3 else "")
        s = "" if len(unpriced) == 1 else "s"
        notes = [*notes, _UNPRICED.format(count=len(unpriced), s=s, kernels=kernels)]
    return FitResult(
        strategy=choice.strategy(search.fixed),
        estimate=chosen,
        candidates=tuple(candidates),
        traces=search.traces,
        compiles=search.compiles,
        seconds_searching=time.perf_counter() - started,
        notes=tuple(notes),
        device_budget=search.budget,
        host_budget=search.host_limit,
    )
