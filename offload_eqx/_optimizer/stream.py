"""`ox.offload_optimizer(stream="leaf" | "layer")`: the state fetched one parameter (or
one layer of a stacked parameter) at a time.

Fetching the whole state at once (`stream=None` with a transformation that couples the
parameters, such as `clip_by_global_norm` in the chain) leaves the schedule to XLA,
which starts every host-to-device copy as early as its operands allow (right after the
gradients' global norm), so the whole state (Adam: twice the parameters) is on the
device at once, and the new state's device buffers stay live until their copies back at
the end of the step. Device temp *rises* (h100, the tutorial's DIM 7168: 1.53 -> 2.68
GiB). A stream takes the global part as `global_transform`, applied once, and streams
the rest. A weight whose update's results exceed `slices.SLICE_BYTES` (the rule of
`stream=None`'s slices too) and whose transformation is elementwise is updated in slices
of itself (`slices.weight_slices`), in the loop below.

`stream="leaf"` runs each parameter's update inside its own `jax.lax.cond`. The branch
fetches that parameter's state, updates it and sends the new state back to host memory;
the predicate of the next parameter's `cond` is an always-true value passed through an
`optimization_barrier` together with this parameter's update, so XLA can neither fold the
`cond` away nor start the next fetch early. A conditional is one instruction for the
scheduler: copies inside a branch cannot be hoisted out of it, and the branch's device
buffers die when it returns. At most one parameter's state (and its new state) is on the
device at a time. Chaining `optimization_barrier`s around plain `device_put`s did not
work: XLA splits the barriers per operand and still hoists every copy to the front.

Transformations that couple leaves (`optax.clip_by_global_norm`) go in `global_transform`,
applied once to all gradients on the device before the per-leaf part; `tx` is checked, by
tracing, to compute each parameter's update and state from that parameter alone.

Stacked parameters (the leaves of a module applied with `ox.scan`, with a leading layer
axis) are one leaf for all layers, so one `cond` would still fetch every layer's state.
With `stream="layer"` and `layers=L`, each leaf whose leading dimension is `L` is updated
by a `jax.lax.fori_loop` over that axis: an iteration dynamic-slices layer `i` of the
state (and of the gradient and the parameter, host-typed when the parameter lives on the
host), fetches the slices, runs `tx` on them and writes the new state slices back with
`dynamic_update_slice` into the host arrays carried by the loop (XLA updates them in
place). Only one layer's state, gradient and parameter are on the device at a time. This
is valid for transformations elementwise within a leaf (`adam`, `adamw`, `sgd`), which
`init` checks; scalars of the state (Adam's count) are shared by all slices. The streamed
`ox.update_and_apply` applies the updates in the same loop, so the parameters are never
fetched whole either. With masters, the host kernel's call for one leaf (or slice) rounds
as the whole tree's update does (`fused_adamw.as_whole_update`): a stream's masters are
the whole update's, bit for bit.
"""

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

from .._declare.strategy import HOST_UPDATES
from .._sharding.memory_space import is_host_typed, to_device, to_host
from .._trace.state import active_plan
from .checks import check_elementwise, check_per_leaf, is_stacked
from .fused_adamw import as_whole_update, clips_first
from .host import HostUpdate, combine_results
from .masters import step_values, value_writer
from .slices import Slices, layer_slices, sharded_axes, sharded_like_its_leaf, weight_slices, write
from .state import (
    NAME,
    StreamState,
    call_update,
    check_matches,
    check_ours,
    cond,
    eval_shape,
    host_mask,
    init_in_place,
    on_device,
    restore_memory,
    shapes,
    state_type,
    trainable,
)
from .whole_leaves import whole_leaves


def _gate(token: Any) -> jax.Array:
    """`True`, available only once `token` is computed, and opaque to XLA's simplifier
    (a literal predicate would let it inline the `cond` and hoist the copies again)."""
    pred, _ = jax.lax.optimization_barrier((jnp.asarray(True), token))
    return pred


def _device_leaves(leaves: list) -> list:
    return [x for x in leaves if eqx.is_array(x) and not is_host_typed(x)]


def _zeros_like(shape: Any) -> Any:
    return jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), shape)


