"""The work of a traced step, counted from its jaxpr: flops, bytes and a roofline time per phase.

XLA's own `cost_analysis()` is `None` for a deviceless GPU compile and counts a scan body
once, so the work is counted here, from the program JAX traced, before XLA optimizes it:

- A `dot_general` costs `2 * M * N * K` flops (batch dimensions included: twice the output's
  size times the contracted size); a `conv_general_dilated` costs twice the output's size
  times the kernel's spatial size times its input features per group (padding and dilation
  zeros are counted, as every published conv count does). Their bytes are their operands'
  and output's sizes: each is read and written once.
- Every other computing equation (elementwise, reductions, gathers, transposes, casts)
  costs the bytes of its outputs: a proxy for memory-bound work, counting no fusion (XLA
  fuses chains of elementwise operations, so this is an upper bound on what they write).
  A `dynamic_update_slice` or scatter costs the bytes of its update (XLA writes it into
  the operand in place). Reshapes, squeezes, `expand_dims`, `broadcast_in_dim` and
  `iota` cost nothing: XLA folds them into their consumers. Structural equations
  (control flow, nested programs, `device_put`, names, sharding constraints) are entered
  or skipped, and host callbacks are transfers, which `ox.audit` reports.
- A `scan` body counts `length` times; a `cond` counts its most expensive branch (by flops,
  then bytes); a `while` body counts once, its trip count unknown (`PhaseWork.while_loops`
  says how many were seen); every other nested program (jit, remat, custom_jvp/vjp) counts
  once. Dead equations are dropped first, as XLA would: under `jax.grad` of a whole
  `jax.checkpoint`-ed loss, the forward pass computes only the loss value nobody returns.
- A fused kernel (`fused.py`: cuDNN attention, a Pallas call, an FFI call) costs what its
  rule says: its matmul FLOPs (for cuDNN attention from its operands' shapes and its
  mask; for a Pallas kernel the `pl.CostEstimate` it declares, or for splash attention
  its block mask) and its bytes (declared, or its operands' and outputs'), at its own
  efficiency where the rule gives one; a Pallas kernel's body (one block's program) is
  not counted. A kernel no rule prices costs its bytes alone and is named in the
  phase's `unpriced` and its note.
- Shapes are the jaxpr's, so the counts are for the whole program, not per device: divide
  by the number of devices a sharded step runs on. A `shard_map` body, traced with
  per-device shapes, counts once for each device it runs on (the product of its manual
  axes' sizes).
- The roofline time of a dot or conv is `max(flops / flop_rate, bytes / byte_rate)`, of
  everything else `bytes / byte_rate`: a lower bound that assumes no overlap between
  equations and perfect overlap within one; a `dot_general` runs at the efficiency of its
  (M, N, K, dtype) where a table by shape is given (`ox.Speeds.matmul_efficiency`).

Phases follow the name stacks JAX leaves on the equations it derives, as in `_inspect.jaxpr_walk`:
`transpose(...)` is the backward pass, `jvp(...)` the forward pass, and equations after the
backward pass (at the same level, or after a nested program holding it) are the `update`.
A program without a gradient is all `forward`. The backward pass of a remat region
re-runs its forward inside the transposed region; JAX names those equations
`rematted_computation` (`jax.checkpoint` under `jax.grad`, and a checkpointed scan body),
and they count in `recompute_flops` as well as in the backward `flops`.

Equations placed on the host with `jax.experimental.compute_on.compute_on("device_host")`
(as a decorator or a context manager) carry `compute_type="device_host"` in their
equation context; their work goes to the `host_*` fields, not to `flops` or `seconds`.
"""

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax.extend as jex
import numpy as np

from .._base.jax_private import without_dead_code
from .._base.primitives import STRUCTURAL, is_callback, phase_of
from .._base.table import format_bytes
from .._host.compute import DELAYED_SCOPE, is_host_computation
from .dots import dot_rate, eqn_flops
from .fused import KernelCost, Key, eqn_cost, kernel_key, pallas_name

