"""The state of `ox.offload_optimizer`: its types, where `init` writes it, and the checks
that a state passed to `update` is this optimizer's state for these parameters."""

from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import numpy as np
import optax
from jax.core import Tracer

from .._declare.placement import Placement
from .._host.compute import on_host_if_cheap
from .._plan.of_trees import state_plan
from .._plan.walk import is_array_leaf
from .._sharding.memory_space import is_host_typed, to_device, to_host
from .._trace.state import active_plan

NAME = "ox.offload_optimizer"

_METADATA_HOST = {"offload_eqx": Placement(memory="pinned_host", role="optimizer")}
_METADATA_DEVICE = {"offload_eqx": Placement(memory="device", role="optimizer")}
_METADATA_HOST_UPDATE = {
    "offload_eqx": Placement(memory="pinned_host", role="optimizer", update="host")
}


class OffloadedState(eqx.Module):
    """The state of `ox.offload_optimizer`: the wrapped transformation's state, placed in
    `pinned_host` (its scalars on the device) under the model's own annotations."""

    inner: Any = eqx.field(metadata=_METADATA_HOST)


class DeviceState(eqx.Module):
    """Like `OffloadedState`, declared `"device"`: strategies may still offload it."""

    inner: Any = eqx.field(metadata=_METADATA_DEVICE)


class HostUpdatedState(eqx.Module):
    """The state of `ox.offload_optimizer(update_on="host")`: all of it (scalars too) in
    `pinned_host`, read and written by the host computation and never fetched, under
    every strategy that leaves the update where it is declared (`Strategy.update_of`:
    not one that keeps the optimizer state on the device)."""

    inner: Any = eqx.field(metadata=_METADATA_HOST_UPDATE)


STATE_TYPES = (OffloadedState, DeviceState, HostUpdatedState)


def declared_update(state: Any) -> str:
    """Where the update of `state` is declared to run: `"host"` or `"device"`."""
    return "host" if isinstance(state, HostUpdatedState) else "device"


class StreamState(eqx.Module):
    """The inner state of a streamed `ox.offload_optimizer` (`stream="leaf"`/`"layer"`).

    `global_state` is `global_transform`'s state (for all parameters); `leaves` has the
    parameters' structure with one state of the per-leaf transformation in place of each
    parameter, so that a state leaf's key path names its parameter
    (`inner.leaves.layers.w1[0].mu`) and the plan shards it like that parameter.
    """

    global_state: Any
    leaves: Any


def state_type(
    memory: str, update: str = "device"
) -> type[OffloadedState] | type[DeviceState] | type[HostUpdatedState]:
    if update == "host":
        return HostUpdatedState
    return OffloadedState if memory == "pinned_host" else DeviceState


def trainable(tree: Any) -> Any:
    """The leaves an optimizer updates: floating-point arrays. Integer, boolean and other
    leaves become None (no state, no update), as with `eqx.filter(model,
    eqx.is_inexact_array)` before `optax` in Equinox's own examples."""
    return eqx.filter(tree, eqx.is_inexact_array)


def shapes(tree: Any) -> Any:
    """Shapes and dtypes only (no memory space, no sharding), to ask what `init` gives."""
    return jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), tree)


def on_device(tree: Any) -> Any:
    return jax.tree_util.tree_map(to_device, tree)


def host_mask(tree: Any) -> Any:
    return jax.tree_util.tree_map(is_host_typed, tree)


def restore_memory(mask: Any, tree: Any) -> Any:
    """Send back to host memory the leaves of `tree` whose old values were host-typed."""
    return jax.tree_util.tree_map(lambda was_host, x: to_host(x) if was_host else x, mask, tree)


def call_update(
    transform: optax.GradientTransformation, updates: Any, state: Any, params: Any, extra: dict
) -> Any:
    if isinstance(transform, optax.GradientTransformationExtraArgs):
        return transform.update(updates, state, params, **extra)
    return transform.update(updates, state, params)


# -- Python values in a state -------------------------------------------------------------
# A transformation's state may hold Python values (an int, a string its update branches
# on). They are static, as any non-array leaf under `ox.filter_jit`: they cross none of
# JAX's boundaries (a jit's results, a `cond`'s or a loop's operands and results), which
# only its arrays cross; the values themselves pass through as they are.