class StreamedUpdate:
    """The `update` of a streamed `ox.offload_optimizer`. `ox.update_and_apply` finds
    `update_and_apply` on it, so the streamed apply survives as long as the optimizer is
    ours (under `optax.chain(...)` it falls back to `update` then `ox.apply_updates`)."""

    def __init__(
        self,
        tx: optax.GradientTransformation,
        global_transform: optax.GradientTransformation | None,
        layers: int | None,
        master_dtype: Any = None,
    ):
        self.tx = tx
        self.global_transform = global_transform
        self.global_tx = optax.identity() if global_transform is None else global_transform
        self.layers = layers
        self.master_dtype = master_dtype
        self._checked: dict[tuple, bool] = {}  # (shape, dtype) -> elementwise

    def _global_update(self, grads, global_state, params, extra_args):
        """`global_transform` on all gradients at once; with masters, on the gradients
        widened to the masters' dtype (as the whole-state optimizer computes it)."""
        if self.master_dtype is not None and self.global_transform is not None:
            grads = jax.tree_util.tree_map(lambda g: g.astype(self.master_dtype), grads)
        return call_update(self.global_tx, grads, global_state, params, extra_args)

    def __call__(self, updates: Any, state: Any, params: Any = None, **extra_args: Any) -> Any:
        return self._step(updates, state, params, extra_args, apply=False)

    def update_and_apply(self, grads: Any, state: Any, params: Any, **extra_args: Any) -> Any:
        """`update` then `ox.apply_updates`, in one per-leaf (per-layer) loop: returns
        `(new_params, new_state)`, where `new_params` is `params` with every floating-point
        array leaf updated and every other leaf unchanged."""
        new_arrays, new_state = self._step(grads, state, params, extra_args, apply=True)
        return eqx.combine(new_arrays, params), new_state

    # -- one leaf ------------------------------------------------------------------------

    def _whole(self, grad, leaf_state, param, extra_args, apply):
        """One leaf's update (and, with `apply`, its new value), fetched whole."""
        mask = host_mask(leaf_state)
        # Masters write the new value: the parameter's dtype is all they read of it.
        writes = apply and value_writer(self.tx) is not None
        device_param = param if writes else to_device(param)
        operands = (to_device(grad), on_device(leaf_state), device_param, extra_args)
        if apply:
            new_param, new_state = step_values(self.tx, *operands)
            new_state = restore_memory(mask, new_state)
            return (to_host(new_param) if is_host_typed(param) else new_param), new_state
        update, new_state = call_update(self.tx, *operands)
        return update, restore_memory(mask, new_state)

    def _streamed(self, grad, leaf_state, param, extra_args, apply, slices):
        """One leaf's update, one slice (`slices`: a layer of a stacked leaf, or a slice
        of one weight) per iteration of a `fori_loop`.

        The loop carries the host (or device) arrays that receive the results: the new
        state leaves, and the new parameter (`apply`) or the updates (written over the
        gradient where it is, whose slice `i` is read before it is overwritten: a
        host-resident weight's update stays in host memory, where `ox.apply_updates`
        adds it). Scalar state leaves
        (Adam's count) are the same for every slice: each iteration recomputes them from
        the old ones, and the last iteration's are the new state's.
        """
        tx = self.tx
        state_leaves, state_def = jax.tree_util.tree_flatten(leaf_state)
        # Python values (an int, a string) are not carried: every iteration reads the old
        # ones and computes the same new ones, which the trace of the body records.
        value = [not eqx.is_array(x) for x in state_leaves]
        sliced = [not v and np.ndim(x) > 0 for x, v in zip(state_leaves, value)]
        update_shape = eval_shape(
            lambda g, s, p: call_update(tx, g, s, p, extra_args)[0],
            slices.shape(grad),
            jax.tree_util.tree_map(
                lambda x: slices.shape(x) if eqx.is_array(x) and np.ndim(x) else x, leaf_state
            ),
            None if param is None else slices.shape(param),
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
        writes = apply and value_writer(tx) is not None
        new_values: list = []

        def body(i, carry):
            out, buffers, _ = carry
            g = to_device(slices.read(out if reuse else grad, i))
            if param is None:
                p = None
            elif writes:  # masters write the new slice: its dtype is all they read of it
                p = slices.shape(param)
            else:
                p = to_device(slices.read(out if apply else param, i))
            old = iter(buffers)
            state = [
                to_device(slices.read(next(old), i)) if s else x for s, x in zip(sliced, scalars_in)
            ]
            old_state = jax.tree_util.tree_unflatten(state_def, state)
            if apply:  # the new slice of the parameter
                result, new_state = step_values(tx, g, old_state, p, extra_args)
            else:
                update, new_state = call_update(tx, g, old_state, p, extra_args)
                result = update.astype(out.dtype)
            new_leaves = jax.tree_util.tree_leaves(new_state)
            out = write(slices, out, result, i)
            old = iter(buffers)
            buffers = [write(slices, next(old), x, i) for x, s in zip(new_leaves, sliced) if s]
            scalars = [x for x, s, v in zip(new_leaves, sliced, value) if not (s or v)]
            new_values[:] = [x for x, v in zip(new_leaves, value) if v]
            return out, buffers, scalars

        buffers = [x for x, s in zip(state_leaves, sliced) if s]
        scalars = [x for x, s, v in zip(scalars_in, sliced, value) if not (s or v)]
        out, buffers, scalars = jax.lax.fori_loop(0, slices.count, body, (out, buffers, scalars))
        new_buffers, new_scalars, values = iter(buffers), iter(scalars), iter(new_values)
        new_leaves = [
            next(new_buffers)
            if s
            else next(values)
            if v
            else restore_memory(is_host_typed(x), next(new_scalars))
            for x, s, v in zip(state_leaves, sliced, value)
        ]
        return out, jax.tree_util.tree_unflatten(state_def, new_leaves)

    # -- all leaves ------------------------------------------------------------------------

    def _expected_state(self, grads: Any) -> Any:
        return eval_shape(
            lambda g: StreamState(
                global_state=self.global_tx.init(g),
                leaves=jax.tree_util.tree_map(self.tx.init, g),
            ),
            shapes(grads),
        )

    def _whole_leaves(self) -> optax.GradientTransformationExtraArgs:
        """This optimizer on whole leaves: the global part, then `tx` on each leaf at
        once. `tx` is elementwise within a leaf (checked by `init`), so this equals the
        per-layer loop; it is what the host update computes (nothing to fetch there)."""
        return whole_leaves(self.tx, self.global_tx, self._global_update)

    def _on_host(self, grads, state, params, extra_args, apply):
        """Under a strategy with `update="host"`: the whole update in one host
        computation (`host.HostUpdate`), as `update_on="host"` does; with
        `apply`, the sum for host-resident parameters in the same computation and the
        updates of the others fetched and added on the device."""
        update = plan.strategy.update if (plan := active_plan()) is not None else "host"
        host = HostUpdate(self._whole_leaves(), None, lambda _: update, streamed=True)
        if not apply:
            return host(grads, state, params, **extra_args)
        new_host, others, new_state = host.update_and_apply(grads, state, params, **extra_args)

        arrays = combine_results(trainable(params), others, new_host, host.writes_values)
        return arrays, new_state

    def _step(self, updates, state, params, extra_args, apply):
        check_ours(state, streamed=True, name=NAME)
        plan = active_plan()
        if plan is not None and plan.strategy.update in HOST_UPDATES:
            return self._on_host(updates, state, params, extra_args, apply)
        if apply and params is None:
            raise ValueError(
                f"{NAME}: `ox.update_and_apply` needs the parameters: call it as "
                "`ox.update_and_apply(opt, grads, opt_state, params)`."
            )
        grads = trainable(updates)
        check_matches(type(state)(self._expected_state(grads)), state, name=NAME)
        inner = state.inner
        if params is not None:
            params = trainable(params)

        # 1. The global part, on all gradients at once (fetched to the device). Without a
        # global transformation the gradients stay where they are, fetched leaf by leaf.
        global_state = inner.global_state
        if self.global_transform is not None:
            grads = on_device(grads)
            mask = host_mask(global_state)
            device_params = None if params is None else on_device(params)
            grads, global_state = self._global_update(
                grads, on_device(global_state), device_params, extra_args
            )
            global_state = restore_memory(mask, global_state)

        # 2. The per-leaf part, one `cond` (or loop) per leaf, each gated on the previous.
        grad_leaves, treedef = jax.tree_util.tree_flatten(grads)
        leaf_states = treedef.flatten_up_to(inner.leaves)
        if params is None:
            param_leaves = [None] * len(grad_leaves)
        elif jax.tree_util.tree_structure(params) != treedef:
            raise ValueError(
                f"{NAME}: the parameters passed to `update` do not have the structure of "
                f"the gradients ({jax.tree_util.tree_structure(params)} against {treedef}). "
                "Pass the parameters that were differentiated."
            )
        else:
            param_leaves = jax.tree_util.tree_leaves(params)
        token: Any = _device_leaves(grad_leaves)
        outs, new_states = [], []
        leaves = sum(1 for g in grad_leaves if np.size(g))
        with as_whole_update(leaves, self._clipped()):
            for grad, leaf_state, param in zip(grad_leaves, leaf_states, param_leaves):
                out, new_state, token = self._one_leaf(
                    grad, leaf_state, param, extra_args, apply, token
                )
                outs.append(out)
                new_states.append(new_state)
        new_inner = StreamState(
            global_state=global_state, leaves=jax.tree_util.tree_unflatten(treedef, new_states)
        )
        return jax.tree_util.tree_unflatten(treedef, outs), type(state)(new_inner)

    def _clipped(self) -> bool:
        """Whether the whole update, `optax.chain(global_transform, tx)`, clips the
        gradients inside its moments' loop (the host kernel's form of it)."""
        writer = value_writer(self.tx)
        tx = self.tx if writer is None else writer.tx
        return self.global_transform is not None and clips_first(self.global_transform, tx)

    def _slices(self, grad: Any, leaf_state: Any, param: Any) -> Slices | None:
        """How the loop cuts this leaf: by layer when stacked, in slices of the weight
        when it is large and `tx` is elementwise on it, else None (updated whole)."""
        if is_stacked(grad, self.layers):
            return layer_slices(np.shape(grad)[0])
        arrays = [x for x in jax.tree_util.tree_leaves(leaf_state) if eqx.is_array(x)]
        # The loop's results an element: the update (or the new value), at most as wide
        # as the widest operand, and each state leaf of the weight's shape.
        out = max(jnp.dtype(x.dtype).itemsize for x in [grad, *arrays])
        state = sum(jnp.dtype(x.dtype).itemsize for x in arrays if x.shape == grad.shape)
        sharded = sharded_axes(grad, leaf_state, param)
        cut = weight_slices(np.shape(grad), out + state, sharded)
        return cut if cut is not None and self._elementwise(grad) else None

    def _elementwise(self, grad: Any) -> bool:
        """Whether `tx` treats every element of a leaf like `grad` on its own (traced
        once per shape and dtype): only then may the leaf be updated a slice at a time."""
        key = (np.shape(grad), jnp.dtype(grad.dtype))
        if key not in self._checked:
            try:
                check_elementwise(self.tx, jax.ShapeDtypeStruct(*key))
                self._checked[key] = True
            except Exception:  # not elementwise, or not traceable alone: updated whole
                self._checked[key] = False
        return self._checked[key]

    def _one_leaf(self, grad, leaf_state, param, extra_args, apply, token):
        slices = self._slices(grad, leaf_state, param)
        if slices is not None:
            # Sliced where it is: a host-resident parameter's gradient in host memory (a
            # stream holds no whole gradient on the device; `stream=None` does).
            grad = sharded_like_its_leaf(grad, leaf_state, param)

        def run(grad, leaf_state, param):
            if slices is None:
                out, new_state = self._whole(grad, leaf_state, param, extra_args, apply)
            else:
                out, new_state = self._streamed(grad, leaf_state, param, extra_args, apply, slices)
            # A device value computed after the leaf's update, for the next gate (the
            # results may all be host-typed); opaque, so not folded to a constant.
            computed = eqx.filter((out, new_state), eqx.is_array)  # not its Python values
            done, _ = jax.lax.optimization_barrier((jnp.asarray(True), computed))
            return out, new_state, done

        if slices is not None:
            # The loop is one instruction to the scheduler already: the copies in its
            # body depend on the iteration, so none can be hoisted out. Outside a `cond`
            # the loop updates the (donated) host buffers in place; inside one, XLA
            # copies each carried host array first (3 x the leaf in host temp for Adam
            # with `update_and_apply`).
            return run(grad, leaf_state, param)

        out_shape = eval_shape(run, grad, leaf_state, param)

        def skip(grad, leaf_state, param):
            # Never taken (the predicate is always true); same types as `run`.
            out = param if apply else _zeros_like(out_shape[0])
            return out, leaf_state, jnp.asarray(False)

        return cond(_gate(token), run, skip, grad, leaf_state, param, without=None)


def stream_init(
    tx: optax.GradientTransformation,
    global_transform: optax.GradientTransformation | None,
    layers: int | None,
    memory: str,
    check: bool,
) -> Any:
    """The `init` of a streamed `ox.offload_optimizer`."""
    global_tx = optax.identity() if global_transform is None else global_transform
    wrapper = state_type(memory)

    def init_fn(params):
        params = trainable(params)
        if check:
            check_per_leaf(tx, params)
            checked = set()
            for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
                key = (np.shape(leaf), jnp.dtype(leaf.dtype))
                if is_stacked(leaf, layers) and key not in checked:
                    check_elementwise(tx, leaf, "params" + jax.tree_util.keystr(path))
                    checked.add(key)

        def init_on_device(params):
            params = on_device(params)
            return wrapper(
                StreamState(
                    global_state=global_tx.init(params),
                    leaves=jax.tree_util.tree_map(tx.init, params),
                )
            )

        return init_in_place(init_on_device, params)

    return init_fn
