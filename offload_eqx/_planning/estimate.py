"""`ox.estimate`: a step's work, transfers, memory and predicted time on a target.

Three measurements and one model:

- **work**, counted on the traced program (`flops.count_work`): matmul and convolution
  FLOPs per phase (forward, backward, update), scan bodies times their length, the
  recomputation of rematerialised regions on its own, and the bytes the other equations
  write (the memory-bound work);
- **transfers**, from the audit's walk of the same program (`ox.audit`): host-to-device
  and device-to-host bytes per phase, each with the trip count of its enclosing scan;
- **memory**, from the compile for the target (`ox.memory_report`): device and host
  bytes, the real XLA:GPU/XLA:TPU compilers for a GPU or TPU target;
- **time**, predicted with the target's `Speeds` (`Target.speeds`; measured for
  `"cpu"`). The model, per phase:

  - compute: each matmul takes `max(flops / (peak x efficiency), bytes / HBM bandwidth)`
    (a roofline), every other equation `bytes written / HBM bandwidth`;
  - link: host-to-device bytes / h2d bandwidth and device-to-host bytes / d2h
    bandwidth, the two directions at once (PCIe is full duplex);
  - host: work run on the host (`compute_on("device_host")`) at the host's rates;
  - overlap: compute, both link directions and host work run concurrently (copy engines
    and DMA), so a phase takes the longest of them, plus what cannot hide: the largest
    single copy of each direction (one scan iteration's chunk: the first layer's fetch
    waits for nothing to hide behind, the last layer's write-back has nothing after it);
  - phases run one after another. Copies of arguments that are not yet where the plan
    puts them (`phase="call"` in the audit) are not priced: they happen on the first
    call only, after which every argument comes back in its planned memory.

What the model leaves out, on purpose: collectives over a mesh (flops and bytes are
divided evenly among the devices), kernel launch and fusion effects beyond the
roofline, and contention between copies and compute for HBM bandwidth.
"""

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from .._base.options import checks_options
from .._base.table import format_bytes, format_table
from .._inspect.audit import audit_traced
from .._inspect.memory_report import compiled_report
from .._inspect.transfer_report import Transfer
from .._jit.jit import FilterJit, filter_jit
from .._sharding.host_compute import check_host_compute
from .._targets.calibrate import cpu_speeds
from .._targets.targets import Speeds, Target, get_target
from .._targets.deviceless import program_of_step
from .flops import PhaseWork, count_work
from .schedule import RESOURCES, Simulation, simulate
from .timeline import write_timeline

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


def trace_costs(step: FilterJit, args: tuple, kwargs: Mapping[str, Any], speeds: Speeds) -> Costs:
    """Trace `step` once (nothing compiled): its work priced at `speeds`, its transfers."""
    report, jaxpr = audit_traced(step, *args, **kwargs)
    device_rate = speeds.flops * speeds.efficiency
    work = count_work(
        jaxpr,
        flop_rate=device_rate,
        byte_rate=speeds.memory_bandwidth,
        host_flop_rate=speeds.host_flops,
        host_byte_rate=speeds.host_bandwidth,
    )
    plan = step.plan(*args, **kwargs)
    devices = 1 if plan.mesh is None else int(np.prod(list(plan.mesh.shape.values())))
    return Costs(work, tuple(report.transfers), devices, jaxpr)


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


