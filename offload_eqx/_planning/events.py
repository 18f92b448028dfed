"""What a simulated step is made of: its `Event`s on each resource and the `Simulation`
that sums them (`schedule.py` produces them; `timeline.py` draws them)."""

import dataclasses
from typing import Any

RESOURCES: tuple[str, ...] = ("compute", "h2d", "d2h", "host", "network")


@dataclasses.dataclass(frozen=True)
class Event:
    """One piece of work of a simulated step (`Simulation.events`).

    - `resource`: `"compute"`, `"h2d"`, `"d2h"`, `"host"` or `"network"`.
    - `name`: the compiled instruction (`fusion.12`, `copy-start.3`, ...).
    - `start`, `end`: seconds from the step's start.
    - `phase`: `"forward"`, `"backward"` or `"update"`, from the instruction's `op_name`.
    - `op_name`: the instruction's metadata: where in the traced program it comes from.
    - `flops`: its matmul and convolution FLOPs (a fused kernel's by its rule); `bytes`:
        what it moves (a copy engine's bytes over the link; a kernel's bytes read and
        written).
    """

    resource: str
    name: str
    start: float
    end: float
    phase: str
    op_name: str = ""
    flops: float = 0.0
    bytes: float = 0.0


@dataclasses.dataclass(frozen=True)
class Simulation:
    """A compiled step run as events on the device's resources (`StepEstimate.simulation`).

    - `seconds`: until every resource is idle.
    - `busy`: seconds each resource works; `waited`: seconds the compute stream waits at
        a `-done` for each other resource (`exposed` is their sum).
    - `phase_seconds`, `phase_busy`: the same per phase (forward, backward, update).
    - `flops`: the matmul and convolution FLOPs run, and those of the fused kernels
        (`fused.py`: cuDNN and splash attention, a Pallas kernel's declared cost
        estimate), loops' trips included; `kernels`: the kernels launched.
    - `top`: the costliest instructions, `(name, op_name, resource, seconds)` over all
        their executions.
    - `events`: every `Event` in order (a loop's first 64 trips; `truncated` says when
        some were not kept); `notes`: what could not be priced, and why.
    - `unpriced`: the kernels no rule prices (a custom call or Pallas kernel without a
        cost estimate, an FFI call), `(instruction, what it is, bytes per execution)`:
        each is priced by the bytes it reads and writes alone, its FLOPs not counted.
    """

    seconds: float
    busy: dict[str, float]
    waited: dict[str, float]  # compute-stream time spent waiting at `-done`s, by resource
    phase_seconds: dict[str, float]  # compute-stream time (work and waits) per phase
    phase_busy: dict[str, dict[str, float]]  # phase -> resource -> busy seconds
    flops: float
    kernels: int
    top: tuple[tuple[str, str, str, float], ...]  # (instruction, op_name, resource, seconds)
    events: tuple[Event, ...]
    notes: tuple[str, ...] = ()
    truncated: bool = False  # events beyond `_EVENT_LIMIT` (or repeated trips) not kept
    # What was simulated, to run again at other speeds: the parsed module and the
    # temporary bytes first touched.
    program: Any = dataclasses.field(default=None, repr=False, compare=False)
    temp_bytes: int = 0
    unpriced: tuple[tuple[str, str, float], ...] = ()
    # What the traced program said of its Pallas kernels, to simulate again.
    kernel_table: Any = dataclasses.field(default=None, repr=False, compare=False)

    @property
    def exposed(self) -> float:
        """Compute-stream time spent waiting for copies, host work and collectives."""
        return sum(self.waited.values())