PHASES = ("forward", "backward", "update")
RECOMPUTE_SCOPE = "rematted_computation"
# Shape changes XLA folds into the consumer: they write nothing of their own.
_FREE = frozenset({"reshape", "squeeze", "expand_dims", "broadcast_in_dim", "iota"})
_MATMULS = frozenset({"dot_general", "conv_general_dilated"})
# Equations XLA runs in place on their first operand, with the index of the update they
# write: a layer's slice written into a stacked buffer costs the slice, not the buffer.
_IN_PLACE = {
    "dynamic_update_slice": 1,
    "scatter": 2,
    "scatter-add": 2,
    "scatter_add": 2,
    "scatter-mul": 2,
    "scatter_mul": 2,
    "scatter-min": 2,
    "scatter-max": 2,
}


@dataclasses.dataclass(frozen=True)
class PhaseWork:
    """The work of one phase of a step (trip counts of enclosing scans included).

    - `flops`: of every `dot_general` and `conv_general_dilated` run on the device,
      recomputation included.
    - `recompute_flops`: the part of `flops` JAX marks as recomputation of a remat region.
    - `matmul_bytes`: read and written by those dots and convs.
    - `other_bytes`: written by every other computing equation (a memory-bound proxy).
    - `seconds`: the roofline time of the above, `0.0` without rates.
    - `host_flops`, `host_bytes`, `host_seconds`: the same for equations under
      `compute_on("device_host")` (their bytes are the matmul and other bytes together).
    - `while_loops`: while loops seen, each body counted once (trip count unknown).
    - `unpriced`: the kernels no rule prices, `(what it is, bytes)`: each costs the
      bytes it reads and writes alone, its FLOPs not counted.
    - `caveats`: what the price of a priced kernel leaves out (a mask not read).
    """

    flops: float = 0.0
    recompute_flops: float = 0.0
    matmul_bytes: float = 0.0
    other_bytes: float = 0.0
    seconds: float = 0.0
    host_flops: float = 0.0
    host_bytes: float = 0.0
    host_seconds: float = 0.0
    while_loops: int = 0
    unpriced: tuple[tuple[str, float], ...] = ()
    caveats: tuple[str, ...] = ()

    @property
    def note(self) -> str:
        """What the counts leave out, as sentences ("" when nothing)."""
        notes = []
        if self.while_loops:
            loops = "loop" if self.while_loops == 1 else "loops"
            notes.append(
                f"{self.while_loops} while {loops} counted once each: the trip count is "
                "unknown until run time, so the work inside is a lower bound."
            )
        notes += [
            f"{what} is priced by the {format_bytes(int(moved))} it reads and writes alone: "
            "its FLOPs are not counted."
            for what, moved in self.unpriced
        ]
        return " ".join(notes + list(self.caveats))


# The fields a phase's tally adds up (the others are gathered as they are met).
_FIELDS = tuple(
    f.name for f in dataclasses.fields(PhaseWork) if f.name not in ("unpriced", "caveats")
)
_RATE_ERROR = (
    "`count_work(..., {name}={value!r})`: a rate must be a positive number (flops or bytes "
    "per second), or None to leave that part of the roofline out."
)


@dataclasses.dataclass(frozen=True)
class _Rates:
    flop: float | None
    byte: float | None
    host_flop: float | None
    host_byte: float | None
    peak: float | None = None  # the chip's peak: a fused kernel's own efficiency applies to it
    # The fraction of `peak` a dot reaches, from (m, n, k, dtype, batch); None: at `flop`.
    matmul: Callable[[int, int, int, Any, int], float] | None = None


def _time(flops: float, nbytes: float, flop_rate: float | None, byte_rate: float | None) -> float:
    """max(compute time, memory time); a rate left out contributes no time."""
    compute = flops / flop_rate if flop_rate else 0.0
    memory = nbytes / byte_rate if byte_rate else 0.0
    return max(compute, memory)


def _nbytes(aval) -> float:
    shape = getattr(aval, "shape", None)
    if shape is None:
        return 0.0  # a token
    itemsize = getattr(aval.dtype, "itemsize", None)
    if itemsize is None:
        itemsize = np.dtype(aval.dtype).itemsize
    return float(math.prod(shape)) * itemsize


def _size(aval) -> float:
    return float(math.prod(aval.shape))


def _open(jaxpr):
    return getattr(jaxpr, "jaxpr", jaxpr)


