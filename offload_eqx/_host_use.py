"""Which host-resident leaves made a trace mix memory spaces.

JAX reports only the primitive (`memory_space of all inputs passed to dot_general must
be the same`). To name the leaves, the function is traced again with every host-resident
argument but one typed as device memory: the ones that still fail are at fault. This
runs only on that error path.
"""

from collections.abc import Callable, Sequence
from typing import Any

import jax

from ._errors import HostUseError, mixed_memory_spaces_summary, mixes_memory_spaces
from ._plan import Plan

_HOST_USE = (
    "{caller}: {paths} {are} host-resident (pinned_host) and reached an operation that "
    "mixes memory spaces (`{error}`): either {it_is} used outside any "
    "`ox.scan`/`ox.checkpoint` region, or {its} gradient, which comes out host-typed (the "
    "transpose of the fetch sends it back to host memory), meets device values, e.g. in "
    "gradient clipping or the optimizer. Call the module that uses {it} through "
    "`ox.scan(...)`/`ox.checkpoint(...)` (or annotate it with `ox.annotate(..., "
    "memory=...)`, which brings its own region), wrap the optimizer with "
    "`ox.offload_optimizer(...)` (which fetches gradients explicitly), or place {it} on "
    "the device (`ox.field(memory='device')`, or a strategy that keeps parameters there)."
)


def _as_device(a: jax.ShapeDtypeStruct) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding.with_memory_kind("device"))


def locate_host_use(
    flat: Callable[..., Any],
    abstract: Sequence[jax.ShapeDtypeStruct],
    plan: Plan,
    error: BaseException,
    caller: str,
) -> HostUseError:
    """A `HostUseError` naming the host-resident leaves whose use mixes memory spaces."""
    host = [
        i
        for i, a in enumerate(abstract)
        if a.sharding is not None and a.sharding.memory_kind == "pinned_host"
    ]
    offenders = []
    for i in host:
        trial = [_as_device(a) if j in host and j != i else a for j, a in enumerate(abstract)]
        try:
            jax.make_jaxpr(flat)(*trial)
        except ValueError as e:
            if mixes_memory_spaces(e):
                offenders.append(plan.leaves[i].path)
        except Exception:  # another error with only this leaf on the host: not this one
            pass
    one = len(offenders) <= 1
    message = _HOST_USE.format(
        caller=caller,
        paths=", ".join(f"`{p}`" for p in offenders) or "some host-resident leaves",
        are="is" if one else "are",
        error=mixed_memory_spaces_summary(error),
        it="it" if one else "them",
        it_is="it is" if one else "they are",
        its="its" if one else "their",
    )
    return HostUseError(message, offenders)