@dataclasses.dataclass(frozen=True)
class StepEstimate:
    """What `ox.estimate` predicts for one step on one target, per device.

    - `name`, `strategy`, `target`: the step's name, the strategy it was planned under
        and the target's name.
    - `flops`: every matmul and convolution FLOP the step runs (recomputation
        included; `recompute_flops` is that part).
    - `h2d_bytes`, `d2h_bytes`: what crosses the host link per step, each way.
    - `device_bytes`, `host_bytes`: the compiled memory (None when not compiled).
    - `seconds`: the predicted step time.
    - `phases`: its breakdown, `{"forward": ..., "backward": ..., "update": ...}`; each
        phase's predicted seconds of `compute`, `h2d`, `d2h` and `host` work, the
        `exposed` copies (the largest copy of each direction, which does not hide behind
        compute) and the phase's total `seconds`.
    - `speeds`: the `ox.Speeds` it was priced with; `capacity`: the target's device
        memory (None: unknown).
    - `notes`: `(phase, note)` pairs for what the counts leave out (a while loop is
        counted once).

    `print` it for a table; `to_dict()` for JSON.
    """

    name: str
    strategy: str
    target: str
    flops: float
    recompute_flops: float
    h2d_bytes: float
    d2h_bytes: float
    device_bytes: int | None
    host_bytes: int | None
    seconds: float
    phases: Mapping[str, PhaseTime]
    speeds: Speeds
    capacity: int | None = None
    # (phase, what the counts leave out): while loops are counted once
    notes: tuple[tuple[str, str], ...] = ()
    # The jaxpr count's prediction; `seconds` is the compiled program's where simulated.
    traced_seconds: float | None = None
    simulation: Simulation | None = dataclasses.field(default=None, repr=False, compare=False)

    @property
    def model(self) -> str:
        """`"compiled"`: `seconds` simulates the compiled program's schedule;
        `"traced"`: it is the jaxpr count's (`compile=False`)."""
        return "traced" if self.simulation is None else "compiled"

    def timeline(self, path: str) -> str:
        """Write the simulated step as Chrome trace-event JSON (open it in Perfetto,
        `ui.perfetto.dev`, or `chrome://tracing`, beside a `jax.profiler` trace): one
        track per resource (compute, h2d, d2h, host, network), one slice per kernel,
        copy, host computation or collective, with its `op_name` and phase. Returns
        `path`. Needs an estimate made with `compile=True`."""
        if self.simulation is None:
            raise ValueError(
                f"StepEstimate.timeline({path!r}): this estimate of {self.name!r} was made "
                "from the trace alone (`compile=False`), so there is no schedule to draw. "
                "Call `ox.estimate(..., compile=True)`."
            )
        return write_timeline(self.simulation, path, f"{self.name} ({self.strategy}) on {self.target}")

    @property
    def fits(self) -> bool | None:
        """Whether the compiled device memory is within the target's capacity."""
        if self.capacity is None or self.device_bytes is None:
            return None
        return self.device_bytes <= self.capacity

    def mfu(self, model_flops: float | None = None) -> float:
        """Model FLOPs utilisation: `model_flops` (default: the FLOPs without the
        recomputation) per predicted second, over the target's peak."""
        useful = self.flops - self.recompute_flops if model_flops is None else model_flops
        return useful / self.seconds / self.speeds.flops if self.seconds else 0.0

    def to_dict(self) -> dict[str, Any]:
        """Every field as plain values, with `fits` and `mfu()`, for JSON."""
        return {
            "name": self.name,
            "strategy": self.strategy,
            "target": self.target,
            "flops": self.flops,
            "recompute_flops": self.recompute_flops,
            "h2d_bytes": self.h2d_bytes,
            "d2h_bytes": self.d2h_bytes,
            "device_bytes": self.device_bytes,
            "host_bytes": self.host_bytes,
            "seconds": self.seconds,
            "fits": self.fits,
            "mfu": self.mfu(),
            "phases": {k: dataclasses.asdict(v) for k, v in self.phases.items()},
            "speeds": dataclasses.asdict(self.speeds),
            "notes": list(self.notes),
            "model": self.model,
            "traced_seconds": self.traced_seconds,
            "simulation": None if self.simulation is None else _summary(self.simulation),
        }

    def __str__(self) -> str:
        def ms(s: float) -> str:
            return f"{s * 1e3:.3f}"

        rows = [
            (phase, ms(p.compute), ms(p.h2d), ms(p.d2h), ms(p.host), ms(p.exposed), ms(p.seconds))
            for phase, p in self.phases.items()
        ]
        memory = (
            "not compiled"
            if self.device_bytes is None
            else f"device {format_bytes(self.device_bytes)}, "
            f"host {format_bytes(self.host_bytes or 0)}"
            + ("" if self.fits is None else (" (fits)" if self.fits else " (does not fit)"))
        )
        return "\n".join(
            [
                f"Estimate of {self.name!r} under {self.strategy!r} on {self.target!r}: "
                f"{ms(self.seconds)} ms per step",
                f"  {self.flops / 1e9:.3f} GFLOP ({self.recompute_flops / 1e9:.3f} recomputed), "
                f"h2d {format_bytes(int(self.h2d_bytes))}, "
                f"d2h {format_bytes(int(self.d2h_bytes))}, "
                f"memory: {memory}",
                format_table(
                    ("phase (ms)", "compute", "h2d", "d2h", "host", "exposed", "total"),
                    rows,
                    numeric=True,
                ),
                *(f"Note ({phase}): {note}" for phase, note in self.notes),
                *self._simulation_lines(),
            ]
        )

    def _simulation_lines(self) -> list[str]:
        sim = self.simulation
        if sim is None:
            return []
        busy = ", ".join(f"{r} {sim.busy[r] * 1e3:.3f}" for r in RESOURCES if sim.busy[r])
        waited = ", ".join(f"{r} {s * 1e3:.3f}" for r, s in sim.waited.items()) or "nothing"
        lines = [
            f"Compiled schedule: {sim.kernels} kernels; busy (ms): {busy}; the compute "
            f"stream waits for {waited} (ms). The jaxpr count predicts "
            f"{(self.traced_seconds or 0) * 1e3:.3f} ms.",
            "Costliest instructions (ms, all executions):",
        ]
        lines += [f"  {s * 1e3:.3f} {r:8} {name}  {op[-70:]}" for name, op, r, s in sim.top[:5]]
        return lines + [f"Note: {note}" for note in sim.notes]

    __repr__ = __str__