_VALUE_CHANGES = (
    "{name}: `{path}` is the Python value {new!r} after an update and {old!r} "
    "{without}. Which of the two a step returns is decided at run "
    "time, so a value that an update changes must be an array: make it one in `init` "
    "(`jnp.asarray({old!r})`), or keep the value fixed."
)


def eval_shape(fn: Callable[..., Any], *args: Any) -> Any:
    """`jax.eval_shape` for trees holding Python values too (passed in and returned as
    they are)."""
    return eqx.filter_eval_shape(fn, *args)


def cond(
    pred: Any,
    true_fn: Callable,
    false_fn: Callable,
    *operands: Any,
    without: str | None,
    labels: tuple[str, ...] = (),
) -> Any:
    """`jax.lax.cond` whose operands and results may hold Python values, which must be
    the same whichever branch runs. For the error naming a value that differs:
    `without` says what the false branch is, `labels` names each of the results.
    `without=None`: the false branch is never taken, and the true branch's values are
    the results' (unchecked)."""
    arrays, values = eqx.partition(operands, eqx.is_array)
    results: list = []

    def branch(fn: Callable) -> Callable:
        def run(arrays: Any) -> Any:
            out_arrays, out_values = eqx.partition(fn(*eqx.combine(arrays, values)), eqx.is_array)
            results.append(out_values)
            return out_arrays

        return run

    try:
        out = jax.lax.cond(pred, branch(true_fn), branch(false_fn), arrays)
        failure = None
    except TypeError as error:  # branches of other structures: values that differ?
        failure = error
    if without is not None and len(results) == 2:
        _check_same_values(*results, without=without, labels=labels)
    if failure is not None:
        raise failure
    return eqx.combine(out, results[0])


def _check_same_values(new: Any, old: Any, *, without: str, labels: tuple[str, ...]) -> None:
    is_none = lambda x: x is None  # noqa: E731
    new_leaves = jax.tree_util.tree_flatten_with_path(new, is_leaf=is_none)[0]
    old_leaves = jax.tree_util.tree_leaves(old, is_leaf=is_none)
    for (path, a), b in zip(new_leaves, old_leaves):
        if not (a is None and b is None) and (type(a) is not type(b) or a != b):
            where = labels[getattr(path[0], "idx", 0)] + jax.tree_util.keystr(path[1:])
            raise ValueError(
                _VALUE_CHANGES.format(name=NAME, path=where, new=a, old=b, without=without)
            )


# -- where the state lives ----------------------------------------------------------------


# State computed on the host may read at most this many bytes of the device (Adam's
# `zeros_like` reads none): beyond that, it is computed on the device and sent back.
HOST_INIT_LIMIT = 2**20


def init_in_place(init_on_device: Callable[[Any], Any], params: Any) -> Any:
    """Initialise optimizer state straight into its planned memory.

    The state that lives in host memory is computed there, in one host computation
    (Adam's moments are zeros: nothing of the parameters is read); a state that reads
    more of the device than `HOST_INIT_LIMIT` is computed on the device and sent back in
    the same program (`to_host`: an array that only `out_shardings` puts in host memory
    keeps a device type, and later traces would treat it as device memory). Either way
    the state is never all on the device at once. On a mesh, each leaf is sharded like
    the parameter it mirrors. Inside a trace (`ox.filter_jit(opt.init, strategy=...)`),
    the state is built where the step's strategy keeps it and the enclosing program
    returns it; outside, one jit builds it where the optimizer declares it.
    """
    abstract = eqx.filter_eval_shape(init_on_device, params)
    traced = any(isinstance(x, Tracer) for x in jax.tree_util.tree_leaves(params))
    plan = active_plan()
    strategy = plan.strategy if traced and plan is not None else None
    placement = state_plan(params, abstract, strategy, traced)
    memory_kinds = placement.memory_kinds(1)

    def init_placed(params):
        state = init_on_device(params)
        leaves, treedef = jax.tree_util.tree_flatten(state)
        # One flag per leaf: an array leaf in the memory the plan gives it, in leaf order.
        kinds = iter(memory_kinds)
        wanted = [is_array_leaf(x) and next(kinds) == "pinned_host" for x in leaves]
        on_host = None
        if any(wanted):
            dynamic, static = eqx.partition(params, eqx.is_array)
            operands = jax.tree_util.tree_leaves(dynamic)
            rebuild = jax.tree_util.tree_structure(dynamic)

            def selected(*flat):
                built = init_on_device(
                    eqx.combine(jax.tree_util.tree_unflatten(rebuild, flat), static)
                )
                return [x for x, w in zip(jax.tree_util.tree_leaves(built), wanted) if w]

            on_host = on_host_if_cheap(
                selected, operands, HOST_INIT_LIMIT, "optimizer init", flatten_transfers()
            )
        made = iter(on_host or [])
        placed = [
            (next(made) if on_host is not None else to_host(x)) if w else x
            for x, w in zip(leaves, wanted)
        ]
        return jax.tree_util.tree_unflatten(treedef, placed)

    if traced:
        return init_placed(params)
    # Only the array leaves come out of the jit: a transformation's state may hold Python
    # values (an int, a string its update branches on), which pass through as they are.
    # (`tree_shardings` is None at them, as `eqx.filter` leaves them.)
    others = eqx.filter(abstract, is_array_leaf, inverse=True)
    placed = jax.jit(
        lambda p: eqx.filter(init_placed(p), is_array_leaf),
        out_shardings=placement.tree_shardings(1),
    )
    return eqx.combine(placed(params), others)


