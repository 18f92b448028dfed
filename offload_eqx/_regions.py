"""Remat regions: `ox.checkpoint` for one module call and `ox.scan` over a stacked module.

A region is a `jax.checkpoint` with the plan's remat policy that fetches the module's
host-resident leaves to the device *inside* it. Inside is what matters: the fetched copy
is then recomputed (fetched again) in the backward pass instead of being kept alive as a
residual, so host-resident weights never occupy device memory for the whole step.
"""

from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp

from ._activations import in_region
from ._context import active_plan, argument_path, is_host_typed, to_device
from ._plan import Plan, format_path
from ._strategy import resolve_strategy


def _plan_for(module: Any) -> Plan:
    plan = active_plan()
    if plan is None:
        plan = Plan([("module", module)], resolve_strategy(None))
    return plan


def _region(module: Any, prevent_cse: bool) -> Callable[..., Any]:
    plan = _plan_for(module)
    has_host_leaves = any(is_host_typed(x) for x in jax.tree_util.tree_leaves(module))

    def body(module, args, kwargs):
        module = jax.tree_util.tree_map(to_device, module)
        with in_region():
            return module(*args, **kwargs)

    if plan.saves_everything and not has_host_leaves:
        # Nothing to recompute and nothing to fetch: a plain call, as without offload_eqx.
        return body
    return eqx.filter_checkpoint(body, policy=plan.policy, prevent_cse=prevent_cse)


def checkpoint(module: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Call `module(*args, **kwargs)` inside a remat region.

    The region applies the plan's activation policy to every value named with `ox.name`
    inside the call, and fetches the module's host-resident leaves to the device inside
    the region (again in the backward pass), so their device copies are never residuals.
    """
    return _region(module, prevent_cse=True)(module, args, kwargs)


_AXIS_MISMATCH = (
    "ox.scan: the leaves of the stacked module disagree on the length of the layer axis "
    "{axis}: {lengths}. Every array leaf of a stacked module has the layers along axis "
    "{axis}; build it with `eqx.filter_vmap(make_layer)(keys)` or stack the leaves with "
    "`jax.tree.map(lambda *xs: jnp.stack(xs), *layers)`."
)
_HOST_AXIS = (
    "ox.scan(..., axis={axis}): `{path}` is host-resident, and host-resident leaves can "
    "only be scanned over axis 0 (scanning another axis makes XLA transpose the whole "
    "array before fetching it to the device, which is costly and unsupported on some "
    "platforms). Stack the layers along axis 0, or place `{path}` on the device."
)


def scan(
    stacked: Callable[..., Any],
    carry: Any,
    *args: Any,
    axis: int = 0,
    unroll: int | bool = 1,
    **kwargs: Any,
) -> Any:
    """Apply a stacked module layer after layer: `carry = layer_i(carry, *args, **kwargs)`.

    **Arguments:**

    - `stacked`: a module whose array leaves all have a leading layer axis (for example
        built with `eqx.filter_vmap`). Non-array fields are shared by every layer.
    - `carry`: the input of the first layer; each layer returns the input of the next.
    - `*args`, `**kwargs`: passed unchanged to every layer (masks, positions, ...).
    - `axis`: the layer axis of the leaves (0 by default; host-resident leaves must use 0).
    - `unroll`: passed to `jax.lax.scan`.

    Each layer runs in its own remat region (see `ox.checkpoint`).
    """
    dynamic, static = eqx.partition(stacked, eqx.is_array)
    with_paths = jax.tree_util.tree_flatten_with_path(dynamic)[0]
    if not with_paths:
        raise ValueError(
            "ox.scan: the stacked module has no array leaves, so there is no layer axis "
            "to scan over. Pass a module whose leaves are stacked along axis 0."
        )
    lengths: dict[int, list[str]] = {}
    for path, leaf in with_paths:
        name = argument_path(leaf) or format_path("stacked", path)
        if axis != 0 and is_host_typed(leaf):
            raise ValueError(_HOST_AXIS.format(axis=axis, path=name))
        if jnp.ndim(leaf) <= axis:
            lengths.setdefault(-1, []).append(f"`{name}` (shape {tuple(jnp.shape(leaf))})")
        else:
            lengths.setdefault(jnp.shape(leaf)[axis], []).append(f"`{name}`")
    if len(lengths) > 1:
        described = "; ".join(
            ("no such axis: " if n == -1 else f"length {n}: ") + ", ".join(paths)
            for n, paths in sorted(lengths.items())
        )
        raise ValueError(_AXIS_MISMATCH.format(axis=axis, lengths=described))
    if axis != 0:
        dynamic = jax.tree_util.tree_map(lambda x: jnp.moveaxis(x, axis, 0), dynamic)

    def step(carry, layer_dynamic):
        layer = eqx.combine(layer_dynamic, static)
        return _region(layer, prevent_cse=False)(layer, (carry, *args), kwargs), None

    carry, _ = jax.lax.scan(step, carry, dynamic, unroll=unroll)
    return carry
