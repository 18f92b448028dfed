"""Optimizer state in host memory, fetched and updated one parameter at a time.

`ox.offload_optimizer` fetches the whole state with one `device_put` per leaf and lets XLA
schedule the copies. XLA's scheduler starts every host-to-device copy as early as its
operands allow (right after the gradients' global norm), so the whole state (Adam: twice
the parameters) is on the device at once, and the new state's device buffers stay live
until their copies back at the end of the step. Device temp *rises* (h100, the tutorial's
DIM 7168: 1.53 -> 2.68 GiB).

`sequential_offload_optimizer` runs each parameter's update inside its own
`jax.lax.cond`. The branch fetches that parameter's state, updates it and sends the new
state back to host memory; the predicate of the next parameter's `cond` is an always-true
value passed through an `optimization_barrier` together with this parameter's update, so
XLA can neither fold the `cond` away nor start the next fetch early. A conditional is one
instruction for the scheduler: copies inside a branch cannot be hoisted out of it, and the
branch's device buffers die when it returns. At most one parameter's state (and its new
state) is on the device at a time. Chaining `optimization_barrier`s around plain
`device_put`s (the previous attempt) did not work: XLA splits the barriers per operand and
still hoists every copy to the front.

Transformations that couple leaves (`optax.clip_by_global_norm`) go in `global_transform`,
applied once to all gradients on the device before the chain; the per-leaf
transformation is checked, by tracing, to compute each parameter's update and state from
that parameter's gradient and value only.
"""

from collections.abc import Sequence
from typing import Any, cast

import equinox as eqx
import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import optax

from ._context import is_host_typed, to_device, to_host
from ._optimizer import DeviceState, OffloadedState, init_in_place
from ._placement import check_memory

_NAME = "ox.sequential_offload_optimizer"


class SequentialState(eqx.Module):
    """The state of `sequential_offload_optimizer` (inside its `OffloadedState`/`DeviceState`):
    `global_state` is `global_transform`'s state (for all parameters), `leaves` one state
    of the per-leaf transformation per array leaf of the parameters, in
    `jax.tree_util.tree_leaves` order (scalars such as Adam's count are repeated per leaf)."""

    global_state: Any
    leaves: list


def _update(transform, updates, state, params, extra_args):
    if isinstance(transform, optax.GradientTransformationExtraArgs):
        return transform.update(updates, state, params, **extra_args)
    return transform.update(updates, state, params)


def _gate(token: Any) -> jax.Array:
    """`True`, available only once `token` is computed, and opaque to XLA's simplifier
    (a literal predicate would let it inline the `cond` and hoist the copies again)."""
    pred, _ = jax.lax.optimization_barrier((jnp.asarray(True), token))
    return pred


def _device_leaves(tree: Any) -> list:
    return [x for x in jax.tree_util.tree_leaves(tree) if eqx.is_array(x) and not is_host_typed(x)]


def _leaf_dependencies(jaxpr: Any, labels: Sequence[frozenset]) -> list[frozenset]:
    """For each output of `jaxpr`, the union of the labels of the inputs it depends on
    (conservative: every output of an equation depends on all its inputs)."""
    deps: dict[Any, frozenset] = dict(zip(jaxpr.invars, labels))
    for eqn in jaxpr.eqns:
        found: frozenset = frozenset()
        for var in eqn.invars:
            if not isinstance(var, jax.extend.core.Literal):
                found |= deps.get(var, frozenset())
        for var in eqn.outvars:
            deps[var] = found
    return [
        frozenset() if isinstance(v, jax.extend.core.Literal) else deps.get(v, frozenset())
        for v in jaxpr.outvars
    ]


def check_per_leaf(transform: optax.GradientTransformation, params: Any) -> None:
    """Raise a `ValueError` unless `transform`, traced on all of `params` at once, computes
    every update and every new state leaf from the gradient and value of one parameter.

    Elementwise transformations (`adam`, `adamw`, `sgd`, `lion`, `rmsprop`, ...) and
    per-parameter ones (`scale_by_trust_ratio`, `adafactor`) pass; `clip_by_global_norm`
    and anything else that reduces over several parameters fails, naming the leaves.
    """
    params = eqx.filter(params, eqx.is_array)
    abstract = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), params)
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(abstract)[0]]
    if len(paths) < 2:
        return
    state = jax.eval_shape(transform.init, abstract)

    def update(grads, state, params):
        return _update(transform, grads, state, params, {})

    closed, out_shape = jax.make_jaxpr(update, return_shape=True)(abstract, state, abstract)
    n_state = len(jax.tree_util.tree_leaves(state))
    own = [frozenset([i]) for i in range(len(paths))]
    labels = own + [frozenset()] * n_state + own
    deps = _leaf_dependencies(closed.jaxpr, labels)
    out_paths = [
        ("update" if i == 0 else "new state") + jax.tree_util.keystr(p)
        for i, part in enumerate(out_shape)
        for p, _ in jax.tree_util.tree_flatten_with_path(part)[0]
    ]
    for out_path, dep in zip(out_paths, deps):
        if len(dep) > 1:
            names = ", ".join(f"`{paths[i]}`" for i in sorted(dep)[:3])
            raise ValueError(
                f"{_NAME}: the per-leaf transformation couples parameters: its {out_path} "
                f"depends on the gradients or values of {names}. Only transformations that "
                "treat each parameter on its own (adam, adamw, sgd, lion, ...) can be applied "
                "one parameter at a time; pass global ones such as "
                "`optax.clip_by_global_norm` as `global_transform=`, or use "
                "`ox.offload_optimizer`."
            )


