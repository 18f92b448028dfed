"""What a region fetches: host-resident leaves to the device, inside the region or, for
a value a loop body closes over, once outside the loop; and `ox.fetch`, the explicit
fetch for a leaf used outside any region.

Each fetch of an argument's leaf (in a region, or by `ox.fetch`) is made under the leaf's
plan path as a label, which the fetch's transpose (the gradient sent back to host memory)
keeps: the audit names that gradient by path, even where the backward pass does not fetch
the leaf again (a bias), and where the fetch is differentiated where it is traced (outside
any loop body or region, JAX gives its transpose no trace of the fetch but the label).

One fetch is refused: on XLA:GPU, a differentiated region's fetch of a host-resident
leaf sliced by two nested loops (stacked layers inside stacked blocks), whose gradient
XLA:GPU cannot compile (`refuse_nested_slices`).
"""

import contextlib
from typing import Any

import jax

from .._base.errors import ContractError, Violation
from .._base.jax_private import trace_of
from .._host.compute import traced_platform
from .._plan.walk import format_keys
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
    refuse_nested_slices(module, labels)
    moved = []
    for x, label in zip(leaves, labels):
        if is_host_typed(x) and isinstance(label, str) and label:
            with labelled("gradient", label):
                x = to_device(x)
        moved.append(to_device(x))
    return jax.tree_util.tree_unflatten(treedef, moved)


_NESTED_SLICES = (
    "{leaves} {is_} host-resident (pinned_host) and reach{es} a region as a slice of a "
    "slice: a `jax.lax.scan` (or `ox.scan`) over stacked layers inside the body of "
    "another loop over stacked blocks slices {it}, and the step is differentiated. "
    "XLA:GPU cannot compile the gradient of such a slice (its host offloader fails with "
    "`INTERNAL: during context [end-of-post-layout_assignment]`, in plain JAX too; one "
    "level of slicing compiles). Fetch one level instead: annotate the outer block "
    "(`ox.annotate(model, lambda m: m.blocks, memory='pinned_host')`: each block's "
    "region fetches its stacked layers once per trip of the outer loop, and the inner "
    "scan slices the device copy), or run the outer loop with `ox.scan(model.blocks, "
    "x)`, which does the same; or keep the inner layers on the device "
    "(`memory='device'`). The CPU and TPU compile it as it is."
)
# JAX's traces that differentiate what they trace: the gradient is what XLA:GPU fails on.
_DIFFERENTIATING = ("JVPTrace", "LinearizeTrace")
_LOOPS = ("scan", "fori", "while")


def refuse_nested_slices(module: Any, labels: list) -> None:
    """Raise a `ContractError` if a region, traced for XLA:GPU, would fetch a
    host-resident leaf of `module` sliced by two nested loops in a differentiated step:
    XLA:GPU fails to compile that gradient (see `_NESTED_SLICES`), after the whole
    trace, with a message that names no leaf. A leaf a loop body closes over was fetched
    before the region (`fetch_captured`), so a host-typed leaf here is a value of the
    innermost loop's body: one of its slices."""
    if traced_platform() not in ("cuda", "gpu"):
        return
    nested = []
    for (keys, x), label in zip(jax.tree_util.tree_flatten_with_path(module)[0], labels):
        if is_host_typed(x) and _in_nested_loops(trace_of(x)):
            nested.append(_described(x, keys, label))
    if nested:
        message = _NESTED_SLICES.format(
            leaves=", ".join(nested),
            is_="is" if len(nested) == 1 else "are",
            es="es" if len(nested) == 1 else "",
            it="it" if len(nested) == 1 else "them",
        )
        raise ContractError(
            message, [Violation("host leaf in nested loops", n, message) for n in nested]
        )


def _in_nested_loops(trace: Any) -> bool:
    """Whether `trace` is nested in two loop bodies (scan, while) that a transformation
    differentiating the step encloses: the loops the gradient runs backward. Loops
    outside it (a `jax.lax.scan` over training steps) only carry the leaves."""
    loops = 0
    while trace is not None:
        if type(trace).__name__ in _DIFFERENTIATING:
            return loops >= 2
        info = getattr(getattr(trace, "frame", None), "debug_info", None)
        kind = getattr(info, "traced_for", None) or ""
        loops += any(loop in kind for loop in _LOOPS)
        trace = getattr(trace, "parent_trace", None)
    return False


def _described(x: Any, keys: tuple, label: Any) -> str:
    """The leaf by its plan path: its label, else the plan's host-resident leaves of
    which it can be a slice of a slice (same trailing shape and field name)."""
    shape = tuple(jax.typeof(x).shape)
    if isinstance(label, str) and label:
        return f"`{label}` (sliced to {shape})"
    state = current()
    field = format_keys(keys[-1:]) if keys else ""
    found = [
        leaf
        for leaf in (state.plan.leaves if state is not None else ())
        if leaf.memory == "pinned_host"
        and len(leaf.shape) >= len(shape) + 2
        and tuple(leaf.shape[len(leaf.shape) - len(shape) :]) == shape
        and leaf.path.endswith(field)
    ]
    if not found:
        return f"the called module's leaf `{format_keys(keys)}` (shape {shape})"
    return " or ".join(f"`{leaf.path}` (shape {leaf.shape}, sliced to {shape})" for leaf in found)
