"""The jaxpr count's time model: a step's work and transfers, counted on its trace, priced
per phase before anything is compiled.

`ox.estimate(..., compile=False)` answers from it, and `ox.fit` orders and prunes its
candidates with it (a `Load` adds and subtracts, so the load of a plan is composed from
the loads of plans that differ from it in one choice). Per phase:

- compute: each matmul takes `max(flops / (peak x efficiency), bytes / HBM bandwidth)`
  (a roofline; the efficiency of a `dot_general` by its shape where the target has a
  table, `ox.matmul_efficiency`), every other equation `bytes written / HBM bandwidth`;
- link: host-to-device bytes / h2d bandwidth and device-to-host bytes / d2h
  bandwidth, the two directions at once (PCIe is full duplex);
- host: work run on the host (`compute_on("device_host")`) at the host's rates;
- overlap: compute, both link directions and host work run concurrently, so a phase
  takes the longest of them, plus what cannot hide: the largest single copy of each
  direction (one scan iteration's chunk);
- phases run one after another. Copies of arguments that are not yet where the plan
  puts them (`phase="call"` in the audit) are not priced.

It sees the program before XLA fuses, schedules and lays it out: it assumes overlap
that the compiled schedule may not have, and prices no kernel launches, layout copies or
collectives. `schedule.py` prices the compiled program instead.
"""

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any

import numpy as np

from .._inspect.program_audit import audit_traced_for
from .._inspect.transfer_report import Transfer
from .._jit.jit import FilterJit
from .._targets.calibrate import cpu_speeds
from .._targets.speeds import matmul_efficiency
from .._targets.targets import Speeds, Target
from .flops import PhaseWork, count_work, kernel_table
from .host_work import host_computation_bandwidth

PHASES = ("forward", "backward", "update")


def speeds_of(target: Target) -> Speeds:
    """The target's `Speeds`: its datasheet figures, or this machine's, measured."""
    if target.speeds is not None:
        return target.speeds
    if target.platform == "cpu":
        return cpu_speeds()
    raise ValueError(
        f"Target {target.name!r} has no `speeds`, so its step time cannot be predicted. "
        "Give it `Target(..., speeds=ox.Speeds(flops=..., efficiency=..., ...))` with the "
        "chip's published figures (see `offload_eqx/_targets/targets.py` for the H100's)."
    )


@dataclasses.dataclass(frozen=True)
class PhaseTime:
    """Predicted seconds of one phase: each resource's busy time and the phase's total."""

    compute: float
    h2d: float
    d2h: float
    host: float
    exposed: float  # copies that cannot hide behind compute
    seconds: float


@dataclasses.dataclass(frozen=True)
class Costs:
    """What one trace of a step gives, before any compile: work and transfers per phase,
    per device."""

    work: Mapping[str, PhaseWork]
    transfers: tuple[Transfer, ...]
    devices: int
    jaxpr: Any = dataclasses.field(default=None, repr=False, compare=False)
    # The values of the constants the program closes over (a splash kernel's block mask).
    constants: Mapping[Any, Any] = dataclasses.field(
        default_factory=dict, repr=False, compare=False
    )
    # What the program says of its Pallas kernels, for the compiled simulation.
    kernels: Mapping[Any, Any] = dataclasses.field(default_factory=dict, repr=False, compare=False)

    @property
    def unpriced(self) -> tuple[tuple[str, float], ...]:
        """The kernels no rule prices, `(what, bytes)`, over every phase."""
        return tuple(item for w in self.work.values() for item in w.unpriced)

    @property
    def flops(self) -> float:
        return sum(w.flops for w in self.work.values()) / self.devices

    @property
    def recompute_flops(self) -> float:
        return sum(w.recompute_flops for w in self.work.values()) / self.devices

    def bytes(self, direction: str, phase: str | None = None) -> float:
        return (
            sum(
                t.bytes
                for t in self.transfers
                if t.direction == direction and (phase is None or t.phase == phase)
            )
            / self.devices
        )


def trace_costs(step: FilterJit, args: tuple, kwargs: Mapping[str, Any], target: Target) -> Costs:
    """Trace `step` once (nothing compiled): its work priced at the target's speeds, its
    transfers. The trace comes first: a call it refuses (a missing argument, a shape
    mismatch) fails before the CPU's speeds are measured (a second or more). Traced for
    the target's platform: the program its compile would see (on a GPU, the host update
    split and sliced, calling the GPU host's kernel)."""
    report, jaxpr, constants = audit_traced_for(target.platform, step, args, dict(kwargs))
    plan = step.plan(*args, **kwargs)
    work = _work(jaxpr, speeds_of(target), constants)
    kernels = kernel_table(jaxpr, constants)
    return Costs(work, tuple(report.transfers), plan.devices, jaxpr, constants, kernels)


