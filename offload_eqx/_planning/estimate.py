"""`ox.estimate`: a step's work, transfers, memory and predicted time on a target.

- **work**, counted on the traced program (`flops.count_work`): matmul and convolution
  FLOPs per phase, scan bodies times their length, recomputation on its own;
- **transfers**, from the audit's walk of the same program (`ox.audit`): host-to-device
  and device-to-host bytes per phase;
- **memory**, from the compile for the target (`ox.memory_report`): device and host
  bytes, the real XLA:GPU/XLA:TPU compilers for a GPU or TPU target;
- **time**: with `compile=True`, the compiled program's schedule simulated
  (`schedule.simulate`: its kernels as XLA fused them, its asynchronous copies, host
  computations and collectives run as events on their resources); with
  `compile=False`, the jaxpr count's model (`traced_time.py`), which `ox.fit` uses to
  order its candidates. A compiled estimate keeps the jaxpr count's answer as
  `traced_seconds`.
"""

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from .._base.options import checks_options
from .._base.table import format_bytes, format_table
from .._host.compute import check_host_compute
from .._inspect.memory_report import compiled_report
from .._jit.jit import FilterJit, step_of
from .._targets.deviceless import program_of_step
from .._targets.devices import require_compiler
from .._targets.targets import Speeds, Target, get_target
from .events import RESOURCES, Simulation
from .schedule import simulate
from .timeline import plot_timeline, write_timeline
from .traced_time import (
    PHASES,
    Costs,
    PhaseTime,
    load_of,
    predict,
    priced_at,
    speeds_of,
    trace_costs,
)


@dataclasses.dataclass(frozen=True)
class StepEstimate:
    """What `ox.estimate` predicts for one step on one target, per device.

    - `name`, `strategy`, `target`: the step's name, the strategy it was planned under
        and the target's name.
    - `flops`: every matmul and convolution FLOP the step runs, and those of its fused
        kernels (cuDNN attention, splash attention, a Pallas kernel's declared cost
        estimate), recomputation included (`recompute_flops` is that part).
    - `h2d_bytes`, `d2h_bytes`: what crosses the host link per step, each way.
    - `device_bytes`, `host_bytes`: the compiled memory (None when not compiled).
    - `seconds`: the predicted step time: the compiled program's schedule simulated
        (`model == "compiled"`), or the jaxpr count's (`"traced"`, `compile=False`).
    - `phases`: its breakdown, `{"forward": ..., "backward": ..., "update": ...}`; each
        phase's predicted seconds of `compute`, `h2d`, `d2h` and `host` work, the
        `exposed` time (simulated: what the compute stream waited for copies, host work
        and collectives; traced: the largest copy of each direction) and the phase's
        total `seconds`.
    - `traced_seconds`: the jaxpr count's prediction, kept beside a compiled one.
    - `simulation`: the simulated schedule (`compile=True`): each resource's busy time,
        what the compute stream waited for, the costliest instructions, every event.
    - `speeds`: the `ox.Speeds` it was priced with; `capacity`: the target's device
        memory (None: unknown).
    - `notes`: `(phase, note)` pairs for what the counts leave out (a while loop is
        counted once, a kernel no rule prices: `unpriced`), and `("memory", note)` for
        what the compiled memory leaves out (`MemoryReport.notes`).

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
    # The trace the jaxpr count priced, to price again (`with_speeds`).
    costs: Costs | None = dataclasses.field(default=None, repr=False, compare=False)

    @property
    def unpriced(self) -> tuple[str, ...]:
        """The kernels no rule prices (a custom call or Pallas kernel without a cost
        estimate, an FFI call), each priced by its bytes alone, its FLOPs not counted:
        the compiled instructions where the simulation met any, else what the jaxpr count
        met (a Pallas kernel in interpret mode compiles to ordinary instructions)."""
        if self.simulation is not None and self.simulation.unpriced:
            return tuple(f"{name}: {what}" for name, what, _ in self.simulation.unpriced)
        return tuple(what for what, _ in (self.costs.unpriced if self.costs else ()))

    @property
    def model(self) -> str:
        """`"compiled"`: `seconds` simulates the compiled program's schedule;
        `"traced"`: it is the jaxpr count's (`compile=False`)."""
        return "traced" if self.simulation is None else "compiled"

    def with_speeds(self, **changes: Any) -> "StepEstimate":
        """The same program priced at other speeds, without another trace or compile:
        `estimate.with_speeds(h2d_bandwidth=450e9, d2h_bandwidth=450e9)` asks how fast the
        step would be over a faster host link. Each keyword is a field of `ox.Speeds`
        (checked as `ox.Speeds` checks it); the compiled schedule is simulated again (and
        the jaxpr count priced again) with the changed rates, memory unchanged.
        `efficiency=0.5` prices every matmul at that constant, in place of the target's
        table by shape (`ox.Speeds.replace`)."""
        allowed = {f.name for f in dataclasses.fields(Speeds)}
        unknown = sorted(set(changes) - allowed)
        if unknown:
            raise TypeError(
                f"StepEstimate.with_speeds({', '.join(unknown)}=...): not a field of "
                f"ox.Speeds; expected some of {', '.join(sorted(allowed))}."
            )
        if self.costs is None or self.costs.jaxpr is None:
            raise ValueError(
                "StepEstimate.with_speeds(): this estimate was built by hand, without the "
                "trace `ox.estimate` prices; make it with `ox.estimate`."
            )
        speeds = self.speeds.replace(**changes)
        traced, phases = predict(load_of(priced_at(self.costs, speeds)), speeds)
        repriced = dataclasses.replace(
            self, speeds=speeds, seconds=traced, phases=phases, traced_seconds=traced
        )
        if self.simulation is None or self.simulation.program is None:
            return dataclasses.replace(repriced, simulation=None)
        program, temp = self.simulation.program, self.simulation.temp_bytes
        kernels = self.simulation.kernel_table
        return with_simulation(repriced, simulate(program, speeds, temp, kernels))

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
        return write_timeline(
            self.simulation, path, f"{self.name} ({self.strategy}) on {self.target}"
        )

    def plot_timeline(self, ax: Any = None, title: str = "") -> Any:
        """Draw the simulated step as a Gantt chart on a matplotlib axis (made if not
        given): one row per busy resource, slices coloured by phase. Needs matplotlib
        and an estimate made with `compile=True`. Returns the axis."""
        if self.simulation is None:
            raise ValueError(
                f"StepEstimate.plot_timeline(): this estimate of {self.name!r} was made "
                "from the trace alone (`compile=False`). Call "
                "`ox.estimate(..., compile=True)`."
            )
        return plot_timeline(self.simulation, ax, title)

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
            f"Compiled schedule: {sim.kernels} kernels; busy (ms): {busy}.",
            f"The compute stream waits for {waited} (ms); the jaxpr count predicts "
            f"{(self.traced_seconds or 0) * 1e3:.3f} ms.",
            "Costliest instructions (ms, all executions):",
        ]
        lines += [f"  {s * 1e3:.3f} {r:8} {name}  {_short(op)}" for name, op, r, s in sim.top[:5]]
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
    costs = costs or trace_costs(step, args, kwargs, target)
    speeds = speeds_of(target)  # after the trace, which checks the call
    # Refused here as `memory_report` refuses it, not priced for a target that cannot run it.
    if costs.jaxpr is not None:
        check_host_compute(costs.jaxpr, target.platform, f"target {target.name!r}")
    traced, phases = predict(load_of(costs), speeds)
    device = host = simulation = None
    seconds, notes = traced, tuple((p, w.note) for p, w in costs.work.items() if w.note)
    if compile:
        name = getattr(step, "__name__", None) or type(step.fn).__name__
        report, compiled = compiled_report(program_of_step(step, args, dict(kwargs)), target, name)
        device, host = report.total, report.host_total
        simulation = simulate_compiled(compiled, report, speeds, costs)
        seconds, phases = simulation.seconds, simulated_phases(simulation)
        notes += tuple(("memory", note) for note in report.notes)
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
        notes=notes,
        traced_seconds=traced,
        simulation=simulation,
        costs=costs,
    )


