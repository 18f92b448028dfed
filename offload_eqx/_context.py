"""The plan in force while `ox.filter_jit` traces, read by regions and the optimizer."""

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any

import equinox as eqx
import jax

from ._plan import Plan

_ACTIVE_PLAN: contextvars.ContextVar[Plan | None] = contextvars.ContextVar(
    "offload_eqx_plan", default=None
)


# While tracing: the traced argument leaves by identity, to their plan paths, so that
# errors raised deep inside (a region, a scan) name `model.layers.w1`, not `stacked.w1`.
_LEAF_PATHS: contextvars.ContextVar[dict[int, str]] = contextvars.ContextVar(
    "offload_eqx_leaf_paths", default={}
)


def active_plan() -> Plan | None:
    return _ACTIVE_PLAN.get()


def argument_path(leaf: Any) -> str | None:
    """The plan path of a traced argument leaf of the `ox.filter_jit` being traced."""
    return _LEAF_PATHS.get().get(id(leaf))


@contextlib.contextmanager
def using_plan(plan: Plan, traced_leaves: Any = ()) -> Iterator[None]:
    token = _ACTIVE_PLAN.set(plan)
    paths = _LEAF_PATHS.set({id(x): leaf.path for x, leaf in zip(traced_leaves, plan.leaves)})
    try:
        yield
    finally:
        _LEAF_PATHS.reset(paths)
        _ACTIVE_PLAN.reset(token)


def is_host_typed(x: Any) -> bool:
    """Whether `x` is an array whose type says it lives in host memory.

    Works on concrete arrays and on tracers alike: inside a trace the memory space is
    part of the type (`f32<host>[...]`).
    """
    if not eqx.is_array(x):
        return False
    try:
        return jax.typeof(x).memory_space == jax.memory.Space.Host
    except (AttributeError, TypeError):
        return False


def to_device(x: Any) -> Any:
    """An explicit host-to-device transfer of a host-typed array; anything else unchanged."""
    if is_host_typed(x):
        return jax.device_put(x, jax.memory.Space.Device)
    return x


def to_host(x: Any) -> Any:
    """An explicit device-to-host transfer of a device-typed array; anything else unchanged."""
    if eqx.is_array(x) and not is_host_typed(x):
        return jax.device_put(x, jax.memory.Space.Host)
    return x


def type_matches(x: jax.Array) -> bool:
    """Whether a concrete array's type agrees with the memory kind of its sharding.

    They can disagree: a `jax.jit` whose `out_shardings` put a device-typed result in
    `pinned_host` returns an array in host memory whose type says device, and every
    later trace then compiles it as device memory.
    """
    host_kind = x.sharding.memory_kind == "pinned_host"
    return host_kind == (jax.typeof(x).memory_space == jax.memory.Space.Host)