def flatten_transfers() -> bool:
    """Whether arrays sent to a host computation may be flattened (see `_host.compute`):
    on one device, where a reshape cannot reshard."""
    plan = active_plan()
    return plan is None or plan.mesh is None or plan.mesh.size == 1


# -- is this our state, for these parameters? ----------------------------------------------

_NOT_OUR_STATE = (
    "{name}: the optimizer state is {what}, not the state returned by this optimizer's "
    "`init`. Pass the state that `opt.init(params)` returned (and that the previous step "
    "returned){hint}."
)

_OTHER_PARAMETERS = (
    "{name}: the optimizer state does not belong to these gradients: {detail}. It was "
    "initialised for other parameters (another model, or the model before a change of "
    "shape or structure). Initialise it for this model with `opt.init(model)`, or pass "
    "the state of this model."
)


def check_ours(state: Any, *, streamed: bool, name: str) -> None:
    """Raise a `TypeError` unless `state` is the state of an `ox.offload_optimizer` of
    this kind (streamed or not)."""
    if not isinstance(state, STATE_TYPES):
        what = f"a {type(state).__module__}.{type(state).__qualname__}"
        hint = (
            ", not the state of the optax transformation inside it"
            if isinstance(state, tuple)
            else ""
        )
        raise TypeError(_NOT_OUR_STATE.format(name=name, what=what, hint=hint))
    if streamed != isinstance(state.inner, StreamState):
        made = "a streamed" if isinstance(state.inner, StreamState) else "a whole-state"
        want = "a streamed (`stream='leaf'` or `'layer'`)" if streamed else "a whole-state"
        raise TypeError(
            _NOT_OUR_STATE.format(
                name=name,
                what=f"the state of {made} `ox.offload_optimizer`",
                hint=f"; this optimizer is {want} one, and their states differ",
            )
        )


def _paths(tree: Any) -> list[tuple[str, Any]]:
    return [
        (jax.tree_util.keystr(path), leaf)
        for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]
    ]


def check_matches(expected: Any, state: Any, *, name: str) -> None:
    """Raise a `ValueError` naming the first leaf at which `state` differs in structure or
    shape from `expected` (the abstract state `init` gives for the gradients at hand)."""
    want, got = _paths(expected), _paths(state)
    want_paths, got_paths = [p for p, _ in want], [p for p, _ in got]
    if want_paths != got_paths:
        missing = [p for p in want_paths if p not in set(got_paths)]
        extra = [p for p in got_paths if p not in set(want_paths)]
        if extra:
            detail = f"the state has a leaf `state{extra[0]}` that no gradient leaf accounts for"
        elif missing:
            detail = f"the state lacks `state{missing[0]}`, which these gradients need"
        else:
            detail = "the state's leaves are in another order than these gradients'"
        raise ValueError(_OTHER_PARAMETERS.format(name=name, detail=detail))
    for (path, wanted), (_, leaf) in zip(want, got):
        if np.shape(wanted) != np.shape(leaf):
            detail = (
                f"`state{path}` has shape {tuple(np.shape(leaf))}, but the gradients give "
                f"it shape {tuple(np.shape(wanted))}"
            )
            raise ValueError(_OTHER_PARAMETERS.format(name=name, detail=detail))


def is_none(x: Any) -> bool:
    """`is_leaf` for trees whose `None`s stand for leaves (no master, no update)."""
    return x is None
