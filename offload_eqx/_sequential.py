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

Stacked parameters (the leaves of a module applied with `ox.scan`, with a leading layer
axis) are one leaf for all layers, so one `cond` would still fetch every layer's state at
once. With `layers=L`, each leaf whose leading dimension is `L` is instead updated by a
`jax.lax.fori_loop` over that axis inside its `cond`: an iteration dynamic-slices layer
`i` of the state (and of the gradient and the parameter, which arrive host-typed when the
parameter lives on the host), fetches the slices, runs `per_leaf` on them and writes the
new state slices back with `dynamic_update_slice` into the host arrays carried by the loop
(XLA updates them in place: the input buffers are donated to the loop). Only one layer's
state, gradient and parameter are on the device at a time. This is valid for
transformations that are elementwise within a leaf (`adam`, `adamw`, `sgd`), which `init`
checks on the traced update; scalars of the state (Adam's count) are shared by all slices,
so they are computed once per leaf, as optax does. `update_and_apply` also applies the
updates in the same loop, so the parameters are never fetched whole either.
"""

from collections.abc import Sequence
from typing import Any, NamedTuple, cast

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


# Primitives that compute each element of their output from the same element of their
# inputs (or from scalars): a transformation built from these alone, traced on a stacked
# leaf, treats every layer slice on its own.
_ELEMENTWISE = frozenset(
    """abs acos acosh add and asin asinh atan atan2 atanh cbrt ceil clamp convert_element_type
    copy copy_p cos cosh div eq erf erf_inv erfc exp exp2 expm1 floor ge gt imag integer_pow
    is_finite le lgamma digamma log log1p logistic lt max min mul ne neg nextafter not or pow
    real reduce_precision rem round rsqrt select_n sign sin sinh sqrt square stop_gradient sub
    tan tanh xor""".split()
)


def _elementwise_outputs(jaxpr: Any, aligned: Sequence[bool], shape: tuple) -> list[bool]:
    """Propagate "depends on the stacked leaf, element by element" through `jaxpr`.

    `aligned[k]` says whether input `k` is such a value (of the leaf's shape). Returns the
    same flag for each output, or raises `_NotElementwise` at the first equation that
    mixes elements of an aligned value (a reduction, a matmul, a reshape, ...).
    """
    flags: dict[Any, bool] = dict(zip(jaxpr.invars, aligned))

    def flag(var: Any) -> bool:
        return False if isinstance(var, jax.extend.core.Literal) else flags.get(var, False)

    for eqn in jaxpr.eqns:
        ins = [flag(v) for v in eqn.invars]
        if not any(ins):
            outs = [False] * len(eqn.outvars)
        elif eqn.primitive.name in _ELEMENTWISE and all(
            np.shape(v.aval) in ((), shape) for v in eqn.invars
        ):
            outs = [True] * len(eqn.outvars)
        elif eqn.primitive.name == "broadcast_in_dim" and tuple(eqn.params["shape"]) == tuple(
            np.shape(eqn.invars[0].aval)
        ):
            outs = [True]
        elif "jaxpr" in eqn.params or "call_jaxpr" in eqn.params:
            inner = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
            inner = getattr(inner, "jaxpr", inner)
            if len(inner.invars) != len(eqn.invars):
                raise _NotElementwise(eqn.primitive.name)
            outs = _elementwise_outputs(inner, ins, shape)
        else:
            raise _NotElementwise(eqn.primitive.name)
        for var, out in zip(eqn.outvars, outs):
            flags[var] = out
    return [flag(v) for v in jaxpr.outvars]


class _NotElementwise(Exception):
    pass


def _is_stacked(leaf: Any, layers: int | None) -> bool:
    shape = np.shape(leaf)
    return layers is not None and len(shape) >= 1 and shape[0] == layers


def check_elementwise(transform: optax.GradientTransformation, leaf: Any, path: str = "") -> None:
    """Raise a `ValueError` unless `transform`, traced on the one parameter `leaf`, computes
    each element of the update and of every state leaf of the parameter's shape from the
    same element of the gradient, the parameter and the state (scalars such as Adam's
    count may be shared), and every other state leaf is a scalar.

    That is what updating a stacked leaf one layer slice at a time needs: `adam`, `adamw`,
    `sgd`, `lion` pass; `scale_by_trust_ratio` (a norm over the leaf) and `adafactor`
    (factored moments) do not.
    """
    shape = tuple(np.shape(leaf))
    abstract = jax.ShapeDtypeStruct(shape, leaf.dtype)
    state = jax.eval_shape(transform.init, abstract)
    where = f" on `{path}`" if path else ""
    for state_leaf in jax.tree_util.tree_leaves(state):
        if np.shape(state_leaf) not in ((), shape):
            raise ValueError(
                f"{_NAME}: the per-leaf transformation{where} keeps a state leaf of shape "
                f"{np.shape(state_leaf)} for a parameter of shape {shape}, so it cannot be "
                "updated one layer slice at a time. Only state leaves shaped like the "
                "parameter, or scalars, can be streamed; pass `layers=None` to update "
                "stacked leaves whole."
            )

    def update(grad, state, param):
        return _update(transform, grad, state, param, {})

    closed = jax.make_jaxpr(update)(abstract, state, abstract)
    aligned = [True] + [np.shape(x) == shape for x in jax.tree_util.tree_leaves(state)] + [True]
    try:
        _elementwise_outputs(closed.jaxpr, aligned, shape)
    except _NotElementwise as error:
        raise ValueError(
            f"{_NAME}: the per-leaf transformation{where} is not elementwise: it applies "
            f"`{error.args[0]}` to the whole parameter, so updating one layer slice at a "
            "time would change its result. Pass `layers=None` to update stacked leaves "
            "whole, or use an elementwise transformation (adam, adamw, sgd, lion, ...)."
        ) from None


class SequentialOptimizer(NamedTuple):
    """What `sequential_offload_optimizer` returns: an optax `GradientTransformation`
    (`init`, `update`) with a third method, `update_and_apply(grads, state, params)`,
    returning `(new_params, new_state)` with the updates applied inside the same per-leaf
    (and per-layer) loop, so that host-resident parameters are never fetched whole."""

    init: Any
    update: Any
    update_and_apply: Any


def sequential_offload_optimizer(
    per_leaf: optax.GradientTransformation,
    *,
    global_transform: optax.GradientTransformation | None = None,
    memory: str = "pinned_host",
    check: bool = True,
    layers: int | None = None,
) -> SequentialOptimizer:
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
        update or state leaf depends on more than one parameter (see `check_per_leaf`),
        and, with `layers`, if it is not elementwise on a stacked leaf (`check_elementwise`).
    - `layers`: the number of layers of the model's stacked modules (those applied with
        `ox.scan`). Every parameter leaf whose leading dimension is `layers` is updated one
        layer slice at a time, in a `jax.lax.fori_loop` inside its `cond`, so only one
        layer's state, gradient and parameter are on the device at a time. `None`
        (default): every leaf is updated whole.

    **Returns:** a `SequentialOptimizer`: an optax `GradientTransformation` whose state is
    a `SequentialState` (one `per_leaf` state per array leaf) inside an
    `ox.OffloadedState`, whose updates and new parameters equal those of
    `optax.chain(global_transform, per_leaf)`, plus `update_and_apply(grads, state,
    params) -> (new_params, new_state)`, which is `update` followed by `ox.apply_updates`
    computed in the same per-leaf (per-layer) loop: prefer it when parameters live on the
    host. With `layers`, `update` returns the updates of host-resident stacked leaves in
    host memory (written over their gradients' buffers); `ox.apply_updates` takes them.
    Without `global_transform`, gradients are fetched inside each leaf's update (host-typed
    ones one layer at a time); a `global_transform` fetches all gradients first.
    """
    check_memory(memory, where=f"{_NAME}(memory=...)")
    wrapper = OffloadedState if memory == "pinned_host" else DeviceState
    if layers is not None and (not isinstance(layers, int) or layers < 1):
        raise ValueError(
            f"{_NAME}: `layers` is {layers!r}; pass the number of layers of the stacked "
            "modules (a positive int), or None to update every leaf whole."
        )
    has_global = global_transform is not None
    global_tx = optax.identity() if global_transform is None else global_transform

    def init_fn(params):
        params = eqx.filter(params, eqx.is_array)
        if check:
            check_per_leaf(per_leaf, params)
            checked = set()
            for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
                key = (np.shape(leaf), jnp.dtype(leaf.dtype))
                if _is_stacked(leaf, layers) and key not in checked:
                    check_elementwise(per_leaf, leaf, "params" + jax.tree_util.keystr(path))
                    checked.add(key)

        def init_on_device(params):
            params = jax.tree_util.tree_map(to_device, params)
            leaves = jax.tree_util.tree_leaves(params)
            return wrapper(
                SequentialState(
                    global_state=global_tx.init(params),
                    leaves=[per_leaf.init(leaf) for leaf in leaves],
                )
            )

        return init_in_place(init_on_device, params)

    def whole(grad, leaf_state, param, extra_args, apply):
        """One leaf's update (and, with `apply`, its new value), fetched whole."""
        host_mask = jax.tree_util.tree_map(is_host_typed, leaf_state)
        leaf_state = jax.tree_util.tree_map(to_device, leaf_state)
        device_param = to_device(param)
        update, new_state = _update(per_leaf, to_device(grad), leaf_state, device_param, extra_args)
        new_state = _like(host_mask, new_state)
        if apply:
            new_param = (device_param + update).astype(param.dtype)
            return (to_host(new_param) if is_host_typed(param) else new_param), new_state
        return update, new_state

    def streamed(grad, leaf_state, param, extra_args, apply):
        """One stacked leaf's update, one layer slice per iteration of a `fori_loop`.

        The loop carries the host (or device) arrays that receive the results: the new
        state leaves, and the new parameter (`apply`) or the updates (written over the
        gradient, whose slice `i` is read before it is overwritten). Scalar state leaves
        (Adam's count) are the same for every slice: each iteration recomputes them from
        the old ones, and the last iteration's are the new state's.
        """
        state_leaves, state_def = jax.tree_util.tree_flatten(leaf_state)
        sliced = [np.ndim(x) > 0 for x in state_leaves]
        update_shape = jax.eval_shape(
            lambda g, s, p: _update(per_leaf, g, s, p, extra_args)[0],
            _slice_shape(grad),
            jax.tree_util.tree_map(lambda x: _slice_shape(x) if np.ndim(x) else x, leaf_state),
            None if param is None else _slice_shape(param),
        )
        if apply:
            out = param
        elif update_shape.dtype == grad.dtype:
            out = grad
        else:  # the updates have another dtype than the gradients: a buffer of their own
            out = jnp.zeros(grad.shape, update_shape.dtype)
            out = to_host(out) if is_host_typed(grad) else out

        # Scalar leaves (the old ones, on the device) are shared by every slice.
        scalars_in = [x if s else to_device(x) for x, s in zip(state_leaves, sliced)]
        reuse = out is grad  # the updates overwrite the gradient: read it from the carry

        def body(i, carry):
            out, buffers, _ = carry
            g = to_device(_index(out if reuse else grad, i))
            p = None if param is None else to_device(_index(out if apply else param, i))
            old = iter(buffers)
            state = [
                to_device(_index(next(old), i)) if s else x for s, x in zip(sliced, scalars_in)
            ]
            update, new_state = cast(
                tuple[Any, Any],
                _update(per_leaf, g, jax.tree_util.tree_unflatten(state_def, state), p, extra_args),
            )
            new_leaves = jax.tree_util.tree_leaves(new_state)
            if apply:
                assert p is not None
                result = (p + update).astype(p.dtype)
            else:
                result = update.astype(out.dtype)
            out = _write(out, result, i)
            old = iter(buffers)
            buffers = [_write(next(old), x, i) for x, s in zip(new_leaves, sliced) if s]
            scalars = [x for x, s in zip(new_leaves, sliced) if not s]
            return out, buffers, scalars

        buffers = [x for x, s in zip(state_leaves, sliced) if s]
        scalars = [x for x, s in zip(scalars_in, sliced) if not s]
        out, buffers, scalars = jax.lax.fori_loop(
            0, np.shape(grad)[0], body, (out, buffers, scalars)
        )
        new_buffers, new_scalars = iter(buffers), iter(scalars)
        new_leaves = [
            next(new_buffers) if s else _like(is_host_typed(x), next(new_scalars))
            for x, s in zip(state_leaves, sliced)
        ]
        return out, jax.tree_util.tree_unflatten(state_def, new_leaves)

    def step(updates, state, params, extra_args, apply):
        inner = getattr(state, "inner", None)
        if not isinstance(state, (OffloadedState, DeviceState)) or not isinstance(
            inner, SequentialState
        ):
            raise TypeError(
                f"{_NAME}: the state is a {type(state).__name__}, not the state returned by "
                "this optimizer's `init`. Pass the state that `opt.init(params)` returned "
                "(and that the previous step returned)."
            )
        if apply and params is None:
            raise ValueError(
                f"{_NAME}: `update_and_apply` needs the parameters: call it as "
                "`update_and_apply(grads, state, params)`."
            )
        grads = eqx.filter(updates, eqx.is_array)
        if params is not None:
            params = eqx.filter(params, eqx.is_array)

        # 1. The global part, on all gradients at once (fetched to the device). Without a
        # global transformation the gradients stay where they are, fetched leaf by leaf.
        global_state = inner.global_state
        if has_global:
            grads = jax.tree_util.tree_map(to_device, grads)
            global_host = jax.tree_util.tree_map(is_host_typed, global_state)
            global_state = jax.tree_util.tree_map(to_device, global_state)
            device_params = None if params is None else jax.tree_util.tree_map(to_device, params)
            grads, global_state = _update(global_tx, grads, global_state, device_params, extra_args)
            global_state = _like(global_host, global_state)

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
        outs, new_states = [], []
        for grad, leaf_state, param in zip(grad_leaves, inner.leaves, param_leaves):
            compute = streamed if _is_stacked(grad, layers) else whole

            def run(grad, leaf_state, param, compute=compute):
                out, new_state = compute(grad, leaf_state, param, extra_args, apply)
                # A device value computed after the leaf's update, for the next gate (the
                # results may all be host-typed); opaque, so not folded to a constant.
                done, _ = jax.lax.optimization_barrier((jnp.asarray(True), (out, new_state)))
                return out, new_state, done

            out_shape = jax.eval_shape(run, grad, leaf_state, param)

            host_out = compute is streamed and not apply and is_host_typed(grad)

            def skip(grad, leaf_state, param, out_shape=out_shape, host_out=host_out):
                # Never taken (the predicate is always true); same types as `run`.
                out = param if apply else _zeros_like(out_shape[0])
                out = to_host(out) if host_out else out
                return out, leaf_state, jnp.asarray(False)

            if compute is streamed:
                # The loop is one instruction to the scheduler already: the copies in
                # its body depend on the iteration, so none can be hoisted out. Outside
                # a `cond` the loop updates the (donated) host buffers in place; inside
                # one, XLA copies each carried host array first (3 x the leaf in host
                # temp for Adam with `update_and_apply`).
                out, new_state, done = run(grad, leaf_state, param)
            else:
                out, new_state, done = jax.lax.cond(
                    _gate(token), run, skip, grad, leaf_state, param
                )
            token = done
            outs.append(out)
            new_states.append(new_state)
        new_inner = type(state)(SequentialState(global_state=global_state, leaves=new_states))
        return jax.tree_util.tree_unflatten(treedef, outs), new_inner

    class _Update:
        def __call__(self, updates, state, params=None, **extra_args):
            return step(updates, state, params, extra_args, apply=False)

    def update_and_apply(grads, state, params, **extra_args):
        """`update` then `ox.apply_updates`, in one per-leaf (per-layer) loop: returns
        `(new_params, new_state)`, where `new_params` is `params` with every array leaf
        updated and every other leaf unchanged."""
        new_arrays, new_state = step(grads, state, params, extra_args, apply=True)
        return eqx.combine(new_arrays, params), new_state

    return SequentialOptimizer(init_fn, _Update(), update_and_apply)


def _like(host_mask: Any, tree: Any) -> Any:
    return jax.tree_util.tree_map(
        lambda was_host, x: to_host(x) if was_host else x, host_mask, tree
    )


def _slice_shape(x: Any) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(np.shape(x)[1:], x.dtype)


def _index(x: jax.Array, i: Any) -> jax.Array:
    return jax.lax.dynamic_index_in_dim(x, i, keepdims=False)


def _write(buffer: jax.Array, value: jax.Array, i: Any) -> jax.Array:
    """Write `value` (on the device) as slice `i` of `buffer`, sending it to host memory
    first when `buffer` is host-typed (XLA then updates the host buffer in place)."""
    value = to_host(value) if is_host_typed(buffer) else to_device(value)
    return jax.lax.dynamic_update_index_in_dim(buffer, value.astype(buffer.dtype), i, 0)


def _zeros_like(shape: Any) -> Any:
    return jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), shape)
