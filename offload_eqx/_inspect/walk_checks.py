"""The contract checks the jaxpr walk makes on each equation it follows
(`jaxpr_walk._Walker`): a host leaf's device copy kept as a residual, and arithmetic on
host-typed values outside `ox.host_compute()` (a host-typed gradient among them). Each
returns the breaches it finds as `(rule, leaf path, message)`; the walker records them.
"""

from collections.abc import Sequence
from typing import Any

from .._base.primitives import is_var
from .._sharding.memory_space import is_host_aval


def residual_breaches(eqn: Any, env: dict) -> list[tuple[str, str, str]]:
    """A parameter's device copy fetched in the forward pass and read by `eqn`, a
    backward equation: kept as a residual for the whole step."""
    found = []
    for v in eqn.invars:
        if not is_var(v):
            continue
        source = env.get(v)
        if source is not None and source.fetched_in == "forward" and source.kind == "parameter":
            found.append(
                (
                    "fetched outside a region",
                    source.what,
                    f"`{source.what}` is host-resident, but its device copy fetched in the "
                    "forward pass is kept for the backward pass (a residual), so the whole "
                    "leaf occupies device memory for the step. Fetch it only inside a "
                    "region: call the module through `ox.scan(...)`/`ox.checkpoint(...)` "
                    "instead of `jax.device_put(...)` outside one.",
                )
            )
    return found


def host_arithmetic_breaches(
    eqn: Any, env: dict, where: Sequence[str]
) -> list[tuple[str, str, str]]:
    """`eqn` computes on a host-typed operand: a gradient of a host-resident parameter,
    or any other host-typed value."""
    found = []
    for v in eqn.invars:
        if not (is_var(v) and is_host_aval(v.aval)):
            continue
        source = env.get(v)
        place = f" (in {' > '.join(where)})" if where else ""
        if source is not None and source.kind == "gradient":
            found.append(
                (
                    "host-typed gradient",
                    source.what,
                    f"The gradient of `{source.what}` is host-typed (the transpose of its "
                    f"fetch sends it back to host memory) and `{eqn.primitive.name}`"
                    f"{place} computes on it there. Gradients of host-resident parameters "
                    "must reach the optimizer on the device: wrap the optimizer with "
                    "`ox.offload_optimizer(...)`, or fetch them with "
                    "`jax.device_put(g, jax.memory.Space.Device)` before clipping.",
                )
            )
        else:
            what = source.what if source is not None else "a host-typed value"
            found.append(
                (
                    "arithmetic on host",
                    what,
                    f"`{eqn.primitive.name}`{place} computes on `{what}` "
                    f"({v.aval.str_short()}) in host "
                    "memory. Fetch it to the device first (call the module through "
                    "`ox.scan`/`ox.checkpoint`, or `jax.device_put(x, "
                    "jax.memory.Space.Device)`), or, if computing on the host is intended, "
                    "wrap the computation in `with ox.host_compute():`.",
                )
            )
    return found
