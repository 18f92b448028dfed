"""The compiled program run as events on a device's resources: `simulate(text, speeds)`.

The module XLA compiled (`hlo.py` reads it) is run in its schedule order on five
resources, each doing one thing at a time:

- `compute`: the device's stream. Each kernel (`kernels.py`) takes its roofline time,
  `max(FLOPs / (peak x efficiency), device bytes / HBM bandwidth, host bytes / link
  bandwidth)`, plus the target's `kernel_launch` cost; a fused kernel (`fused.py`: cuDNN
  attention) runs at its own published efficiency, and one no rule prices is priced by
  its bytes alone and named in the notes (`Simulation.unpriced`); a kernel that
  transposes moves its device bytes at the target's `transpose_bandwidth` where that is
  given. A
  `while` runs its condition and body once per trip (`known_trip_count`, or read from a
  condition `i < N` on a counter starting at a constant, as XLA:TPU prints loops; once,
  with a note, where neither says), a `call` its computation, a `conditional` its
  costliest branch.
- `h2d`, `d2h`: the copy engines. An asynchronous copy or fusion (`copy-start`,
  `fusion-start`, ...) that reads host memory is host-to-device work, one that writes it
  device-to-host, at the link's bandwidth in that direction.
- `host`: the host CPU. A host computation (`custom-call-start` of `HostExecute`, or
  an asynchronous `call` on the host thread) runs its instructions at the host's rates.
- `network`: the interconnect. A collective takes the ring's time over its replica
  group of `n` devices: all-reduce `2 (n-1)/n x bytes`, all-gather and reduce-scatter
  `(n-1)/n x` the larger side, all-to-all `(n-1)/n x bytes`, a permute its bytes, at
  the target's `interconnect_bandwidth`.

Asynchronous work starts when its `-start` is reached and the resource is free; its
`-done` waits on the compute stream until the work is finished. A synchronous
collective or copy is a start and a done at once. The step ends when every resource
is idle. Each event is labelled with its phase (forward, backward, update) by its
`op_name` metadata, the rule the jaxpr count uses.
"""

import dataclasses
from collections.abc import Mapping
from typing import Any

from .._base.primitives import phase_of
from .._base.table import format_bytes
from .._targets.targets import Speeds
from .events import RESOURCES, Event, Simulation
from .fused import KernelCost, Key
from .hlo import Computation, Instruction, Module, arrays, nbytes, parse_module
from .host_work import host_bytes, host_computation_bandwidth
from .kernels import (
    COLLECTIVES,
    Work,
    fusion_work,
    inner_flops,
    instruction_work,
    is_free,
    piece_work,
)
from .prices import collective_seconds, kernel_seconds

# Iterations of one loop simulated event by event; the rest repeat the last one's time.
EXPLICIT_TRIPS = 64
_EVENT_LIMIT = 200_000