def _dce(jaxpr):
    """Drop dead equations (XLA would): work whose result nobody uses is not done."""
    return without_dead_code(jaxpr)


def _value(var, values: dict) -> Any:
    """A traced operand's concrete value, where the trace holds one (a literal, or a
    constant the program closes over); None otherwise."""
    if isinstance(var, jex.core.Literal):
        return var.val
    return values.get(var)


def _inner_values(eqn, sub, values: dict) -> dict:
    """The concrete values a nested program `sub` of `eqn` receives: its own constants,
    and the known values of the operands passed to it in order (a `cond`'s after its
    index)."""
    inner = _open(sub)
    known = dict(zip(inner.constvars, getattr(sub, "consts", ())))
    outer = list(eqn.invars[1:] if eqn.primitive.name == "cond" else eqn.invars)
    if len(outer) == len(inner.invars):
        for inner_var, outer_var in zip(inner.invars, outer):
            value = _value(outer_var, values)
            if value is not None:
                known[inner_var] = value
    return known


class _Counter:
    def __init__(self, rates: _Rates):
        self.rates = rates
        self.work = {phase: dict.fromkeys(_FIELDS, 0.0) for phase in PHASES}
        self.unpriced: dict[str, dict[str, float]] = {phase: {} for phase in PHASES}
        self.caveats: dict[str, list[str]] = {phase: [] for phase in PHASES}
        self.table: dict[Key, KernelCost] = {}  # Pallas kernels by name and operand shapes
        self.saw_backward = False

    def add(self, other: "_Counter") -> None:
        for phase in PHASES:
            for name in _FIELDS:
                self.work[phase][name] += other.work[phase][name]
            for what, moved in other.unpriced[phase].items():
                self.unpriced[phase][what] = self.unpriced[phase].get(what, 0.0) + moved
            self.caveats[phase] += [c for c in other.caveats[phase] if c not in self.caveats[phase]]
        self.table.update(other.table)
        self.saw_backward = self.saw_backward or other.saw_backward

    def cost(self) -> tuple[float, float]:
        """(flops, bytes) over every phase, device and host: how branches are compared."""
        flops = sum(w["flops"] + w["host_flops"] for w in self.work.values())
        nbytes = sum(
            w["matmul_bytes"] + w["other_bytes"] + w["host_bytes"] for w in self.work.values()
        )
        return flops, nbytes

    def walk(
        self, jaxpr, count: float, phase: str, host: bool, recompute: bool, values=None
    ) -> None:
        values = values or {}
        seen_backward = False
        for eqn in jaxpr.eqns:
            stack = str(eqn.source_info.name_stack)
            eqn_phase = phase_of(stack, phase, seen_backward)
            if eqn_phase == "backward":
                seen_backward = self.saw_backward = True
            eqn_host = host or is_host_computation(eqn)
            if eqn_host and DELAYED_SCOPE in stack:
                # Reads nothing the step computes: runs beside the backward pass (at least).
                eqn_phase = "backward"
            eqn_recompute = recompute or RECOMPUTE_SCOPE in stack
            prim = eqn.primitive.name
            kernel = eqn_cost(eqn, lambda var: _value(var, values))
            if kernel is not None:
                self._kernel(eqn, kernel, count, eqn_phase, eqn_host, eqn_recompute)
            elif prim in STRUCTURAL or list(jex.core.jaxprs_in_params(eqn.params)):
                before = self.saw_backward
                self._nested(eqn, count, eqn_phase, eqn_host, eqn_recompute, values)
                # A gradient computed inside a nested program: what follows is the update.
                seen_backward = seen_backward or (self.saw_backward and not before)
            elif not (prim in _FREE or is_callback(prim)):
                self._count(eqn, count, eqn_phase, eqn_host, eqn_recompute)

    def _count(self, eqn, count: float, phase: str, host: bool, recompute: bool) -> None:
        work, rates = self.work[phase], self.rates
        written = sum(_nbytes(v.aval) for v in eqn.outvars)
        if eqn.primitive.name in _IN_PLACE:
            # XLA updates the operand in place: only the update is written.
            written = _nbytes(eqn.invars[_IN_PLACE[eqn.primitive.name]].aval)
        if eqn.primitive.name in _MATMULS:
            flops = eqn_flops(eqn) * count
            nbytes = (sum(_nbytes(v.aval) for v in eqn.invars) + written) * count
            if host:
                work["host_flops"] += flops
                work["host_bytes"] += nbytes
                work["host_seconds"] += _time(flops, nbytes, rates.host_flop, rates.host_byte)
            else:
                work["flops"] += flops
                work["recompute_flops"] += flops if recompute else 0.0
                work["matmul_bytes"] += nbytes
                work["seconds"] += _time(
                    flops, nbytes, dot_rate(eqn, rates.flop, rates.peak, rates.matmul), rates.byte
                )
        elif host:
            work["host_bytes"] += written * count
            work["host_seconds"] += _time(0.0, written * count, None, rates.host_byte)
        else:
            work["other_bytes"] += written * count
            work["seconds"] += _time(0.0, written * count, None, rates.byte)

    def _kernel(
        self, eqn, kernel: KernelCost, count: float, phase: str, host: bool, recompute: bool
    ) -> None:
        """A fused kernel, priced by its rule (`fused.py`)."""
        work, rates = self.work[phase], self.rates
        moved = kernel.bytes
        if moved is None:
            moved = sum(_nbytes(v.aval) for v in (*eqn.invars, *eqn.outvars))
        flops, nbytes = kernel.flops * count, moved * count
        if host:
            work["host_flops"] += flops
            work["host_bytes"] += nbytes
            work["host_seconds"] += _time(flops, nbytes, rates.host_flop, rates.host_byte)
        else:
            own = kernel.efficiency and rates.peak
            rate = rates.peak * kernel.efficiency if own else rates.flop  # type: ignore[operator]
            work["flops"] += flops
            work["recompute_flops"] += flops if recompute else 0.0
            work["matmul_bytes"] += nbytes
            work["seconds"] += _time(flops, nbytes, rate, rates.byte)
        if not kernel.priced:
            what = f"{kernel.kind} ({kernel.note})"
            self.unpriced[phase][what] = self.unpriced[phase].get(what, 0.0) + nbytes
        elif kernel.note and f"{kernel.kind}: {kernel.note}." not in self.caveats[phase]:
            self.caveats[phase].append(f"{kernel.kind}: {kernel.note}.")
        if eqn.primitive.name == "pallas_call":
            shapes = [v.aval.shape for v in eqn.invars]
            self.table[kernel_key(pallas_name(eqn.params), shapes)] = kernel

    def _nested(
        self, eqn, count: float, phase: str, host: bool, recompute: bool, values: dict
    ) -> None:
        prim, params = eqn.primitive.name, eqn.params

        def inner(sub):
            return _inner_values(eqn, sub, values)

        if prim == "scan":
            sub = params["jaxpr"]
            self.walk(_open(sub), count * params["length"], phase, host, recompute, inner(sub))
        elif prim == "cond":
            best: _Counter | None = None
            for branch in params["branches"]:
                counter = _Counter(self.rates)
                counter.walk(_open(branch), count, phase, host, recompute, inner(branch))
                if best is None or counter.cost() > best.cost():
                    best = counter
            if best is not None:
                self.add(best)
        elif prim == "shard_map":
            # The body is one device's program: counted for every device it runs on, so
            # that the count stays the whole program's, as everywhere else.
            sub, devices = params["jaxpr"], _manual_devices(params)
            self.walk(_open(sub), count * devices, phase, host, recompute, inner(sub))
        elif prim == "while":
            self.work[phase]["while_loops"] += 1
            for key in ("cond_jaxpr", "body_jaxpr"):
                self.walk(_open(params[key]), count, phase, host, recompute)
        else:
            for sub in jex.core.jaxprs_in_params(params):
                self.walk(_open(sub), count, phase, host, recompute, inner(sub))


