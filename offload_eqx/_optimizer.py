"""Optimizer state in host memory: `ox.offload_optimizer` and `ox.apply_updates`.

The state of any optax `GradientTransformation` lives in pinned host memory between
steps (its scalars, such as Adam's step count, stay on the device). Each update fetches
the state, the gradients and the parameters that are host-typed to the device
explicitly, runs the wrapped transformation there, and sends the new state back.
"""

from collections.abc import Callable
from typing import Any, cast

import equinox as eqx
import jax
import optax

from ._context import is_host_typed, to_device, to_host
from ._mesh import mirror_parameters, resolve_mesh
from ._placement import Placement, check_memory

_METADATA_HOST = {"offload_eqx": Placement(memory="pinned_host", role="optimizer")}
_METADATA_DEVICE = {"offload_eqx": Placement(memory="device", role="optimizer")}


class OffloadedState(eqx.Module):
    """The state of `ox.offload_optimizer`: the wrapped transformation's state, placed in
    `pinned_host` (its scalars on the device) under the model's own annotations."""

    inner: Any = eqx.field(metadata=_METADATA_HOST)


class DeviceState(eqx.Module):
    """Like `OffloadedState`, declared `"device"`: strategies may still offload it."""

    inner: Any = eqx.field(metadata=_METADATA_DEVICE)


def init_in_place(init_on_device: Callable[[Any], Any], params: Any) -> Any:
    """Initialise optimizer state straight into its planned memory.

    One jit fetches the parameters, initialises on the device and writes the state into
    its declared memory: no eager op touches a host array, and the state is never all on
    the device at once. The in-program `to_host` matters: an array that only
    `out_shardings` puts in host memory keeps a device type, and later traces would
    treat it as device memory. On a mesh, each leaf is sharded like its parameter.
    """
    from ._place import planned_shardings  # late import: _place imports the plan

    abstract = eqx.filter_eval_shape(init_on_device, params)
    mesh = resolve_mesh([("params", params)])
    shardings = planned_shardings(abstract, name="opt_state", mesh=mesh)
    if mesh is not None:
        shardings = mirror_parameters(shardings, abstract, params, mesh)

    def init_placed(params):
        return jax.tree_util.tree_map(
            lambda x, s: to_host(x) if s is not None and s.memory_kind == "pinned_host" else x,
            init_on_device(params),
            shardings,
            is_leaf=lambda x: x is None,
        )

    return jax.jit(init_placed, out_shardings=shardings)(params)


def _on_device(tree: Any) -> Any:
    return jax.tree_util.tree_map(to_device, tree)


def offload_optimizer(
    inner: optax.GradientTransformation, *, memory: str = "pinned_host"
) -> optax.GradientTransformationExtraArgs:
    """Wrap an optax transformation so that its state lives in `memory` between steps.

    **Arguments:**

    - `inner`: any `optax.GradientTransformation` (`chain`, `adamw`, `inject_hyperparams`,
        `multi_transform`, ...).
    - `memory`: where the state is declared to live: `"pinned_host"` (default) or
        `"device"`. Strategies passed to `ox.filter_jit`/`ox.place` override it.

    **Returns:** a `GradientTransformation` whose `init(params)` returns the state already
    placed, and whose `update(grads, state, params)` computes on the device: host-typed
    gradients (the gradients of host-resident parameters), state and parameters are
    fetched explicitly, and the new state is sent back to host memory.
    """
    check_memory(memory, where="ox.offload_optimizer(memory=...)")
    wrapper = OffloadedState if memory == "pinned_host" else DeviceState

    def init_fn(params):
        params = eqx.filter(params, eqx.is_array)

        def init_on_device(params):
            return wrapper(inner.init(_on_device(params)))

        return init_in_place(init_on_device, params)

    def update_fn(updates, state, params=None, **extra_args):
        if not isinstance(state, (OffloadedState, DeviceState)):
            raise TypeError(
                f"ox.offload_optimizer: the state is a {type(state).__name__}, not the "
                "state returned by this optimizer's `init`. Pass the state that "
                "`opt.init(params)` returned (and that the previous step returned)."
            )
        host_leaves = jax.tree_util.tree_map(is_host_typed, state.inner)
        inner_state = _on_device(state.inner)
        updates = _on_device(eqx.filter(updates, eqx.is_array))
        if params is not None:
            params = _on_device(eqx.filter(params, eqx.is_array))
        if isinstance(inner, optax.GradientTransformationExtraArgs):
            new_updates, new_inner = inner.update(updates, inner_state, params, **extra_args)
        else:
            new_updates, new_inner = inner.update(updates, inner_state, params)
        new_inner = jax.tree_util.tree_map(
            lambda was_host, x: to_host(x) if was_host else x, host_leaves, new_inner
        )
        return new_updates, type(state)(new_inner)

    return optax.GradientTransformationExtraArgs(init_fn, cast(Any, update_fn))


def apply_updates(model: Any, updates: Any) -> Any:
    """`eqx.apply_updates` that keeps host-resident parameters on the host.

    For a host-typed parameter the sum is computed on the device (the parameter is
    fetched explicitly) and the result sent back, so no arithmetic runs on host-typed
    values. `None` updates leave the leaf unchanged, as in `eqx.apply_updates`.
    """

    def apply(update, param):
        if update is None:
            return param
        if is_host_typed(param):
            return to_host((to_device(param) + to_device(update)).astype(param.dtype))
        return (param + to_device(update)).astype(param.dtype)

    return jax.tree_util.tree_map(apply, updates, model, is_leaf=lambda x: x is None)
