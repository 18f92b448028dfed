"""Optimizer state in host memory, updated one parameter at a time.

`ox.offload_optimizer` fetches the whole state with one `device_put` per leaf and lets XLA
schedule the fetches. XLA's latency-hiding scheduler starts every host-to-device copy as
early as it can, so the whole state (Adam: twice the parameters) is on the device at once,
and device temp *rises* (measured on h100 at the tutorial's size: 1.53 -> 2.68 GiB).

`sequential_offload_optimizer` keeps one state per parameter leaf and updates the leaves in
a chain: the fetch of leaf `i`'s state waits, through an `optimization_barrier`, for the
new state and the update of leaf `i - 1`. At most one leaf's state is on the device at a
time, so the peak is the arguments, the gradients (which become the updates one by one)
and one leaf's state: the analytic bound of `experiments/optimizer_offloading.py`.

The wrapped transformation must act on each leaf independently (`adam`, `adamw`, `sgd`,
`lion`, ...). Global-norm clipping, the usual exception, is an option: the norm is
computed once over all gradients before the chain starts.
"""

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import optax

from ._context import is_host_typed, to_device, to_host
from ._optimizer import DeviceState, OffloadedState


def _barrier(values: Any, token: Any) -> tuple[Any, Any]:
    """Values that XLA can only use after `token` is computed."""
    return jax.lax.optimization_barrier((values, token))


def sequential_offload_optimizer(
    per_leaf: optax.GradientTransformation,
    *,
    clip_global_norm: float | None = None,
    memory: str = "pinned_host",
) -> optax.GradientTransformationExtraArgs:
    """Like `ox.offload_optimizer(optax.chain(optax.clip_by_global_norm(c), per_leaf))`,
    but with at most one parameter's optimizer state on the device at a time.

    **Arguments:**

    - `per_leaf`: an optax transformation that treats each leaf independently.
    - `clip_global_norm`: if given, gradients are first scaled as by
        `optax.clip_by_global_norm(clip_global_norm)` (the norm over all leaves).
    - `memory`: `"pinned_host"` (default) or `"device"`, as in `ox.offload_optimizer`.

    The state is a `list` with one `per_leaf` state per array leaf of the parameters, in
    `jax.tree_util.tree_leaves` order (scalars such as Adam's count are per leaf too).
    """
    if memory not in ("pinned_host", "device"):
        raise ValueError(
            f"sequential_offload_optimizer(memory={memory!r}): expected one of "
            "'device', 'pinned_host'."
        )
    wrapper = OffloadedState if memory == "pinned_host" else DeviceState

    def init_fn(params):
        from ._place import planned_shardings

        leaves = jax.tree_util.tree_leaves(eqx.filter(params, eqx.is_array))

        def init_on_device(leaves):
            return wrapper([per_leaf.init(to_device(leaf)) for leaf in leaves])

        abstract = eqx.filter_eval_shape(init_on_device, leaves)
        shardings = planned_shardings(abstract, name="opt_state")

        def init_placed(leaves):
            return jax.tree_util.tree_map(
                lambda x, s: to_host(x) if s is not None and s.memory_kind == "pinned_host" else x,
                init_on_device(leaves),
                shardings,
                is_leaf=lambda x: x is None,
            )

        return jax.jit(init_placed, out_shardings=shardings)(leaves)

    def update_fn(updates, state, params=None, **extra_args):
        if not isinstance(state, (OffloadedState, DeviceState)):
            raise TypeError(
                f"sequential_offload_optimizer: the state is a {type(state).__name__}, not "
                "the state returned by this optimizer's `init`. Pass the state that "
                "`opt.init(params)` returned (and that the previous step returned)."
            )
        grads, treedef = jax.tree_util.tree_flatten(eqx.filter(updates, eqx.is_array))
        grads = [to_device(g) for g in grads]
        param_leaves = (
            [None] * len(grads)
            if params is None
            else jax.tree_util.tree_leaves(eqx.filter(params, eqx.is_array))
        )
        if len(state.inner) != len(grads):
            raise ValueError(
                f"sequential_offload_optimizer: the state holds {len(state.inner)} leaves "
                f"but the gradients have {len(grads)}. Initialise the optimizer with the "
                "same parameters that are differentiated."
            )
        scale = None
        if clip_global_norm is not None:
            norm = optax.global_norm(grads)
            scale = jnp.where(norm < clip_global_norm, 1.0, clip_global_norm / norm)
        token = jnp.zeros((), jnp.float32) if scale is None else scale
        new_updates, new_states = [], []
        for grad, leaf_state, param in zip(grads, state.inner, param_leaves):
            host_leaves = jax.tree_util.tree_map(is_host_typed, leaf_state)
            # The fetch of this leaf's state cannot start before the previous leaf is done.
            (leaf_state, grad), token = _barrier((leaf_state, grad), token)
            leaf_state = jax.tree_util.tree_map(to_device, leaf_state)
            if scale is not None:
                grad = (grad * scale).astype(grad.dtype)
            if param is not None:
                param = to_device(param)
            if isinstance(per_leaf, optax.GradientTransformationExtraArgs):
                update, new_state = per_leaf.update(grad, leaf_state, param, **extra_args)
            else:
                update, new_state = per_leaf.update(grad, leaf_state, param)
            new_state = jax.tree_util.tree_map(
                lambda was_host, x: to_host(x) if was_host else x, host_leaves, new_state
            )
            # The next fetch also waits for this leaf's new state to be back on the host,
            # so its device buffers die here rather than at the end of the step.
            (update, new_state), token = _barrier((update, new_state), token)
            new_updates.append(update)
            new_states.append(new_state)
        return jax.tree_util.tree_unflatten(treedef, new_updates), type(state)(new_states)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