def _manual_devices(params: dict) -> int:
    """How many devices run a `shard_map` body: the product of its manual axes' sizes."""
    mesh = params["mesh"]
    names = params.get("newly_manual_axes", params.get("manual_axes", mesh.axis_names))
    return math.prod(mesh.shape[name] for name in names)


def count_work(
    jaxpr: Any,
    *,
    flop_rate: float | int | None = None,
    byte_rate: float | int | None = None,
    host_flop_rate: float | int | None = None,
    host_byte_rate: float | int | None = None,
    peak_flop_rate: float | int | None = None,
    constants: dict | None = None,
    matmul_efficiency: Callable[[int, int, int, Any, int], float] | None = None,
) -> dict[str, PhaseWork]:
    """The work of a traced program by phase: `{"forward", "backward", "update"}` -> `PhaseWork`.

    `jaxpr` is a `jax.extend.core.ClosedJaxpr` (from `jax.make_jaxpr` or
    `eqx.filter_make_jaxpr`) or a `Jaxpr`. The rates (flops or bytes per second, e.g.
    `flop_rate=989e12, byte_rate=3.35e12` for an H100's dense bf16 and HBM) give the
    roofline `seconds`; the host rates give `host_seconds`; `peak_flop_rate` (the chip's
    peak) the rate of a fused kernel with its own efficiency (cuDNN attention), which
    otherwise runs at `flop_rate`; `matmul_efficiency(m, n, k, dtype, batch)` the fraction
    of `peak_flop_rate` a `dot_general` reaches by its shape (`functools.partial(
    ox.matmul_efficiency, speeds)`), in place of `flop_rate`. `constants` maps constant
    variables of an open `Jaxpr` to their values (a `ClosedJaxpr` brings its own). Every
    phase is present, zero when the program has none of it.

    ```python
    closed, *_ = eqx.filter_make_jaxpr(train_step)(model, opt_state, batch)
    work = count_work(closed, flop_rate=989e12, byte_rate=3.35e12)
    work["backward"].flops / work["forward"].flops  # about 2, more with remat
    ```
    """
    for name, value in (
        ("flop_rate", flop_rate),
        ("byte_rate", byte_rate),
        ("host_flop_rate", host_flop_rate),
        ("host_byte_rate", host_byte_rate),
        ("peak_flop_rate", peak_flop_rate),
    ):
        if value is not None and not (isinstance(value, (int, float, np.floating)) and value > 0):
            raise ValueError(_RATE_ERROR.format(name=name, value=value))
    given = (flop_rate, byte_rate, host_flop_rate, host_byte_rate, peak_flop_rate)
    rates = _Rates(*(None if v is None else float(v) for v in given), matmul=matmul_efficiency)
    counter = _walked(jaxpr, rates, constants)
    return {
        phase: _freeze(counter.work[phase], counter.unpriced[phase], counter.caveats[phase])
        for phase in PHASES
    }


