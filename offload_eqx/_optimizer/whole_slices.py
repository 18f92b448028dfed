"""The device update of `stream=None`, one parameter's group at a time, a large group in
slices.

Fetched whole, the update of an offloaded state holds on the device the fetched state,
the gradients, the fetched parameters and the new state beside them, until the new
state's copies to host memory end: XLA gives each result a buffer of its own. For Adam
on one 2048 x 2048 float32 weight in host memory that is six copies of the weight
(96.5 MiB for the step, deviceless h100) where keeping everything on the device updates
three in place (65.0 MiB).

Here the update is traced once on the whole tree (where the leaves' sizes allow a group
to be sliced: `_may_slice`; optax's own update: its results are the definition's) and
split as the host update is (`host_split.result_groups`): into groups of results that
read the same large operands, one parameter's gradient, state and value. A group that is
elementwise (`host_chunks`: Adam, AdamW, SGD, Lion are) and whose results exceed
`slices.SLICE_BYTES` (the one rule of the device update's slices, streams included) runs
in a `fori_loop` over slices of its flat element order (`_host.groups`, each piece on
the device): a trip fetches its slice of the state (and parameter), computes it, and
writes the new state's slice over the old one where it lives (host memory, in place: the
state is donated) and the update's slice over the gradient. The device then holds the
gradients, which the backward pass left there, and one slice. Other groups (a bias, a
transformation that is not elementwise) are computed whole, after their operands are
fetched; a transformation that couples all parameters (`clip_by_global_norm` in the
chain) makes one group, and the update stays whole. On a mesh of several devices it
stays whole too: a flat slice of a sharded leaf would gather it.
"""

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.core import eval_jaxpr

from .._host import groups
from .._host.calls import device_aval
from .._host.chunks import elements, slices_program
from .._sharding.memory_space import is_host_typed, to_device, to_host
from .._trace.state import active_plan
from . import slices
from .delayed import delayed_tx
from .masters import step_values, value_writer
from .state import (
    NAME,
    call_update,
    check_matches,
    check_ours,
    eval_shape,
    host_mask,
    on_device,
    restore_memory,
    shapes,
    trainable,
)


def _size(x: Any) -> int:
    """The number of elements of an array, a tracer or an abstract value."""
    return int(np.prod(getattr(x, "shape", np.shape(x)), dtype=np.int64))


def update_in_slices(
    inner: Any, grads: Any, state: Any, params: Any, extra: dict, apply: bool = False
) -> Any:
    """`call_update(inner, grads, state, params, extra)` with each large elementwise group
    computed in slices (see the module's docstring): `(updates, new state)`, the new
    state's sliced leaves written where the old ones live, a sliced update where its
    parameter lives (over the gradient on the device, or into host memory for a
    host-resident parameter, whose gradient is host-typed). With `apply`,
    `(new parameters, new state)`: `masters.step_values` in the same slices, each new
    slice written over the parameter where it lives. None where no group is sliced (the
    caller computes the update whole, as it did)."""
    plan = active_plan()
    if plan is not None and plan.mesh is not None and plan.mesh.size > 1:
        return None
    if not _may_slice(grads, state):
        return None  # decided from the sizes: no need to trace the update here
    arrays, values = eqx.partition(state, eqx.is_array)
    extra_arrays, extra_values = eqx.partition(extra, eqx.is_array)
    parts = [on_device(grads), arrays, params, extra_arrays]
    flat, defs = zip(*(jax.tree_util.tree_flatten(part) for part in parts))
    bounds = [int(b) for b in np.cumsum([0, *(len(f) for f in flat)])]
    out_defs: list = []

    def flat_update(*operands: Any) -> list:
        g, s, p, e = (
            jax.tree_util.tree_unflatten(d, operands[a:b])
            for d, a, b in zip(defs, bounds[:-1], bounds[1:])
        )
        e = eqx.combine(e, extra_values)
        if apply:  # the new values: from the masters where `inner` keeps them
            updates, new = step_values(inner, g, eqx.combine(s, values), p, e)
        else:
            updates, new = call_update(inner, g, eqx.combine(s, values), p, e)
        new_arrays, new_values = eqx.partition(new, eqx.is_array)
        leaves = [jax.tree_util.tree_flatten(t) for t in (updates, new_arrays)]
        out_defs[:] = [leaves[0][1], leaves[1][1], new_values]
        return [*leaves[0][0], *leaves[1][0]]

    operands = [x for f in flat for x in f]
    closed = jax.make_jaxpr(flat_update)(*[device_aval(x) for x in operands])
    update_def, state_def, new_values = out_defs
    if state_def != defs[1]:  # the new state's arrays do not mirror the old ones
        return None
    # Which operand each result may be written over: an update over its gradient, a new
    # state leaf over the old one.
    n_updates = update_def.num_leaves
    if n_updates != len(flat[0]):
        return None
    host = [is_host_typed(g) for g in jax.tree_util.tree_leaves(grads)]
    first = bounds[2] if apply else 0  # new values over the parameters, else updates
    slots = {j: first + j for j in range(n_updates) if apply or not host[j]}
    slots.update({n_updates + s: bounds[1] + s for s in range(len(flat[1]))})
    to_host_memory = {j for j in range(n_updates) if host[j] and not apply}
    outs = _grouped(closed, operands, slots, to_host_memory)
    if outs is None:
        return None
    updates = jax.tree_util.tree_unflatten(update_def, outs[:n_updates])
    new_arrays = jax.tree_util.tree_unflatten(state_def, outs[n_updates:])
    return updates, eqx.combine(new_arrays, new_values)


