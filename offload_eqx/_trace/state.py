"""The one piece of state a trace carries: the plan in force and what the trace saw.

`ox.filter_jit` installs a `TraceState` while it traces the user's function. Regions
(`ox.scan`, `ox.checkpoint`) read the plan's remat policy from it and count themselves;
`ox.name` records every name it applies, inside a region or not; errors raised deep
inside a region find the plan path of a traced argument leaf (`model.layers.w1`, not
`stacked.w1`). Outside `ox.filter_jit` there is no state, and regions fall back to the
module's own annotations.
"""

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator
from typing import Any

from .._plan.plan import Plan


@dataclasses.dataclass
class TraceState:
    plan: Plan
    leaf_paths: dict[int, str]  # id(traced argument leaf) -> its plan path
    inside_regions: set[str] = dataclasses.field(default_factory=set)
    outside_regions: set[str] = dataclasses.field(default_factory=set)
    regions: int = 0
    depth: int = 0  # how many regions enclose the code being traced now
    # Names carried by a region's output, by the identity of the output tracer, so that
    # the region that receives it as input applies the name's policy at its boundary.
    named_outputs: dict[int, tuple[str, Any]] = dataclasses.field(default_factory=dict)
    # Host-typed leaves a loop body closes over, by identity: (the leaf, its device copy
    # fetched outside the loop), so that every region in the trace shares one fetch.
    fetched_outside: dict[int, tuple[Any, Any]] = dataclasses.field(default_factory=dict)


_STATE: contextvars.ContextVar[TraceState | None] = contextvars.ContextVar(
    "offload_eqx_trace_state", default=None
)


def current() -> TraceState | None:
    """The state of the `ox.filter_jit` trace in progress, if any."""
    return _STATE.get()


def active_plan() -> Plan | None:
    state = _STATE.get()
    return None if state is None else state.plan


def argument_path(leaf: Any) -> str | None:
    """The plan path of a traced argument leaf of the `ox.filter_jit` being traced, or of
    a value that stands for one under a transformation (`jax.grad` and `jax.vmap` wrap
    the argument in a tracer whose primal, or batched value, is the argument)."""
    state = _STATE.get()
    if state is None:
        return None
    for value in stands_for(leaf):
        path = state.leaf_paths.get(id(value))
        if path is not None:
            return path
    return None


def stands_for(leaf: Any) -> list[Any]:
    """`leaf`, and the values it stands for under transformations: `jax.grad` and
    `jax.vmap` wrap a value in a tracer whose primal, or batched value, is the value
    outside them (transformations nest: grad of vmap of ...)."""
    values = [leaf]
    for _ in range(8):
        inner = getattr(leaf, "primal", None)
        if inner is None:
            inner = getattr(leaf, "val", None)
        if inner is None or inner is leaf:
            break
        values.append(inner)
        leaf = inner
    return values


def note_name(leaf: Any, name: str) -> None:
    """Remember that `leaf` (a region's output) carries `name`, for the region that
    takes it as input: under `jax.vmap` of each call, that region sees the value this
    one's batched tracer stands for."""
    state = _STATE.get()
    if state is not None:
        for value in stands_for(leaf):
            state.named_outputs[id(value)] = (name, value)


def name_of(leaf: Any) -> str | None:
    """The name `note_name` gave `leaf`, or a value it stands for, in this trace."""
    state = _STATE.get()
    if state is None:
        return None
    for value in stands_for(leaf):
        entry = state.named_outputs.get(id(value))
        if entry is not None and entry[1] is value:
            return entry[0]
    return None


@contextlib.contextmanager
def tracing(plan: Plan, traced_leaves: Any = ()) -> Iterator[TraceState]:
    """Install a fresh state for one trace of a function under `plan`."""
    paths = {id(x): leaf.path for x, leaf in zip(traced_leaves, plan.leaves)}
    state = TraceState(plan, paths)
    token = _STATE.set(state)
    try:
        yield state
    finally:
        _STATE.reset(token)


@contextlib.contextmanager
def in_region() -> Iterator[None]:
    state = _STATE.get()
    if state is None:
        yield
        return
    state.regions += 1
    state.depth += 1
    try:
        yield
    finally:
        state.depth -= 1


def inside_region() -> bool:
    state = _STATE.get()
    return state is not None and state.depth > 0


def record_name(name: str) -> None:
    state = _STATE.get()
    if state is not None:
        (state.inside_regions if state.depth > 0 else state.outside_regions).add(name)