def _short(op_name: str, width: int = 60) -> str:
    """An `op_name` cut to its last whole path segments within `width` characters."""
    parts = op_name.split("/")
    kept: list[str] = []
    while parts and len("/".join([parts[-1], *kept])) <= width:
        kept.insert(0, parts.pop())
    return ("…/" if parts else "") + "/".join(kept or [op_name[-width:]])


def simulate_compiled(
    compiled: Any, report: Any, speeds: Speeds, costs: Costs | None = None
) -> Simulation:
    """The schedule of a compiled program (`jax.stages.Compiled`) simulated, its
    temporary buffer (from its memory report) first touched where that is priced; its
    Pallas kernels priced by what its trace (`costs`) says of them."""
    kernels = costs.kernels if costs is not None else None
    return simulate(compiled.as_text(), speeds, report.device.get("temp", 0), kernels)


def with_simulation(estimate: StepEstimate, simulation: Simulation) -> StepEstimate:
    """A jaxpr-count estimate answered from its compiled program instead: `seconds` and
    `phases` simulated, the count's answer kept as `traced_seconds`."""
    return dataclasses.replace(
        estimate,
        seconds=simulation.seconds,
        phases=simulated_phases(simulation),
        traced_seconds=estimate.seconds
        if estimate.traced_seconds is None
        else estimate.traced_seconds,
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
        "unpriced": [list(u) for u in simulation.unpriced],
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
    - `compile`: True or False. True: compile for the target (its real compiler, without
        the hardware for a GPU or TPU; on this machine's accelerator when it is the
        target's chip), read device and host memory, and predict the time by simulating
        the compiled program's schedule: each kernel as XLA fused it, asynchronous copies
        on the host link's copy engines, host computations on the host, collectives on
        the interconnect. False: the jaxpr count alone (no compile; no memory), a cheaper
        bound that assumes copies overlap compute within each phase.

    **Returns:** an `ox.StepEstimate` (`print` it; `to_dict()`; `timeline(path)` writes
    the simulated step as a Chrome trace for Perfetto). `seconds` is the simulation's
    with `compile=True`, and `traced_seconds` the jaxpr count's either way.

    **Raises:** what `ox.audit` raises for a step that breaks its placement contract
    (the prediction would price a program that does not do what it declares);
    `TypeError`, before any trace, for a `compile` that is not True or False;
    `ImportError`, before any trace, when `compile=True` needs an extra that is missing
    or not whole (a GPU target without cuDNN).
    """
    wrapper = step_of(step, "ox.estimate")
    resolved = get_target(target)
    if compile:
        require_compiler(resolved)
    return estimate_from(wrapper, args, kwargs, resolved, compile=compile)