def _may_slice(grads: Any, state: Any) -> bool:
    """Whether some group's results may exceed `slices.SLICE_BYTES`, from the leaves' sizes alone
    (before the update is traced): a sliced group's results all have its gradient's
    number of elements, so they are at most the gradients and state leaves of that number
    of elements, an update counted at 8 bytes an element (the widest it can be)."""
    held: dict[int, int] = {}
    for g in jax.tree_util.tree_leaves(grads):
        held[_size(g)] = held.get(_size(g), 0) + 8 * _size(g)
    for x in jax.tree_util.tree_leaves(state):
        if eqx.is_array(x) and _size(x) in held:
            held[_size(x)] += _size(x) * jnp.dtype(x.dtype).itemsize
    return any(size > 1 and nbytes > slices.SLICE_BYTES for size, nbytes in held.items())


def in_slices_applies(inner: Any) -> bool:
    """Whether `apply_in_slices` computes `ox.update_and_apply` of `inner`: any
    transformation but a delayed one with masters (whose new values come from the masters
    the pending gradients update, `HostUpdate.device_update_and_apply`)."""
    return delayed_tx(inner) is None or value_writer(delayed_tx(inner)) is None


def apply_in_slices(
    inner: Any, grads: Any, opt_state: Any, params: Any, extra: dict
) -> tuple[Any, Any] | None:
    """`ox.update_and_apply` of `stream=None` on the device: the update and
    `optax.apply_updates` (or, with masters, each parameter written from its new master)
    in the same slices of each large elementwise group, every new slice written over its
    parameter where it lives. `(new_params, new_opt_state)`, or
    None where no group is sliced."""
    check_ours(opt_state, streamed=False, name=NAME)
    grads = trainable(grads)
    check_matches(type(opt_state)(eval_shape(inner.init, shapes(grads))), opt_state, name=NAME)
    applied = update_in_slices(inner, grads, opt_state.inner, trainable(params), extra, apply=True)
    if applied is None:
        return None
    new_values, new_inner = applied
    # Values computed whole (a group not sliced) are on the device: each goes back to
    # its parameter's memory, as the sliced ones were written there.
    placed = jax.tree_util.tree_map(
        lambda v, p: to_host(v) if is_host_typed(p) else v, new_values, trainable(params)
    )
    mask = host_mask(opt_state.inner)
    return eqx.combine(placed, params), type(opt_state)(restore_memory(mask, new_inner))


def _grouped(
    closed: Any, operands: list, slots: dict[int, int], to_host_memory: set[int]
) -> list | None:
    """`closed`'s results computed group by group (None if no group is sliced), each
    piece on the device (`groups.run`): a sliced result written over the operand `slots`
    names, or into a fresh buffer, in host memory for those in `to_host_memory`."""
    planned = groups.plan(closed, 0, lambda _: slices.SLICE_BYTES)  # one parameter's results each
    if all(group.chunks == 1 for group in planned):
        return None
    where = groups.Where(
        whole=_whole,
        trip=_trip,
        fits=_fits,
        fresh=lambda j, aval: _fresh(aval, j in to_host_memory),
    )
    return groups.run(closed, operands, planned, slots, where)


def _whole(program: Any, reads: list) -> list:
    """A group's results computed whole on the device, its operands fetched first."""
    return eval_jaxpr(program.jaxpr, program.consts, *[to_device(x) for x in reads])


def _trip(program: Any, chunks: int) -> Any:
    """A trip of a group in slices: slice `k` of each operand of the group's size
    (sliced in host memory, then fetched), the others fetched whole, computed on the
    device."""
    run = slices_program(program, chunks)
    size = elements(program)

    def compute(k: Any, current: list) -> list:
        parts = [
            to_device(jax.lax.dynamic_index_in_dim(x, k, keepdims=False) if _size(x) == size else x)
            for x in current
        ]
        return run(*parts)

    return compute


def _fits(operand: Any, aval: Any) -> bool:
    """Whether a result of type `aval` can be written over `operand`."""
    return operand.dtype == aval.dtype and _size(operand) == _size(aval)


def _fresh(aval: Any, host: bool) -> Any:
    """A sliced result's buffer that replaces no operand: zeros on the device, or in host
    memory (zeros moved there, as JAX's own offloading makes a host buffer, which XLA
    turns into a host allocation)."""
    zeros = jnp.zeros(aval.shape, aval.dtype)
    return to_host(zeros) if host else zeros
