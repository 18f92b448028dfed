"""Optimizer state in host memory: `ox.offload_optimizer`, `ox.update_and_apply` and
`ox.apply_updates`.

The state of any optax `GradientTransformation` lives in pinned host memory between
steps (its scalars, such as Adam's step count, stay on the device), sharded like the
parameter each leaf mirrors. `stream=None` updates one parameter's group at a time,
large ones in slices (`whole_slices`); `stream="leaf"` and `stream="layer"` fetch one
parameter (one layer slice) at a time (see `stream`).
"""

from typing import Any, cast

import equinox as eqx
import jax
import jax.numpy as jnp
import optax

from .._arrays.place import check_not_deleted
from .._declare.placement import UPDATES, check_memory
from .._sharding.memory_space import is_host_typed, to_host
from .._trace.state import active_plan
from .delayed import DELAYS, Delayed, delayed
from .host import HostUpdate, apply_on_host, combine_results
from .masters import check_master_dtype, with_masters
from .state import (
    NAME,
    call_update,
    check_matches,
    check_ours,
    declared_update,
    eval_shape,
    host_mask,
    init_in_place,
    on_device,
    restore_memory,
    shapes,
    state_type,
    trainable,
)
from .stream import StreamedUpdate, stream_init
from .whole_slices import apply_in_slices, in_slices_applies, update_in_slices

STREAMS = (None, "leaf", "layer")

_A_FACTORY = (
    "{where} is {value!r}, a function that builds a transformation, not a transformation. "
    "Call it with its hyperparameters: `ox.offload_optimizer(optax.adam(1e-3))`, not "
    "`ox.offload_optimizer(optax.adam)`."
)

_NOT_A_TRANSFORMATION = (
    "{where} is {value!r} (a {kind}); expected an `optax.GradientTransformation`, such as "
    "`optax.adam(1e-3)` or `optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3))`."
)


def _as_transformation(value: Any) -> Any:
    make = getattr(value, "gradient_transformation", None)
    if not isinstance(value, optax.GradientTransformation) and callable(make):
        return make()
    return value


def _check_transformation(value: object, *, where: str) -> None:
    if isinstance(value, optax.GradientTransformation):
        return
    template = _A_FACTORY if callable(value) else _NOT_A_TRANSFORMATION
    raise TypeError(template.format(where=where, value=value, kind=type(value).__name__))


def _check_update_on(update_on, stream, memory) -> None:
    if update_on not in UPDATES:
        raise ValueError(
            f"{NAME}(update_on=...) is {update_on!r}; expected 'device' (fetch the state, "
            "update on the accelerator) or 'host' (update in host memory on the host: "
            "only gradients and updates cross the link)."
        )
    if update_on != "host":
        return
    if stream is not None:
        raise ValueError(
            f"{NAME}(update_on='host', stream={stream!r}): a stream fetches the state to "
            "the device piece by piece; an update on the host never fetches it. Drop "
            "`stream` (or use `update_on='device'` to stream)."
        )
    if memory != "pinned_host":
        raise ValueError(
            f"{NAME}(update_on='host', memory={memory!r}): the host update keeps the "
            "state in host memory. Drop `memory` (it is 'pinned_host'), or use "
            "`update_on='device'` for a state on the device."
        )


def _check_delay(delay, stream) -> None:
    if isinstance(delay, bool) or delay not in DELAYS:
        raise ValueError(
            f"{NAME}(delay=...) is {delay!r}; expected 0 (each step applies its own "
            "gradients) or 1 (each step applies the previous step's gradients, so that "
            "an update on the host overlaps the forward and backward passes)."
        )
    if delay and stream is not None:
        raise ValueError(
            f"{NAME}(delay={delay}, stream={stream!r}): the delayed update applies the "
            "whole pending gradient in one update; a stream fetches the state piece by "
            "piece after the backward pass. Drop `stream` (and use `update_on='host'` "
            "to overlap the update with the step), or drop `delay`."
        )