class _Simulator:
    def __init__(
        self, module: Module, speeds: Speeds, table: Mapping[Key, KernelCost] | None = None
    ) -> None:
        self.module, self.speeds, self.table = module, speeds, table
        self.clock = 0.0  # the compute stream
        self.free: dict[str, float] = dict.fromkeys(RESOURCES, 0.0)
        self.busy: dict[str, float] = dict.fromkeys(RESOURCES, 0.0)
        self.waited: dict[str, float] = dict.fromkeys(RESOURCES, 0.0)
        self.phase_seconds: dict[str, float] = {}
        self.phase_busy: dict[str, dict[str, float]] = {}
        self.pending: dict[str, tuple[str, float]] = {}  # start name -> (resource, end)
        self.cost: dict[tuple[str, int], Any] = {}
        self.by_instruction: dict[str, list] = {}
        self.events: list[Event] = []
        self.flops = 0.0
        self.kernels = 0
        self.seen_backward = False
        self.notes: list[str] = []
        self.unpriced: dict[str, tuple[str, float]] = {}  # instruction -> (what, bytes)
        self.truncated = False

    # -- pricing ------------------------------------------------------------------------

    def host_seconds(self, name: str) -> float:
        """A host computation: the bytes it moves as XLA:CPU compiles it (`host_work`)
        at the bandwidth one host computation gets, or its dots at the host's FLOP rate,
        if longer."""
        if name not in self.module.computations:
            return 0.0
        moved = host_bytes(self.module, name)
        flops = inner_flops(self.module, name)
        bandwidth = host_computation_bandwidth(self.speeds)
        return max(flops / self.speeds.host_flops, moved / bandwidth)

    def device_side_seconds(self, start: Instruction) -> float:
        """A host computation's operands in device memory cross the link before it runs,
        and its results in device memory after (XLA:GPU returns a host call's results
        to the device when a loop writes them into a host stack): their bytes at the
        link's bandwidth each way, as part of the call. The start's type is `((operands),
        results, context)`."""
        if not isinstance(start.type, tuple) or len(start.type) < 2:
            return 0.0
        operands, results = start.type[0], start.type[1]
        read = sum(a.bytes for a in arrays(operands) if not a.host and a.dims)
        written = sum(a.bytes for a in arrays(results) if not a.host and a.dims)
        return read / self.speeds.d2h_bandwidth + written / self.speeds.h2d_bandwidth

    def collective_seconds(
        self, opcode: str, instruction: Instruction, computation: Computation
    ) -> float:
        seconds = collective_seconds(self.speeds, self.module, opcode, instruction, computation)
        if seconds is None:
            self.note(
                "collectives are not priced: the target's Speeds has no interconnect_bandwidth"
            )
        return seconds or 0.0

    def note(self, text: str) -> None:
        if text not in self.notes:
            self.notes.append(text)

    def check_priced(self, instruction: Instruction, work: Work) -> None:
        """Name a kernel no rule prices, with the bytes it is priced by, once; and say
        what a priced kernel's price leaves out."""
        if work.caveat:
            self.note(f"{instruction.name}: {work.caveat}")
        if not work.unpriced or instruction.name in self.unpriced:
            return
        moved = work.device_bytes + work.host_read + work.host_write
        self.unpriced[instruction.name] = (work.unpriced, moved)
        self.note(
            f"{instruction.name}: {work.unpriced}; priced by the {format_bytes(int(moved))} "
            "it reads and writes alone, its FLOPs not counted"
        )

    # -- running ------------------------------------------------------------------------

    def phase(self, instruction: Instruction) -> str:
        stack = instruction.op_name
        found = phase_of(stack, "forward", self.seen_backward)
        self.seen_backward = self.seen_backward or found == "backward"
        return found

    def record(
        self,
        resource: str,
        instruction: Instruction,
        start: float,
        end: float,
        phase: str,
        work: Work | None = None,
    ) -> None:
        self.busy[resource] += end - start
        self.phase_busy.setdefault(phase, dict.fromkeys(RESOURCES, 0.0))[resource] += end - start
        self.by_instruction.setdefault(instruction.name, [instruction.op_name, resource, 0.0])[
            2
        ] += end - start
        if len(self.events) < _EVENT_LIMIT:
            w = work or Work()
            # A copy engine's bytes are those it moves; a kernel's all it reads and writes.
            moved = {"h2d": w.host_read, "d2h": w.host_write}.get(
                resource, w.device_bytes + w.host_read + w.host_write
            )
            self.events.append(
                Event(
                    resource,
                    instruction.name,
                    start,
                    end,
                    phase,
                    instruction.op_name,
                    w.flops,
                    moved,
                )
            )
        else:
            self.truncated = True

    def advance(self, seconds: float, phase: str) -> None:
        self.clock += seconds
        self.phase_seconds[phase] = self.phase_seconds.get(phase, 0.0) + seconds

    def run(self, name: str) -> None:
        computation = self.module.computations[name]
        for instruction in computation.instructions:
            self.step(computation, instruction)

    def step(self, computation: Computation, instruction: Instruction) -> None:
        opcode = instruction.opcode
        if is_free(instruction):
            return
        if opcode == "while":
            return self.loop(computation, instruction)
        if opcode == "call":
            for called in instruction.calls:
                self.run(called)
            return
        if opcode == "conditional":
            return self.branch(instruction)
        if opcode.endswith("-done"):
            return self.done(instruction)
        if opcode.endswith("-update"):
            return
        if opcode.endswith("-start"):
            return self.start(computation, instruction)
        if opcode in COLLECTIVES:  # synchronous: a start and a done at once
            self.start(computation, instruction)
            return self.done(instruction, own=True)
        self.kernel(computation, instruction)

    def kernel(self, computation: Computation, instruction: Instruction) -> None:
        key = ("kernel", id(instruction))
        if key not in self.cost:
            work = instruction_work(self.module, computation, instruction, self.table)
            self.cost[key] = (work, kernel_seconds(self.speeds, work))
            self.check_priced(instruction, work)
        work, seconds = self.cost[key]
        phase = self.phase(instruction)
        start = self.clock
        self.advance(seconds, phase)
        self.flops += work.flops
        self.kernels += 1
        self.record("compute", instruction, start, self.clock, phase, work)
        for resource, moved, rate in (
            ("h2d", work.host_read, self.speeds.h2d_bandwidth),
            ("d2h", work.host_write, self.speeds.d2h_bandwidth),
        ):
            if moved:  # a kernel reading or writing host memory holds the link while it runs
                self.free[resource] = max(self.free[resource], start) + moved / rate
                self.busy[resource] += moved / rate

    def first_touch(self, temp_bytes: int) -> None:
        """The temporary buffer's pages, new to the process, faulted in as first written."""
        seconds = temp_bytes / self.speeds.first_touch_bandwidth
        touch = Instruction("temporary buffer (first touch)", "first-touch", (), (), "")
        self.advance(seconds, "forward")
        self.record("compute", touch, 0.0, seconds, "forward", Work(0.0, float(temp_bytes)))

    def loop(self, computation: Computation, instruction: Instruction) -> None:
        trips = self.module.trip_count(computation, instruction)
        if trips is None:
            self.note(f"the trip count of {instruction.name} is unknown: its body is counted once")
            trips = 1
        body, condition = instruction.calls[0], instruction.calls[-1]
        explicit = min(trips, EXPLICIT_TRIPS)
        for _ in range(explicit):
            self.run(condition)
            before = self.snapshot()
            self.run(body)
        self.run(condition)
        if trips > explicit:
            self.repeat(before, trips - explicit)

    def snapshot(self) -> dict[str, Any]:
        return {
            "clock": self.clock,
            "free": dict(self.free),
            "busy": dict(self.busy),
            "waited": dict(self.waited),
            "phase_seconds": dict(self.phase_seconds),
            "phase_busy": {k: dict(v) for k, v in self.phase_busy.items()},
            "flops": self.flops,
            "kernels": self.kernels,
        }

    def repeat(self, before: dict[str, Any], times: int) -> None:
        """Repeat the last iteration's effect `times` more times, without events."""
        self.truncated = True
        delta = self.clock - before["clock"]
        self.clock += delta * times
        for resource in RESOURCES:
            self.free[resource] += (self.free[resource] - before["free"][resource]) * times
            self.busy[resource] += (self.busy[resource] - before["busy"][resource]) * times
            self.waited[resource] += (self.waited[resource] - before["waited"][resource]) * times
        for phase, seconds in list(self.phase_seconds.items()):
            self.phase_seconds[phase] = (
                seconds + (seconds - before["phase_seconds"].get(phase, 0.0)) * times
            )
        for phase, busy in self.phase_busy.items():
            old = before["phase_busy"].get(phase, {})
            for resource in RESOURCES:
                busy[resource] += (busy[resource] - old.get(resource, 0.0)) * times
        self.flops += (self.flops - before["flops"]) * times
        self.kernels += (self.kernels - before["kernels"]) * times

    def branch(self, instruction: Instruction) -> None:
        def weight(name: str) -> float:
            return inner_flops(self.module, name) + sum(
                nbytes(i.type) for i in self.module.computations[name].instructions
            )

        branches = [c for c in instruction.calls if c in self.module.computations]
        if branches:
            if len(branches) > 1:
                self.note("a conditional is priced at its costliest branch")
            self.run(max(branches, key=weight))

    # -- asynchronous work --------------------------------------------------------------

    def async_work(
        self, computation: Computation, instruction: Instruction
    ) -> tuple[str, float, Work]:
        """(resource, seconds, work) of an asynchronous start."""
        opcode = instruction.opcode.removesuffix("-start")
        target = instruction.attribute("custom_call_target") or ""
        wrapped = self.module.computations.get(instruction.calls[0]) if instruction.calls else None
        if opcode == "async" and wrapped is not None:
            inner = wrapped.root
            opcode, target = inner.opcode, inner.attribute("custom_call_target") or target
            if inner.opcode.removesuffix("-start") in COLLECTIVES:
                return "network", self.collective_seconds(inner.opcode, inner, wrapped), Work()
        on_host = (
            "host" in (instruction.attribute("async_execution_thread") or "")
            or "HostExecute" in target
            or "host" in target.lower()
        )
        if on_host:
            inner = (
                wrapped.root
                if wrapped is not None and instruction.opcode == "async-start"
                else instruction
            )
            seconds = sum(self.host_seconds(c) for c in inner.calls)
            return "host", seconds + self.device_side_seconds(instruction), Work()
        if opcode in COLLECTIVES:
            return "network", self.collective_seconds(opcode, instruction, computation), Work()
        if instruction.opcode == "async-start" and wrapped is not None:
            work = instruction_work(self.module, wrapped, wrapped.root, self.table)
            self.check_priced(wrapped.root, work)
            return self.link_work(work)
        return self.link_work(self.copy_or_fusion(computation, instruction, opcode))

    def copy_or_fusion(
        self, computation: Computation, instruction: Instruction, opcode: str
    ) -> Work:
        """The work of a `copy-start`, a `slice-start`, `dynamic-slice-start` or
        `dynamic-update-slice-start` (XLA:TPU's fetch and offload of one layer's slice of a
        host buffer), or a `fusion-start` in its short form."""
        if opcode in ("slice", "dynamic-slice", "dynamic-update-slice"):
            return self.slice_work(computation, instruction, opcode)
        if opcode == "copy":
            source = self.module.operand_type(computation, instruction.operands[0])
            result = (
                instruction.type[0]
                if isinstance(instruction.type, tuple) and instruction.type
                else instruction.type
            )
            size = float(nbytes(source))
            src_host = any(a.host for a in arrays(source))
            dst_host = any(a.host for a in arrays(result))
            return Work(0.0, 0.0, size if src_host else 0.0, size if dst_host else 0.0)
        return fusion_work(self.module, computation, instruction)

    def slice_work(self, computation: Computation, instruction: Instruction, opcode: str) -> Work:
        """An asynchronous slice moves the piece it reads out (`slice`, `dynamic-slice`:
        its result, the second element of the start's tuple) or writes in place
        (`dynamic-update-slice`: its update operand), as a synchronous one does."""
        buffer = self.module.operand_type(computation, instruction.operands[0])
        if opcode != "dynamic-update-slice":
            result = instruction.type
            piece = result[1] if isinstance(result, tuple) and len(result) > 1 else result
            return piece_work(buffer, piece, piece)
        update = self.module.operand_type(computation, instruction.operands[1])
        return piece_work(update, buffer, update)

    def link_work(self, work: Work) -> tuple[str, float, Work]:
        """Asynchronous work on the copy engine of the direction it moves most, or, moving
        nothing over the link, a kernel on the compute stream."""
        s = self.speeds
        if work.host_read >= work.host_write and work.host_read:
            return "h2d", s.kernel_launch + work.host_read / s.h2d_bandwidth, work
        if work.host_write:
            return "d2h", s.kernel_launch + work.host_write / s.d2h_bandwidth, work
        return "compute", kernel_seconds(self.speeds, work), work

    def start(self, computation: Computation, instruction: Instruction) -> None:
        key = ("start", id(instruction))
        if key not in self.cost:
            self.cost[key] = self.async_work(computation, instruction)
        resource, seconds, work = self.cost[key]
        phase = self.phase(instruction)
        if resource == "compute":  # an asynchronous kernel with nothing to overlap: run it
            self.kernel(computation, instruction)
            self.pending[instruction.name] = ("compute", self.clock)
            return
        begin = max(self.clock, self.free[resource])
        end = begin + seconds
        self.free[resource] = end
        self.flops += work.flops
        self.record(resource, instruction, begin, end, phase, work)
        self.pending[instruction.name] = (resource, end)

    def done(self, instruction: Instruction, own: bool = False) -> None:
        name = (
            instruction.name
            if own
            else (instruction.operands[0][0] if instruction.operands else "")
        )
        resource, end = self.pending.pop(name, ("compute", self.clock))
        if end > self.clock:
            phase = self.phase(instruction)
            self.waited[resource] += end - self.clock
            self.advance(end - self.clock, phase)

    def result(self) -> Simulation:
        seconds = max([self.clock, *self.free.values()])
        top = sorted(self.by_instruction.items(), key=lambda kv: -kv[1][2])[:8]
        return Simulation(
            seconds=seconds,
            busy=dict(self.busy),
            waited={k: v for k, v in self.waited.items() if v},
            phase_seconds=dict(self.phase_seconds),
            phase_busy=self.phase_busy,
            flops=self.flops,
            kernels=self.kernels,
            top=tuple((name, op, resource, seconds) for name, (op, resource, seconds) in top),
            events=tuple(self.events),
            notes=tuple(self.notes),
            truncated=self.truncated,
            unpriced=tuple((name, what, moved) for name, (what, moved) in self.unpriced.items()),
        )


def simulate(
    program: "str | Module | Any",
    speeds: Speeds,
    temp_bytes: int = 0,
    kernels: Mapping[Key, KernelCost] | None = None,
) -> Simulation:
    """Run a compiled program's schedule on a device with `speeds`.

    `program` is a `jax.stages.Compiled` (`jax.jit(f).lower(...).compile()`), its
    `as_text()`, or a parsed `Module`. `temp_bytes`, the program's temporary buffer
    (`memory_analysis().temp_size_in_bytes`), is first written at the target's
    `first_touch_bandwidth` before the first kernel, where that is priced. `kernels`:
    what the traced program says of its Pallas kernels (`flops.kernel_table(jaxpr)`: a
    GPU kernel's declared cost estimate, a splash kernel's mask), which the compiled
    text does not carry.
    """
    if not isinstance(program, (str, Module)):
        program = program.as_text()
    module = program if isinstance(program, Module) else parse_module(program)
    simulator = _Simulator(module, speeds, kernels)
    if temp_bytes and speeds.first_touch_bandwidth:
        simulator.first_touch(temp_bytes)
    simulator.run(module.entry)
    return dataclasses.replace(
        simulator.result(), program=module, temp_bytes=temp_bytes, kernel_table=kernels
    )