def estimate_from(
    step: FilterJit,
    args: tuple,
    kwargs: Mapping[str, Any],
    target: Target,
    costs: Costs | None = None,
    compile: bool = True,
) -> StepEstimate:
    speeds = speeds_of(target)
    costs = costs or trace_costs(step, args, kwargs, speeds)
    # Refused here as `memory_report` refuses it, not priced for a target that cannot run it.
    if costs.jaxpr is not None:
        check_host_compute(costs.jaxpr, target.platform, f"target {target.name!r}")
    traced, phases = predict(load_of(costs), speeds)
    device = host = simulation = None
    seconds = traced
    if compile:
        name = getattr(step, "__name__", None) or type(step.fn).__name__
        report, compiled = compiled_report(program_of_step(step, args, kwargs), target, name)
        device, host = report.total, report.host_total
        simulation = simulate(compiled.as_text(), speeds, report.device.get("temp", 0))
        seconds, phases = simulation.seconds, simulated_phases(simulation)
    return StepEstimate(
        name=getattr(step, "__name__", None) or type(step.fn).__name__,
        strategy=step.strategy.name,
        target=target.name,
        flops=costs.flops,
        recompute_flops=costs.recompute_flops,
        h2d_bytes=sum(costs.bytes("host-to-device", p) for p in PHASES),
        d2h_bytes=sum(costs.bytes("device-to-host", p) for p in PHASES),
        device_bytes=device,
        host_bytes=host,
        seconds=seconds,
        phases=phases,
        speeds=speeds,
        capacity=target.capacity,
        notes=tuple((p, w.note) for p, w in costs.work.items() if w.note),
        traced_seconds=traced,
        simulation=simulation,
    )


def simulated_phases(simulation: Simulation) -> dict[str, PhaseTime]:
    """Each phase's resources busy and its time on the compute stream, simulated;
    `exposed` is the time the stream waited for copies, host work and collectives."""
    phases = {}
    for phase in PHASES:
        busy = simulation.phase_busy.get(phase, dict.fromkeys(RESOURCES, 0.0))
        seconds = simulation.phase_seconds.get(phase, 0.0)
        phases[phase] = PhaseTime(
            busy["compute"], busy["h2d"], busy["d2h"], busy["host"],
            max(seconds - busy["compute"], 0.0), seconds,
        )  # fmt: skip
    return phases


def _summary(simulation: Simulation) -> dict[str, Any]:
    return {
        "seconds": simulation.seconds,
        "kernels": simulation.kernels,
        "flops": simulation.flops,
        "busy": simulation.busy,
        "waited": simulation.waited,
        "top": [list(t) for t in simulation.top],
        "notes": list(simulation.notes),
    }


@checks_options
def estimate(
    step: Callable[..., Any],
    *args: Any,
    target: "str | Target" = "cpu",
    compile: bool = True,
    **kwargs: Any,
) -> StepEstimate:
    """Predict the time and memory of one call of `step(*args, **kwargs)` on `target`.

    **Arguments:**

    - `step`: an `ox.filter_jit` function (its strategy decides the plan), or any
        callable, wrapped with `ox.filter_jit`.
    - `*args`, `**kwargs`: the call's arguments, arrays or `jax.ShapeDtypeStruct`s.
    - `target`: a name in `ox.TARGETS` or a `Target`; its `speeds` price the step
        (`"cpu"`: measured on this machine, in float32).
    - `compile`: True or False: compile for the target to read device and host memory
        (the step time needs only the trace).

    **Returns:** an `ox.StepEstimate` (`print` it; `to_dict()`).

    **Raises:** what `ox.audit` raises for a step that breaks its placement contract
    (the prediction would price a program that does not do what it declares);
    `TypeError`, before any trace, for a `compile` that is not True or False.
    """
    wrapper = step if isinstance(step, FilterJit) else filter_jit(step)
    return estimate_from(wrapper, args, kwargs, get_target(target), compile=compile)
