"""What a region fetches: host-resident leaves to the device, inside the region or, for
a value a loop body closes over, once outside the loop; and `ox.fetch`, the explicit
fetch for a leaf used outside any region.

Each fetch of an argument's leaf (in a region, or by `ox.fetch`) is made under the leaf's
plan path as a label, which the fetch's transpose (the gradient sent back to host memory)
keeps: the audit names that gradient by path, even where the backward pass does not fetch
the leaf again (a bias), and where the fetch is differentiated where it is traced (outside
any loop body or region, JAX gives its transpose no trace of the fetch but the label).
"""

import contextlib
from typing import Any

import jax

from .._sharding.memory_space import (
    captured_by_loop,
    fetch_kept,
    fetch_outside,
    is_host_typed,
    labelled,
    to_device,
)
from .state import argument_path, current


def fetch(tree: Any) -> Any:
    """Fetch the host-resident arrays of `tree` to the device, here, explicitly.

    For a host-resident leaf used outside any region, which JAX cannot compute on or
    differentiate there: `1e-3 * jnp.sum(ox.fetch(model.layers.w) ** 2)`. The leaf is
    fetched once, where this is called, and its device copy is kept as long as the
    program needs it (the audit counts the transfer, and does not call the copy a
    residual); the gradient of this use goes back to host memory and is added there to
    the gradients the leaf's regions send. Device-resident leaves and non-array leaves
    are returned unchanged. Outside `ox.filter_jit` it moves arrays to device memory.

    **Returns:** `tree` with its host-resident arrays fetched to the device.
    """
    state = current()

    def one(x: Any) -> Any:
        if not is_host_typed(x):
            return x
        if captured_by_loop(x):
            return fetched_outside(x, state)
        with _gradient_label(x):
            return fetch_kept(x)

    return jax.tree_util.tree_map(one, tree)


def fetched_outside(x: Any, state: Any) -> Any:
    """`x`, a host-typed leaf a loop body closes over, fetched outside the loop, once per
    trace."""
    if state is None:
        return fetch_outside(x)
    held = state.fetched_outside.get(id(x))
    if held is None or held[0] is not x:
        with _gradient_label(x):
            held = state.fetched_outside[id(x)] = (x, fetch_outside(x))
    return held[1]


def _gradient_label(x: Any) -> Any:
    """The scope a fetch of `x` is made in: labelled with its plan path when `x` is an
    argument's leaf (see the module's docstring)."""
    path = argument_path(x)
    return labelled("gradient", path) if path else contextlib.nullcontext()


def fetch_captured(module: Any) -> Any:
    """The module with every host-typed leaf that a loop body or branch closes over
    fetched once, outside that body (`fetch_outside`): an `eqx.nn.LSTMCell` on the host
    called in a `jax.lax.scan` over time steps. Its device copy is shared by every call in
    the trace, and its gradient summed on the device and sent to host memory once."""
    state = current()

    def one(x: Any) -> Any:
        return fetched_outside(x, state) if is_host_typed(x) and captured_by_loop(x) else x

    return jax.tree_util.tree_map(one, module)


def labels_of(module: Any) -> list:
    """For each leaf of `module`, the plan path of the argument leaf it is (None for the
    others): a region fetches it under that label, which the transpose of the fetch (its
    gradient sent back to host memory) keeps, so the audit names the gradient."""
    return [argument_path(x) for x in jax.tree_util.tree_leaves(module)]


def fetched(module: Any, labels: list) -> Any:
    """`module` with its host-typed leaves fetched to the device, each under its label."""
    leaves, treedef = jax.tree_util.tree_flatten(module)
    if len(labels) != len(leaves):
        labels = [None] * len(leaves)
    moved = []
    for x, label in zip(leaves, labels):
        if is_host_typed(x) and isinstance(label, str) and label:
            with labelled("gradient", label):
                x = to_device(x)
        moved.append(to_device(x))
    return jax.tree_util.tree_unflatten(treedef, moved)
