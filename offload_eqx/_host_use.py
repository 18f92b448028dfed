"""Which host-resident leaves made a trace fail, and where the user's code used them.

JAX reports only the primitive (`memory_space of all inputs passed to dot_general must
be the same`), or, for a value computed on host memory and differentiated, only the
types (`Expected cotangent type float32<host>[] but got float32[]`). To name the leaves,
the function is traced again with every host-resident argument but one typed as device
memory: the ones that still fail are at fault, and the traceback of each failure holds
the line of the user's code that used it. This runs only on that error path.
"""

import os
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import equinox as eqx
import jax
import optax

from ._errors import HostUseError, is_host_use_error, mixed_memory_spaces_summary
from ._plan import Plan

_HOST_USE = (
    "{caller}: {paths} {are} host-resident (pinned_host) and {is_} used outside any "
    "`ox.scan`/`ox.checkpoint` region{where}, where JAX cannot compute on {it} or "
    "differentiate {it} (`{error}`): {cause} Fixes: {fixes}"
)
_GENERAL_CAUSE = (
    "the code there uses {it} directly (in the loss, or in a module called outside a "
    "region), or {its} gradient, host-typed (the transpose of the fetch sends it back to "
    "host memory), meets device values (gradient clipping, the optimizer)."
)
_GENERAL_FIXES = (
    "fetch {it} where {it_is} used, `ox.fetch(...)` (once, there; the gradient of that "
    "use is added to the rest in host memory); call the module that uses {it} through "
    "`ox.scan(...)`/`ox.checkpoint(...)`{annotate}; for an L2 penalty, chain "
    "`optax.add_decayed_weights(2 * weight)` before the optimizer instead (the same "
    "update, nothing fetched); wrap the optimizer with `ox.offload_optimizer(...)` (which "
    "fetches gradients explicitly); or keep {it} on the device (`ox.field(memory="
    "'device')`, or a strategy that keeps parameters there)."
)
_ANNOTATE = (
    " (or annotate it with `ox.annotate(..., memory=...)`: its `__call__` and public "
    "methods then bring their own region)"
)
# Library functions that add updates to parameters on the device, and what replaces them.
_APPLY_UPDATES = {
    ("equinox", "apply_updates"): "eqx.apply_updates",
    ("optax", "apply_updates"): "optax.apply_updates",
}
_APPLY_CAUSE = (
    "`{function}` adds the updates to {it} on the device, and the updates of host-resident "
    "parameters are device-typed."
)
_APPLY_FIXES = (
    "replace `{function}(model, updates)` with `ox.apply_updates(model, updates)`, which "
    "adds each update where its parameter lives (on the host for host-resident ones), or "
    "compute and apply the update in one call with `ox.update_and_apply(opt, grads, "
    "opt_state, model)`."
)

# Frames of these packages are not where the user's code used a leaf.
_LIBRARIES = tuple(
    os.path.dirname(module.__file__ or "") + os.sep for module in (jax, eqx, optax)
) + (os.path.dirname(__file__) + os.sep,)


def _as_device(a: jax.ShapeDtypeStruct) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding.with_memory_kind("device"))


def use_site(error: BaseException) -> str | None:
    """`file.py:12 (`code`)`: the innermost frame of the user's code in the traceback of
    the operation that failed (for a backward-pass failure, JAX keeps the forward
    operation's traceback as the error's cause)."""
    frames = []
    for exception in (error.__cause__, error):
        if exception is not None and exception.__traceback__ is not None:
            frames = traceback.extract_tb(exception.__traceback__)
            if any(not f.filename.startswith(_LIBRARIES) for f in frames):
                break
    user = [f for f in frames if not f.filename.startswith(_LIBRARIES)]
    if not user:
        return None
    frame = user[-1]
    code = f" (`{frame.line.strip()}`)" if frame.line else ""
    return f"{os.path.basename(frame.filename)}:{frame.lineno}{code}"


def locate_host_use(
    flat: Callable[..., Any],
    abstract: Sequence[jax.ShapeDtypeStruct],
    plan: Plan,
    error: BaseException,
    caller: str,
) -> HostUseError:
    """A `HostUseError` naming the host-resident leaves that made the trace fail, and the
    line of the user's code where the first of them was used."""
    host = [
        i
        for i, a in enumerate(abstract)
        if a.sharding is not None and a.sharding.memory_kind == "pinned_host"
    ]
    offenders = []
    where = None
    for i in host:
        trial = [_as_device(a) if j in host and j != i else a for j, a in enumerate(abstract)]
        try:
            jax.make_jaxpr(flat)(*trial)
        except ValueError as e:
            if is_host_use_error(e):
                offenders.append(plan.leaves[i].path)
                where = where or use_site(e)
        except Exception:  # another error with only this leaf on the host: not this one
            pass
    one = len(offenders) <= 1
    where = where or use_site(error)
    words = dict(it="it" if one else "them", it_is="it is" if one else "they are")
    function = _library_function(error)
    if function is not None:
        cause = _APPLY_CAUSE.format(function=function, **words)
        fixes = _APPLY_FIXES.format(function=function)
    else:
        cause = _GENERAL_CAUSE.format(its="its" if one else "their", **words)
        declared = {leaf.path for leaf in plan.leaves if leaf.declared is not None}
        annotated = bool(offenders) and set(offenders) <= declared
        fixes = _GENERAL_FIXES.format(annotate="" if annotated else _ANNOTATE, **words)
    message = _HOST_USE.format(
        caller=caller,
        paths=", ".join(f"`{p}`" for p in offenders) or "some host-resident leaves",
        are="is" if one else "are",
        is_="is" if one else "are",
        where=f", at {where}" if where else "",
        error=mixed_memory_spaces_summary(error),
        cause=cause,
        fixes=fixes,
        **words,
    )
    return HostUseError(message, offenders)


def _library_function(error: BaseException) -> str | None:
    """`eqx.apply_updates` or `optax.apply_updates`, when the failing operation ran inside
    one of them (their frames are in the traceback of the error or of its cause)."""
    for exception in (error, error.__cause__):
        if exception is None or exception.__traceback__ is None:
            continue
        for frame in traceback.extract_tb(exception.__traceback__):
            parts = frame.filename.split(os.sep)
            for (package, name), function in _APPLY_UPDATES.items():
                if package in parts and frame.name == name:
                    return function
    return None
