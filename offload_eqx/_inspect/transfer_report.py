"""The audit's result: `TransferReport` and its `Transfer` rows.

These are the data types `ox.audit` hands back, kept apart from how they are found (the
jaxpr walk in `jaxpr_walk`, the entry point in `audit`) so that a reader of the report
API, its table and JSON, and its assertions (`check`, `assert_only`,
`assert_no_implicit`) need not read the walker. A `Transfer` is one move between memory
spaces per call of the step; a `Violation` (from `_base.errors`, with `ContractError`) is one
breach of the placement contract.
"""

import dataclasses
import fnmatch
import json
from typing import Any, Literal

from .._base.errors import ContractError as ContractError, Violation as Violation
from .._base.table import format_bytes, format_table

Direction = Literal["host-to-device", "device-to-host"]
Phase = Literal["forward", "backward", "update", "call"]
# What a row can move: `Transfer` refuses any other kind, and the audit guide
# (docs/guides/audit.md) says what each one is and what it costs.
KINDS = (
    "parameter",
    "optimizer",
    "activation",
    "gradient",
    "update",
    "output",
    "input",
    "callback",
    "intermediate",
)

_DIRECTIONS = {
    "host-to-device": "host-to-device",
    "h2d": "host-to-device",
    "device-to-host": "device-to-host",
    "d2h": "device-to-host",
}


@dataclasses.dataclass(frozen=True)
class Transfer:
    """One transfer of the program, per call of the step (a row of `ox.audit`'s table).

    - `direction`: `"host-to-device"` or `"device-to-host"`.
    - `kind`: what moves: `parameter`, `optimizer`, `activation`, `gradient`, `update`,
        `output`, `input` (an argument leaf the plan does not place: a batch, or a
        device-resident weight the host update reads), `callback` or `intermediate`.
    - `what`: a leaf path (`model.layers.w1`), an activation name, or a description.
    - `shape`, `dtype`: of one transfer.
    - `count`: how many times it happens per call (the product of the trip counts of the
        enclosing scans); `bytes`: size x itemsize x count.
    - `phase`: `forward`, `backward`, `update`, or `call` for an argument copied before
        the program runs.
    - `where`: the enclosing bodies, e.g. `"scan[10] > remat"`.
    - `implicit`: not asked for: JAX (or the caller) copies it behind your back.
    """

    direction: Direction
    kind: str  # one of KINDS
    what: str  # a leaf path, an activation name, or a description
    shape: tuple[int, ...]
    dtype: str
    count: int  # product of the trip counts of the enclosing scans
    bytes: int  # total per call: size x itemsize x count
    phase: Phase
    where: str  # enclosing bodies, e.g. "scan[10] > remat"
    implicit: bool = False  # not asked for: JAX (or the caller) copies it behind your back

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(
                f"Transfer of `{self.what}` has kind {self.kind!r}; expected one of "
                f"{', '.join(map(repr, KINDS))}. A new kind is added to `KINDS` and "
                "described in the audit guide (docs/guides/audit.md)."
            )

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self) | {"shape": list(self.shape)}