def _check_options(tx, stream, global_transform, layers, memory, check) -> None:
    """Every option, when the optimizer is built (not at `init`, not while tracing)."""
    _check_transformation(tx, where=f"{NAME}'s `tx`")
    if global_transform is not None:
        _check_transformation(global_transform, where=f"{NAME}(global_transform=...)")
    if stream not in STREAMS:
        raise ValueError(
            f"{NAME}(stream=...) is {stream!r}; expected one of None (fetch the whole state "
            "for the update), 'leaf' (one parameter's state at a time) or 'layer' (one "
            "layer slice of each stacked parameter at a time, with `layers=`)."
        )
    if stream == "layer":
        if isinstance(layers, bool) or not isinstance(layers, int) or layers < 1:
            raise ValueError(
                f"{NAME}(stream='layer') needs `layers`, the number of layers of the "
                f"stacked modules applied with `ox.scan` (a positive int); got {layers!r}. "
                "Pass e.g. `layers=32`, or `stream='leaf'` to update stacked leaves whole."
            )
    elif layers is not None:
        raise ValueError(
            f"{NAME}(layers={layers!r}) is only used with `stream='layer'` (got "
            f"`stream={stream!r}`). Pass `stream='layer'` to stream stacked leaves one layer "
            "at a time, or drop `layers`."
        )
    check_memory(memory, where=f"{NAME}(memory=...)")
    if not isinstance(check, bool):
        raise TypeError(f"{NAME}(check=...) is {check!r}; expected True or False.")


def update_location(state: Any) -> str:
    """Where the update of `state` runs: as the strategy in force says, else as the state
    was declared (`update_on=`)."""
    declared = declared_update(state)
    plan = active_plan()
    return declared if plan is None else plan.strategy.update_of(declared)


def _whole_state(
    inner: optax.GradientTransformation, memory: str, update_on: str
) -> tuple[Any, Any]:
    """`init` and `update` of `stream=None`: the whole state is fetched for the update,
    or the update runs on the host (`host`)."""
    wrapper = state_type(memory, update_on)

    def init_fn(params):
        def init_on_device(params):
            return wrapper(inner.init(on_device(params)))

        return init_in_place(init_on_device, trainable(params))

    def update_fn(updates, state, params=None, **extra_args):
        check_ours(state, streamed=False, name=NAME)
        updates = trainable(updates)
        check_matches(type(state)(eval_shape(inner.init, shapes(updates))), state, name=NAME)
        mask = host_mask(state.inner)
        if params is not None:
            params = trainable(params)
        # Large elementwise groups (one parameter's update) a slice at a time, where the
        # state lives; anything else whole, its operands fetched first.
        sliced = update_in_slices(inner, updates, state.inner, params, extra_args)
        if sliced is not None:
            new_updates, new_inner = sliced
            return new_updates, type(state)(restore_memory(mask, new_inner))
        # Fetched in this order (state, gradients, parameters): the audit lists transfers
        # in program order, and the README's table shows it.
        inner_state = on_device(state.inner)
        updates = on_device(updates)
        params = None if params is None else on_device(params)
        new_updates, new_inner = call_update(inner, updates, inner_state, params, extra_args)
        return new_updates, type(state)(restore_memory(mask, new_inner))

    return init_fn, HostUpdate(inner, update_fn, update_location)


