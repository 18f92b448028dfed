"""What `ox.fit` returns: the chosen plan, its estimate, and every candidate it weighed."""

import dataclasses
from typing import Any

from ._estimate import StepEstimate
from ._table import format_bytes, format_table


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One plan `ox.fit` considered: its predicted time and, if compiled, its memory.

    - `label`: the plan in one line (`remat[h=save] params=device optimizer=pinned_host`).
    - `strategy`: the `ox.Strategy` that compiles it.
    - `seconds`: the predicted step time (from an exact trace when compiled, composed
        from the traces of its parts otherwise).
    - `moved`: bytes across the host link per step, both ways.
    - `recompute_flops`: the FLOPs of the recomputation.
    - `device_bytes`, `host_bytes`: the compiled memory per device (None: not compiled).
    - `status`: `"best"`, `"fits"`, or why it was not chosen (`"over the device budget
        by 2.05 GiB"`, `"not compiled: predicted slower than the best plan that fits"`).
    """

    label: str
    strategy: Any  # ox.Strategy
    seconds: float  # predicted (exact trace when compiled, composed otherwise)
    moved: float  # bytes across the host link per step
    recompute_flops: float
    device_bytes: int | None  # compiled (None: not compiled)
    host_bytes: int | None
    status: str  # "fits", "best", or why not

    def as_dict(self) -> dict[str, Any]:
        """Every field but `strategy` as plain values, for JSON."""
        return {k: v for k, v in dataclasses.asdict(self).items() if k != "strategy"}


@dataclasses.dataclass(frozen=True)
class FitResult:
    """What `ox.fit` chose, and every candidate with why it was or was not chosen.

    - `strategy`: the chosen plan as an `ox.Strategy`: give it to
        `ox.filter_jit(fn, strategy=...)`.
    - `estimate`: its `ox.StepEstimate` (compiled: device and host bytes included).
    - `candidates`: every `ox.Candidate` considered, in the order the search met them.
    - `traces`, `compiles`, `seconds_searching`: what the search cost.
    - `notes`: what was not searched, and why (a scan's loop carry, a plan that fails).

    `table()` prints the chosen plan, the notes and the candidates; `to_dict()` for JSON.
    """

    strategy: Any
    estimate: StepEstimate
    candidates: tuple[Candidate, ...]
    traces: int
    compiles: int
    seconds_searching: float
    notes: tuple[str, ...] = ()

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
                f"({self.estimate.seconds * 1e3:.3f} ms predicted; {self.traces} traces, "
                f"{self.compiles} compiles, {self.seconds_searching:.1f} s)",
                *self.notes,
                format_table(
                    ("plan", "ms", "moved", "device", "host", "status"), rows, numeric=False
                ),
                *more,
            ]
        )

    def __str__(self) -> str:
        return self.table()

    __repr__ = __str__