@dataclasses.dataclass(frozen=True)
class HostComputation:
    """A computation the step runs on the host (`ox.offload_optimizer(update_on="host")`):
    its operands are read and its results written in host memory; what it receives from
    the device is listed among the transfers, sent explicitly before it."""

    name: str  # "optimizer update", "apply updates", "optimizer update and apply"
    phase: Phase
    count: int
    operand_bytes: int  # per call: everything it reads in host memory
    result_bytes: int  # per call: everything it writes to host memory
    where: str

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class TransferReport:
    """What `ox.audit` found: the transfers of one call of a step, contract breaches, and
    the computations placed on the host.

    - `name`, `strategy`: the step's name and the strategy it was traced under.
    - `transfers`: every `ox.Transfer`, in program order.
    - `violations`: every `ox.Violation` of the placement contract (`ox.audit` raises
        them as an `ox.ContractError`).
    - `host_computations`: every `ox.HostComputation`.

    `print` it for a table. Query it with `select(...)`, `total(...)`, `totals`; pin it in
    tests with `assert_only(...)` and `assert_no_implicit()`; `to_json()` for a file.
    """

    name: str
    strategy: str
    transfers: list[Transfer]
    violations: list[Violation]
    host_computations: list[HostComputation] = dataclasses.field(default_factory=list)

    # -- queries ---------------------------------------------------------------------

    def select(
        self,
        direction: str | None = None,
        what: str | None = None,
        *,
        kind: str | None = None,
        phase: str | None = None,
    ) -> list[Transfer]:
        """The transfers matching every given filter (`what` is a glob pattern)."""
        direction = _direction(direction) if direction is not None else None
        return [
            t
            for t in self.transfers
            if (direction is None or t.direction == direction)
            and (what is None or fnmatch.fnmatchcase(t.what, what))
            and (kind is None or t.kind == kind)
            and (phase is None or t.phase == phase)
        ]

    def total(self, direction: str | None = None, what: str | None = None, **filters) -> int:
        """Bytes per call of the matching transfers."""
        return sum(t.bytes for t in self.select(direction, what, **filters))

    @property
    def totals(self) -> dict[str, int]:
        """Bytes per call each way: `{"device-to-host": ..., "host-to-device": ...}`."""
        return {d: self.total(d) for d in ("device-to-host", "host-to-device")}

    @property
    def implicit(self) -> list[Transfer]:
        """The transfers nobody asked for (arguments uploaded or copied per call)."""
        return [t for t in self.transfers if t.implicit]

    # -- assertions ------------------------------------------------------------------

    def check(self) -> "TransferReport":
        """Raise a `ContractError` listing every violation; return the report otherwise."""
        if self.violations:
            lines = "\n".join(f"  - {v.message}" for v in self.violations)
            raise ContractError(
                f"ox.audit({self.name}): the program breaks the placement contract in "
                f"{len(self.violations)} place(s):\n{lines}",
                self.violations,
                self,
            )
        return self

    def assert_no_implicit(self) -> "TransferReport":
        """Fail if any transfer is implicit (an argument uploaded or copied per call)."""
        if self.implicit:
            rows = "\n".join(f"  - {_describe(t)}" for t in self.implicit)
            raise AssertionError(
                f"ox.audit({self.name}): {len(self.implicit)} implicit transfer(s) per "
                f"call:\n{rows}\nMove each argument where the plan puts it once, outside "
                "the step (`jax.device_put`, `ox.place`)."
            )
        return self

    def assert_only(self, *expected: tuple) -> "TransferReport":
        """Pin the exact transfers of a step.

        Each expectation is `(direction, what)` or `(direction, what, bytes)` or
        `(direction, what, bytes, phase)`: `direction` is `"device-to-host"`/`"d2h"` or
        `"host-to-device"`/`"h2d"`, `what` a glob over the transfer's `what`, `bytes` the
        total per call of the transfers it matches (None: any). Every transfer must match
        an expectation, and every expectation must match a transfer.
        """
        problems = []
        claimed: set[int] = set()
        for item in expected:
            if not 2 <= len(item) <= 4:
                raise TypeError(
                    f"assert_only: expectation {item!r} should be (direction, what[, bytes"
                    "[, phase]]), e.g. ('d2h', 'x', 2.5 * 2**20)."
                )
            direction, what, *rest = item
            nbytes, phase = (*rest, None, None)[:2]
            matched = self.select(direction, what, phase=phase)
            claimed.update(id(t) for t in matched)
            label = f"{_direction(direction)} {what!r}" + (f" ({phase})" if phase else "")
            if not matched:
                problems.append(f"expected {label}, but no transfer matches it")
            elif nbytes is not None and sum(t.bytes for t in matched) != nbytes:
                got = sum(t.bytes for t in matched)
                problems.append(
                    f"expected {label} to move {format_bytes(int(nbytes))} ({int(nbytes)} bytes), "
                    f"but it moves {format_bytes(got)} ({got} bytes) in {len(matched)} transfer(s)"
                )
        for t in self.transfers:
            if id(t) not in claimed:
                problems.append(f"unexpected transfer: {_describe(t)}")
        if problems:
            raise AssertionError(
                f"ox.audit({self.name}): the transfers differ from the expected ones:\n"
                + "\n".join(f"  - {p}" for p in problems)
                + "\n\n"
                + self.table()
            )
        return self

    # -- output ----------------------------------------------------------------------

    def table(self) -> str:
        header = ("direction", "kind", "what", "shape", "dtype", "count", "bytes", "phase", "where")
        rows = [
            (
                t.direction + (" (implicit)" if t.implicit else ""),
                t.kind,
                t.what,
                "x".join(map(str, t.shape)) or "()",
                t.dtype,
                str(t.count),
                format_bytes(t.bytes),
                t.phase,
                t.where or "-",
            )
            for t in self.transfers
        ]
        lines = [f"Transfers per call of {self.name} (strategy {self.strategy!r})"]
        lines.append(format_table(header, rows))
        if not rows:
            lines.append("(no transfers)")
        for direction in ("device-to-host", "host-to-device"):
            phases = {}
            for t in self.select(direction):
                phases[t.phase] = phases.get(t.phase, 0) + t.bytes
            detail = ", ".join(f"{p} {format_bytes(b)}" for p, b in phases.items())
            lines.append(
                f"total {direction}: {format_bytes(self.total(direction))}"
                + (f" ({detail})" if detail else "")
            )
        for h in self.host_computations:
            lines.append(
                f"on the host: {h.name} ({h.phase}{', ' + h.where if h.where else ''}, "
                f"x{h.count}): reads {format_bytes(h.operand_bytes)}, writes "
                f"{format_bytes(h.result_bytes)} in host memory"
            )
        if self.violations:
            lines.append(f"violations ({len(self.violations)}):")
            lines += [f"  - {v.message}" for v in self.violations]
        return "\n".join(lines)

    __str__ = table

    def as_dict(self) -> dict[str, Any]:
        """The report as plain values: transfers, totals, violations, host computations."""
        return {
            "name": self.name,
            "strategy": self.strategy,
            "transfers": [t.as_dict() for t in self.transfers],
            "totals": self.totals,
            "violations": [dataclasses.asdict(v) for v in self.violations],
            "host_computations": [h.as_dict() for h in self.host_computations],
        }

    def to_json(self, **kwargs: Any) -> str:
        """`as_dict()` as JSON text (`json.dumps` keywords pass through; indent 2)."""
        options: dict[str, Any] = {"indent": 2} | kwargs
        return json.dumps(self.as_dict(), **options)


def _direction(direction: str) -> str:
    try:
        return _DIRECTIONS[direction]
    except KeyError:
        raise ValueError(
            f"Transfer direction {direction!r}; expected one of "
            + ", ".join(repr(d) for d in _DIRECTIONS)
            + "."
        ) from None


def _describe(t: Transfer) -> str:
    shape = "x".join(map(str, t.shape)) or "()"
    return (
        f"{t.direction} of {t.kind} `{t.what}` ({t.dtype}[{shape}] x {t.count} = "
        f"{format_bytes(t.bytes)}, {t.phase}{', in ' + t.where if t.where else ''})"
    )