# Hints are loose on purpose: the options are validated below with sentences that say
# what to write, and a runtime type checker (beartype in the tests) would answer first.
def offload_optimizer(
    tx: Any,
    *,
    update_on: str = "device",
    stream: str | None = None,
    global_transform: Any = None,
    layers: int | None = None,
    memory: str = "pinned_host",
    check: bool = True,
    delay: int = 0,
    master_dtype: Any = None,
) -> optax.GradientTransformationExtraArgs:
    """Wrap an optax transformation so that its state lives in `memory` between steps
    (and is updated where `update_on` says), unless the step's strategy places it.

    **Arguments:**

    - `tx`: an `optax.GradientTransformation` (`optax.adam(1e-3)`, `chain`, `adamw`,
        `inject_hyperparams`, `multi_transform`, ...) or an `optax.MultiSteps`. With a
        stream it must treat each parameter on its own (`adam`, `adamw`, `sgd`, `lion`,
        ...), which `init` checks.
    - `update_on`: where the update runs.
        - `"device"` (default): the state is fetched to the accelerator (see `stream`).
        - `"host"`: the whole update (`global_transform` included) is one host
          computation of the step: the state, all of it, stays in host memory and is
          never fetched; the gradients are sent to the host once, the updates come back
          once for parameters on the device (for host-resident parameters
          `ox.apply_updates` adds them on the host: only the gradients move). Targets
          that cannot run it (XLA:TPU) are refused when the step is compiled.

        A declaration, as `ox.field(memory=...)` is: the step's strategy has the last
        word. `ox.Strategy(update="host" | "device")` decides for every optimizer; a
        strategy that keeps the optimizer state on the device (`"baseline"`, `"remat"`,
        `"offload_activations"`, `"offload_params"`, `optimizer="device"`) updates on the
        device; any other (`"annotated"`, `"offload_optimizer"`, `"hybrid"`) as declared.
    - `stream`: how a device update fetches the state.
        - `None` (default): the update of `optax.chain(global_transform, tx)`, split
          into one group per parameter; an elementwise group over 8 MiB (Adam, SGD,
          ...) a slice at a time, where its state lives, the others fetched whole
          (a global transformation in the chain makes one group: the whole state at
          once). XLA orders the groups.
        - `"leaf"`: one parameter's state at a time, each in its own `jax.lax.cond`
          gated on the previous one's update.
        - `"layer"`: like `"leaf"`, and every parameter whose leading dimension is
          `layers` (the stacked modules applied with `ox.scan`) one layer slice at a time,
          in a `jax.lax.fori_loop`. `tx` must be elementwise (`init` checks).
    - `global_transform`: a transformation applied first, to all gradients at once on the
        device (`optax.clip_by_global_norm(1.0)`); its state is fetched whole.
    - `layers`: with `stream="layer"` (and only then), the number of layers.
    - `memory`: where the state is declared to live: `"pinned_host"` (default) or
        `"device"`. Strategies passed to `ox.filter_jit`/`ox.place` override it.
    - `check`: with a stream, trace `tx` at `init` and raise a `ValueError` if it couples
        parameters (or, with `"layer"`, is not elementwise).
    - `delay`: `0` (default) or `1`, ZeRO-Offload's delayed parameter update: each step
        applies the *previous* step's gradients (the first step applies none) and keeps
        its own, in the state, for the next. The update then reads nothing the step
        computes, so with `update_on="host"` it runs on the host while the device
        computes the forward and backward passes. Results differ from `delay=0` by
        exactly that staleness; `ox.apply_pending` applies the last gradients (before an
        evaluation, at the end of training). Not with a stream.
    - `master_dtype`: `None` (default: the parameters are what the optimizer updates) or
        a floating-point dtype, usually `jnp.float32`: mixed precision as large models
        train. The optimizer state keeps a master of every trained parameter in that
        dtype (in the state's memory: host by default, placed and sharded like the
        parameter), `tx` runs on the masters (its state is initialised on them, so
        Adam's moments are float32 unless `tx` says otherwise, e.g. `mu_dtype`), and each
        parameter is written from its new master in its own dtype. The gradients stay in
        the dtype the backward pass made: with `update_on="host"` a bfloat16 model moves
        4 bytes per parameter per step (gradient down, new parameter back) and no state.
        `opt.init(model)` widens the model's weights; `opt.init(model_in_float32)`,
        before casting the model, keeps the full-precision initial weights (with
        `delay=1` the pending gradients are then kept in float32 too). Use
        `ox.update_and_apply`, which writes each parameter from its master exactly;
        `opt.update` returns the difference in the parameter's dtype (rounded).

    Only floating-point array leaves are optimized: integer, boolean and non-array leaves
    get no state and a `None` update (`ox.apply_updates` leaves them unchanged). Python
    values in the transformation's own state (an int, a string its update branches on)
    are static, as under `ox.filter_jit`: they pass through `init` and `update` as they
    are, and only the state's arrays are placed.

    **Returns:** an `optax.GradientTransformationExtraArgs` whose `init(params)` writes the
    state into its memory, sharded like the parameters (scalars on the device), and whose
    `update(grads, state, params)` computes on the device, fetching host-typed gradients,
    state and parameters explicitly and sending the new state back. Its updates equal
    those of `optax.chain(global_transform, tx)` (bit for bit where the host kernel
    computes them, streams included; where XLA compiles a one-leaf update otherwise than
    the whole tree's, to about 1 ulp per step: the optimizer guide's "Exactness"). Use
    `ox.update_and_apply(opt, grads, state, params)` to apply the updates inside the
    streamed loop, so host-resident parameters are never fetched whole either.
    """
    # `optax.MultiSteps` (and the like) is a wrapper object whose transformation is built
    # by `.gradient_transformation()`; users pass the object itself.
    tx = _as_transformation(tx)
    global_transform = _as_transformation(global_transform)
    _check_options(tx, stream, global_transform, layers, memory, check)
    _check_update_on(update_on, stream, memory)
    _check_delay(delay, stream)
    master_dtype = check_master_dtype(master_dtype)
    if stream is None:
        inner = tx if global_transform is None else optax.chain(global_transform, tx)
        if master_dtype is not None:  # below the delay: the pending gradients stay narrow
            inner = with_masters(inner, master_dtype)
        if delay:
            inner = delayed(inner)
        init_fn, update_fn = _whole_state(inner, memory, update_on)
    else:
        leaf_tx = tx if master_dtype is None else with_masters(tx, master_dtype)
        init_fn = stream_init(leaf_tx, global_transform, layers, memory, check)
        update_fn = StreamedUpdate(leaf_tx, global_transform, layers, master_dtype)
    return optax.GradientTransformationExtraArgs(init_fn, cast(Any, update_fn))