def priced_at(costs: Costs, speeds: Speeds) -> Costs:
    """The same trace's work priced again at other `speeds` (no trace)."""
    return dataclasses.replace(costs, work=_work(costs.jaxpr, speeds, costs.constants))


def _work(jaxpr: Any, speeds: Speeds, constants: Mapping[Any, Any]) -> Mapping[str, PhaseWork]:
    return count_work(
        jaxpr,
        flop_rate=speeds.flops * speeds.efficiency,
        byte_rate=speeds.memory_bandwidth,
        host_flop_rate=speeds.host_flops,
        host_byte_rate=host_computation_bandwidth(speeds),
        peak_flop_rate=speeds.flops,
        constants=dict(constants),
        matmul_efficiency=(
            None
            if speeds.matmul_efficiency is None
            else functools.partial(matmul_efficiency, speeds)
        ),
    )


@dataclasses.dataclass(frozen=True)
class Load:
    """A step's demand on each resource per phase, per device: what the time model
    prices. Sums add and chunks take the maximum, so that `ox.fit` can compose the load
    of a plan from the loads of the plans that differ from it in one choice each.

    `sums[phase]` holds (compute seconds, host seconds, h2d bytes, d2h bytes);
    `chunks[phase]` the largest single copy of each direction (h2d, d2h), bytes;
    `before` the h2d and d2h bytes copied before the program runs (first call only, not
    priced); `flops` and
    `recompute_flops` the counted work.
    """

    sums: np.ndarray  # (3 phases, 4)
    chunks: np.ndarray  # (3 phases, 2)
    before: np.ndarray  # (2,)
    flops: float
    recompute_flops: float

    def __add__(self, delta: "Delta") -> "Load":
        return Load(
            np.maximum(self.sums + delta.sums, 0.0),
            np.maximum(self.chunks, delta.chunks),
            np.maximum(self.before + delta.before, 0.0),
            max(self.flops + delta.flops, 0.0),
            max(self.recompute_flops + delta.recompute_flops, 0.0),
        )

    def __sub__(self, other: "Load") -> "Delta":
        return Delta(
            self.sums - other.sums,
            self.chunks,
            self.before - other.before,
            self.flops - other.flops,
            self.recompute_flops - other.recompute_flops,
        )

    @property
    def moved(self) -> float:
        return float(self.sums[:, 2:].sum())


@dataclasses.dataclass(frozen=True)
class Delta:
    """The difference one choice makes to a `Load` (its chunks are the variant's)."""

    sums: np.ndarray
    chunks: np.ndarray
    before: np.ndarray
    flops: float
    recompute_flops: float

    def __mul__(self, share: float) -> "Delta":
        """The difference made in a share of the layers (a name saved in `k` of `L`)."""
        return Delta(
            self.sums * share,
            self.chunks,
            self.before * share,
            self.flops * share,
            self.recompute_flops * share,
        )


def load_of(costs: Costs) -> Load:
    n = costs.devices
    sums = np.zeros((len(PHASES), 4))
    chunks = np.zeros((len(PHASES), 2))
    for i, phase in enumerate(PHASES):
        work = costs.work[phase]
        sums[i, 0] = work.seconds / n
        sums[i, 1] = work.host_seconds / n
    before = np.zeros(2)
    for t in costs.transfers:
        column = 0 if t.direction == "host-to-device" else 1
        if t.phase not in PHASES:
            before[column] += t.bytes / n
            continue
        i = PHASES.index(t.phase)
        sums[i, 2 + column] += t.bytes / n
        chunks[i, column] = max(chunks[i, column], t.bytes / max(t.count, 1) / n)
    return Load(sums, chunks, before, costs.flops, costs.recompute_flops)


def predict(load: Load, speeds: Speeds) -> tuple[float, dict[str, PhaseTime]]:
    """Predicted seconds of one step, and each phase's (the model in the module doc)."""
    phases = {}
    for i, phase in enumerate(PHASES):
        compute, host, down, up = load.sums[i]
        h2d, d2h = down / speeds.h2d_bandwidth, up / speeds.d2h_bandwidth
        exposed = (
            load.chunks[i, 0] / speeds.h2d_bandwidth + load.chunks[i, 1] / speeds.d2h_bandwidth
        )
        busy = max(compute, h2d, d2h, host)
        seconds = busy + (exposed if busy > 0 else 0.0)
        phases[phase] = PhaseTime(
            float(compute), float(h2d), float(d2h), float(host), float(exposed), float(seconds)
        )
    return sum(p.seconds for p in phases.values()), phases