def kernel_table(jaxpr: Any, constants: dict | None = None) -> dict[Key, KernelCost]:
    """What a traced program says of its Pallas kernels, by kernel name and operand shapes
    (`fused.kernel_key`): the compiled simulation prices them by it (`schedule.simulate`),
    as the compiled text carries no GPU kernel's cost estimate and no splash mask."""
    return _walked(jaxpr, _Rates(None, None, None, None), constants).table


def _walked(jaxpr: Any, rates: _Rates, constants: dict | None) -> _Counter:
    inner = _open(jaxpr)
    if not isinstance(inner, jex.core.Jaxpr):
        raise TypeError(
            f"`count_work` expects a `jax.extend.core.ClosedJaxpr` or `Jaxpr` (from "
            f"`jax.make_jaxpr(f)(*args)` or `eqx.filter_make_jaxpr(f)(*args)[0]`); got "
            f"{type(jaxpr).__name__}."
        )
    values = dict(constants or {})
    values.update(zip(inner.constvars, getattr(jaxpr, "consts", ())))
    counter = _Counter(rates)
    counter.walk(_dce(inner), 1.0, "forward", False, False, values)
    return counter


def _freeze(tally: dict[str, float], unpriced: dict[str, float], caveats: list[str]) -> PhaseWork:
    return PhaseWork(
        flops=tally["flops"],
        recompute_flops=tally["recompute_flops"],
        matmul_bytes=tally["matmul_bytes"],
        other_bytes=tally["other_bytes"],
        seconds=tally["seconds"],
        host_flops=tally["host_flops"],
        host_bytes=tally["host_bytes"],
        host_seconds=tally["host_seconds"],
        while_loops=int(tally["while_loops"]),
        unpriced=tuple(unpriced.items()),
        caveats=tuple(caveats),
    )