_USE_OUTPUTS = (
    "Pass the step's outputs, which replace what it donated: after `model, opt_state, "
    "loss = step(model, opt_state, x)`, use the new `model` and `opt_state`."
)


def _check_live(caller: str, **trees: Any) -> None:
    """No array of `trees` was donated to a step before: else a `ValueError` naming the
    first leaf, before any work (XLA's own error names a buffer, not a leaf)."""
    for root, tree in trees.items():
        check_not_deleted(tree, root, caller, _USE_OUTPUTS)


def update_and_apply(
    opt: Any, grads: Any, opt_state: Any, params: Any, **extra_args: Any
) -> tuple[Any, Any]:
    """`opt.update` then `ox.apply_updates`: returns `(new_params, new_opt_state)`.

    Works for any optax transformation. When `opt` is a streamed `ox.offload_optimizer`
    (`stream="leaf"` or `"layer"`), the updates are applied inside its per-leaf
    (per-layer) loop, so host-resident parameters are fetched one leaf (layer) at a time
    and never whole. When the update runs on the host (`update_on="host"`, or a plan with
    `update="host"`), the update and the sum for host-resident parameters are one host
    computation, so their updates never pass through device memory. Wrapped in another
    transformation (`optax.chain(opt, ...)`), it falls back to `update` then
    `ox.apply_updates`, with the same result.
    """
    _check_transformation(opt, where="ox.update_and_apply's `opt`")
    _check_live("ox.update_and_apply", grads=grads, opt_state=opt_state, params=params)
    if isinstance(opt.update, StreamedUpdate):
        return opt.update.update_and_apply(grads, opt_state, params, **extra_args)
    if isinstance(opt.update, HostUpdate) and opt.update.on_host(opt_state):
        _check_updates(params, grads)
        new_host, others, opt_state = opt.update.update_and_apply(
            grads, opt_state, params, **extra_args
        )
        return combine_results(params, others, new_host, opt.update.writes_values), opt_state
    if isinstance(opt.update, HostUpdate) and in_slices_applies(opt.update.inner):
        _check_updates(params, grads)
        applied = apply_in_slices(opt.update.inner, grads, opt_state, params, extra_args)
        if applied is not None:
            return applied
    if isinstance(opt.update, HostUpdate) and opt.update.writes_values:
        _check_updates(params, grads)
        new_values, opt_state = opt.update.device_update_and_apply(
            grads, opt_state, params, **extra_args
        )
        return eqx.combine(new_values, params), opt_state  # each in its memory already
    if isinstance(opt, optax.GradientTransformationExtraArgs):
        updates, opt_state = opt.update(grads, opt_state, params, **extra_args)
    elif extra_args:
        raise TypeError(
            f"ox.update_and_apply: {sorted(extra_args)} were given, but `opt` is an "
            "`optax.GradientTransformation` without extra arguments. Drop them, or wrap "
            "`opt` with `optax.with_extra_args_support(opt)`."
        )
    else:
        updates, opt_state = opt.update(grads, opt_state, params)
    return apply_updates(params, updates), opt_state


