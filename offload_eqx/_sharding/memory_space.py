"""Memory spaces of arrays and tracers: which is host-typed, and explicit moves between them."""

import os
from typing import Any

import equinox as eqx
import jax
from jax.core import Tracer
from jax.extend.core import set_current_trace
from jax.sharding import NamedSharding

from .._base.jax_private import current_trace, trace_of
from .mesh import typed


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


def is_host_aval(aval: Any) -> bool:
    """Whether an abstract value (`jax.core.ShapedArray`) is typed as host memory."""
    return getattr(aval, "memory_space", None) == jax.memory.Space.Host


def to_device(x: Any) -> Any:
    """An explicit host-to-device transfer of a host-typed array; anything else unchanged."""
    if is_host_typed(x):
        return jax.device_put(x, jax.memory.Space.Device)
    return x


# Bodies whose transpose cannot take a host-typed constant: JAX 0.10.2 accumulates the
# cotangent of a value a `scan`/`fori_loop` body or a `cond` branch closes over in a
# device-typed zero, and fails ("Expected cotangent type float32<host>[...] but got
# float32[...]") when that value is host-typed and fetched inside the body. Remat and jit
# bodies take such constants as operands and are not affected (tests/test_jax_messages.py).
_LOOP_BODIES = ("scan", "fori", "while", "cond", "switch", "closure_convert")
# A function traced by Equinox's `filter_closure_convert` (the body of
# `eqx.internal.while_loop(..., kind="checkpointed")`, diffrax's solver loop): what it
# closes over becomes an operand of every iteration, so it is a loop body too.
_EQUINOX_CLOSURES = os.sep + "equinox" + os.sep + "_make_jaxpr.py"


def captured_by_loop(x: Any) -> bool:
    """Whether `x`, a tracer, is closed over by a loop body or a branch traced now: a
    value of an outer trace that the body will take as a constant."""
    own = trace_of(x)
    if own is None:
        return False
    trace = current_trace()
    while trace is not None and trace is not own:
        info = getattr(getattr(trace, "frame", None), "debug_info", None)
        kind = getattr(info, "traced_for", None) or ""
        source = getattr(info, "func_src_info", None) or ""
        if any(body in kind for body in _LOOP_BODIES) or _EQUINOX_CLOSURES in source:
            return True
        trace = getattr(trace, "parent_trace", None)
    return False


# The scope of a fetch made to be kept where it is used (`ox.fetch`, or a host leaf a loop
# closes over, fetched outside the loop): the audit does not count its device copy, kept
# for the backward pass, as a residual the program should not have.
FETCH_SCOPE = "ox_fetch"


def fetch_kept(x: Any) -> Any:
    """An explicit fetch of a host-typed array whose device copy may be kept for the
    backward pass (see `FETCH_SCOPE`)."""
    with jax.named_scope(FETCH_SCOPE):
        return jax.device_put(x, jax.memory.Space.Device)


def fetch_outside(x: Any) -> Any:
    """`fetch_kept` made in the trace the tracer `x` belongs to (outside the loop that
    captured it): the loop then closes over a device value, and its cotangent is summed
    on the device and sent back to host memory once."""
    with set_current_trace(trace_of(x)):
        return fetch_kept(x)


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


# A transfer's label in the name stack, for the audit: `ox_moves[gradient=grads.w1]`.
LABEL_SCOPE = "ox_moves"


def labelled(kind: str, what: str) -> Any:
    """A scope whose explicit transfers the audit reports as `kind` `what` (a gradient
    sent to a host computation, an update fetched back) instead of "a computed value"."""
    return jax.named_scope(f"{LABEL_SCOPE}[{kind}={what}]")


def label_in(stack: str) -> tuple[str, str] | None:
    """The innermost `(kind, what)` label in a name stack, if any."""
    start = stack.rfind(LABEL_SCOPE + "[")
    if start < 0:
        return None
    inner = stack[start + len(LABEL_SCOPE) + 1 :]
    kind, _, rest = inner.partition("=")
    return kind, rest[: rest.rfind("]")] if "]" in rest else rest


def retyped(moved: jax.Array, sharding: Any) -> jax.Array:
    """`device_put` returns an array already in place unchanged, even when its type
    disagrees with its memory kind; retype it with an explicit move."""
    if type_matches(moved):
        return moved
    host = sharding.memory_kind == "pinned_host"
    space = jax.memory.Space.Host if host else jax.memory.Space.Device
    return jax.device_put(moved, space)


def match_type(x: Any) -> Any:
    """`x` typed by the memory kind of its sharding, without copying. An array that
    Orbax builds with a single-device sharding in `pinned_host` is typed as device
    memory, and a step traced for it would compile it as device memory."""
    if not isinstance(x, jax.Array) or isinstance(x, Tracer) or type_matches(x):
        return x
    sharding = typed(x.sharding)
    if not isinstance(sharding, NamedSharding):  # no way to retype it in place
        return retyped(x, x.sharding)
    shards = [shard.data for shard in x.addressable_shards]
    return jax.make_array_from_single_device_arrays(x.shape, sharding, shards)