def sequential_offload_optimizer(
    per_leaf: optax.GradientTransformation,
    *,
    global_transform: optax.GradientTransformation | None = None,
    memory: str = "pinned_host",
    check: bool = True,
) -> optax.GradientTransformationExtraArgs:
    """Like `ox.offload_optimizer(optax.chain(global_transform, per_leaf))`, with at most one
    parameter's optimizer state on the device at a time.

    **Arguments:**

    - `per_leaf`: an optax transformation that treats each parameter on its own (`adam`,
        `adamw`, `sgd`, `lion`, `chain`s of them, ...). It is applied to one array leaf at a
        time, each in its own `jax.lax.cond`, so that XLA fetches that leaf's state, updates
        it and sends it back before the next leaf's state is fetched.
    - `global_transform`: an optional transformation applied first, to all gradients at
        once on the device (`optax.clip_by_global_norm(1.0)`); its state is fetched whole.
    - `memory`: where the state is declared to live: `"pinned_host"` (default) or
        `"device"`, as in `ox.offload_optimizer`; strategies override it.
    - `check`: at `init`, trace `per_leaf` on all parameters and raise a `ValueError` if an
        update or state leaf depends on more than one parameter (see `check_per_leaf`).

    **Returns:** a `GradientTransformation` whose state is a `SequentialState` (one
    `per_leaf` state per array leaf) inside an `ox.OffloadedState`; updates and new
    parameters are identical to `optax.chain(global_transform, per_leaf)`.
    """
    check_memory(memory, where=f"{_NAME}(memory=...)")
    wrapper = OffloadedState if memory == "pinned_host" else DeviceState
    if global_transform is None:
        global_transform = optax.identity()

    def init_fn(params):
        params = eqx.filter(params, eqx.is_array)
        if check:
            check_per_leaf(per_leaf, params)

        def init_on_device(params):
            params = jax.tree_util.tree_map(to_device, params)
            leaves = jax.tree_util.tree_leaves(params)
            return wrapper(
                SequentialState(
                    global_state=global_transform.init(params),
                    leaves=[per_leaf.init(leaf) for leaf in leaves],
                )
            )

        return init_in_place(init_on_device, params)

    def update_fn(updates, state, params=None, **extra_args):
        inner = getattr(state, "inner", None)
        if not isinstance(state, (OffloadedState, DeviceState)) or not isinstance(
            inner, SequentialState
        ):
            raise TypeError(
                f"{_NAME}: the state is a {type(state).__name__}, not the state returned by "
                "this optimizer's `init`. Pass the state that `opt.init(params)` returned "
                "(and that the previous step returned)."
            )
        grads = jax.tree_util.tree_map(to_device, eqx.filter(updates, eqx.is_array))
        if params is not None:
            params = eqx.filter(params, eqx.is_array)

        # 1. The global part, on all gradients (device-resident) at once.
        global_host = jax.tree_util.tree_map(is_host_typed, inner.global_state)
        global_state = jax.tree_util.tree_map(to_device, inner.global_state)
        device_params = None if params is None else jax.tree_util.tree_map(to_device, params)
        grads, global_state = _update(
            global_transform, grads, global_state, device_params, extra_args
        )
        global_state = jax.tree_util.tree_map(
            lambda was_host, x: to_host(x) if was_host else x, global_host, global_state
        )

        # 2. The per-leaf part, one `cond` per leaf, each gated on the previous one.
        grad_leaves, treedef = jax.tree_util.tree_flatten(grads)
        param_leaves = (
            [None] * len(grad_leaves) if params is None else jax.tree_util.tree_leaves(params)
        )
        if len(inner.leaves) != len(grad_leaves) or len(param_leaves) != len(grad_leaves):
            raise ValueError(
                f"{_NAME}: the state holds {len(inner.leaves)} per-leaf states but the "
                f"gradients have {len(grad_leaves)} array leaves (and the parameters "
                f"{len(param_leaves)}). Initialise the optimizer with the parameters that are "
                "differentiated, and pass the same parameters to `update`."
            )
        token: Any = _device_leaves(grad_leaves)
        new_updates, new_states = [], []
        for grad, leaf_state, param in zip(grad_leaves, inner.leaves, param_leaves):
            host_mask = jax.tree_util.tree_map(is_host_typed, leaf_state)

            def run(grad, leaf_state, param, host_mask=host_mask):
                leaf_state = jax.tree_util.tree_map(to_device, leaf_state)
                update, new_state = _update(
                    per_leaf, grad, leaf_state, to_device(param), extra_args
                )
                new_state = jax.tree_util.tree_map(
                    lambda was_host, x: to_host(x) if was_host else x, host_mask, new_state
                )
                return update, new_state

            out_shape = jax.eval_shape(run, grad, leaf_state, param)

            def skip(grad, leaf_state, param, out_shape=out_shape):
                # Never taken (the predicate is always true); same types as `run`.
                update = jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), out_shape[0])
                return update, leaf_state

            update, new_state = jax.lax.cond(_gate(token), run, skip, grad, leaf_state, param)
            token = _device_leaves(update)
            new_updates.append(update)
            new_states.append(new_state)
        new_inner = SequentialState(global_state=global_state, leaves=new_states)
        return jax.tree_util.tree_unflatten(treedef, new_updates), type(state)(new_inner)

    return optax.GradientTransformationExtraArgs(init_fn, cast(Any, update_fn))