def apply_pending(opt: Any, opt_state: Any, params: Any, **extra_args: Any) -> tuple[Any, Any]:
    """Apply the gradients a delayed optimizer (`ox.offload_optimizer(..., delay=1)`)
    holds: returns `(new_params, new_opt_state)` with nothing pending, so that the next
    step applies none (as the first step does). Call it where the parameters must
    include every gradient computed so far: before an evaluation, at the end of
    training. With nothing pending, the parameters and the state are returned unchanged.

    **Raises:** a `TypeError` for a state that is not a delayed optimizer's.
    """
    inner = getattr(opt_state, "inner", None)
    if not isinstance(inner, Delayed):
        raise TypeError(
            "ox.apply_pending: the optimizer state holds no pending gradients; it is the "
            f"state of {type(opt_state).__qualname__}. Only the state of "
            "`ox.offload_optimizer(..., delay=1)` has them."
        )
    new_params, new_state = update_and_apply(opt, inner.pending, opt_state, params, **extra_args)
    ready = new_state.inner.ready
    cleared = jnp.zeros((), dtype=ready.dtype)
    cleared = to_host(cleared) if is_host_typed(ready) else cleared
    return new_params, eqx.tree_at(lambda s: s.inner.ready, new_state, cleared)


def apply_updates(model: Any, updates: Any) -> Any:
    """`eqx.apply_updates` that keeps host-resident parameters on the host.

    A host-typed parameter with a host-typed update (`update_on="host"`) is updated by a
    host computation (one for all such leaves): nothing moves. A host-typed parameter
    with a device update is fetched explicitly, summed on the device and sent back. A
    parameter on the device gets its update fetched if that is host-typed. `None`
    updates leave the leaf unchanged, as in `eqx.apply_updates`.

    **Returns:** the updated model, each parameter in the memory it had. **Raises:** an
    error naming the leaf paths when `updates` were made for another model.
    """
    _check_live("ox.apply_updates", model=model, updates=updates)
    _check_updates(model, updates)
    return combine_results(model, updates, apply_on_host(model, updates))


_OTHER_UPDATES = (
    "ox.apply_updates(model, updates): {problem}, so the updates were made for another "
    "model. Pass the updates that `opt.update(grads, opt_state, model)` returned for "
    "gradients of this model (`eqx.filter_grad(loss)(model, ...)`)."
)


def _check_updates(model: Any, updates: Any) -> None:
    """The updates have the model's structure and each array leaf's shape."""
    is_none = lambda x: x is None  # noqa: E731
    model_leaves = jax.tree_util.tree_flatten_with_path(model, is_leaf=is_none)[0]
    update_leaves, update_def = jax.tree_util.tree_flatten_with_path(updates, is_leaf=is_none)
    if update_def != jax.tree_util.tree_structure(model, is_leaf=is_none):
        where = _first_difference(updates, model, ())
        raise ValueError(
            _OTHER_UPDATES.format(
                problem=f"`updates{where}` and `model{where}` differ in structure "
                "(other fields, static values or containers)"
            )
        )
    for (path, update), (_, param) in zip(update_leaves, model_leaves):
        if update is None or not hasattr(update, "shape") or not hasattr(param, "shape"):
            continue
        if tuple(update.shape) != tuple(param.shape):
            key = jax.tree_util.keystr(path)
            raise ValueError(
                _OTHER_UPDATES.format(
                    problem=f"`updates{key}` has shape {tuple(update.shape)} but "
                    f"`model{key}` has shape {tuple(param.shape)}"
                )
            )


def _first_difference(a: Any, b: Any, path: tuple) -> str:
    """The key path of the first node at which two pytrees differ in structure."""
    is_none = lambda x: x is None  # noqa: E731
    one_level = lambda x: jax.tree_util.tree_flatten_with_path(  # noqa: E731
        x, is_leaf=lambda y: y is not x or y is None
    )
    a_children, a_def = one_level(a)
    b_children, b_def = one_level(b)
    if a_def == b_def:
        for (key, x), (_, y) in zip(a_children, b_children):
            same = jax.tree_util.tree_structure(x, is_leaf=is_none) == (
                jax.tree_util.tree_structure(y, is_leaf=is_none)
            )
            if not same and x is not a:
                return _first_difference(x, y, path + tuple(key))
    return jax.tree_util.keystr(path)
