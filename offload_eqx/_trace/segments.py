"""An `ox.scan` cut into segments of layers, each with its own remat policy (a name's
policy split by layers, `ox.LayerSplit`), whose gradient of the stacked leaves is
written in place.

Split by `jnp.split` and scanned segment by segment, a stack's gradient is each
segment's gradient stacked by its own backward loop and then concatenated: every
segment's gradient and the joined one are alive together, twice the stacked gradient at
the peak, which made every split need more device memory than saving a name in every
layer. Threading the stack through the loops as a carry does not help: JAX turns a
carry that a body passes on unchanged into a constant of the loop, and the backward
loop of each segment accumulates that constant's gradient in a zero-filled buffer of its
own, added to the others' at the end (the same two stacks).

So the segmented run has a custom gradient (`segmented`). Its forward pass runs each
layer under `jax.vjp` and keeps, per layer, the residuals the layer's region keeps (its
policy decides: a saved name, an offloaded one, the layer's input carry), but not the
layer's weights: those are read from the stack again. Its backward pass runs the
segments' layers in reverse in loops that carry one buffer per device-resident stacked
leaf, the gradient of the whole stack, and write each layer's gradient into it at the
layer's index (`dynamic_update_slice`, in place): the buffer goes from the last
segment's loop to the first's, one stack's bytes however many segments.

Host-resident stacked leaves are not read by index (a host-typed operand of a device
slice is refused, and a loop carrying host-typed gradients does not compile on
XLA:GPU): they are split into segments in host memory, as before, scanned as the loops'
inputs, and their segments' gradients joined in host memory (`_host_split`).

A split scan is reverse-mode only: `jax.jvp` through it raises JAX's error for a
`custom_vjp` function.
"""

import functools
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from .._host.compute import on_host
from .._plan.remat_policy import OX_SCAN_SCOPE
from .._sharding.memory_space import is_host_typed, to_host

# (carry, layer leaves, constant leaves, policy) -> the next carry
Call = Callable[[Any, list, list, Any], Any]


def segmented(
    call: Call,
    carry: Any,
    leaves: list,
    consts: list,
    segments: list[tuple[int, int, Any]],
    unroll: int | bool,
) -> Any:
    """Apply the layers of the stacked `leaves` (layer axis 0) in `segments` of
    `(start, stop, policy)`: `carry = call(carry, layer leaves, consts, policy)`, the
    gradient of the device-resident stacked leaves written in place (module docstring)."""
    host = [is_host_typed(x) for x in leaves]
    cuts = tuple(start for start, _, _ in segments[1:])
    device = [x for x, h in zip(leaves, host) if not h]
    pieces = [_split_layers(x, cuts) for x, h in zip(leaves, host) if h]
    by_segment = [[p[k] for p in pieces] for k in range(len(segments))]
    carry_leaves, carry_tree = jax.tree_util.tree_flatten(carry)
    run = _Run(call, carry_tree, host, segments, unroll)
    out = run.custom(carry_leaves, device, by_segment, consts)
    return jax.tree_util.tree_unflatten(carry_tree, out)


class _Run:
    """The segmented run of one `ox.scan` and its gradient (see the module docstring)."""

    def __init__(self, call: Call, carry_tree: Any, host: list, segments: list, unroll):
        self.call, self.carry_tree, self.host = call, carry_tree, host
        self.segments, self.unroll = segments, unroll
        self.layouts: list = []  # per segment: how each residual leaf is rebuilt
        custom = jax.custom_vjp(self.primal)
        custom.defvjp(self.forward, self.backward)
        self.custom = custom

    def layer(self, device: list, host_slices: list) -> list:
        """The layer's leaves in the stack's order, from the device slices and the host."""
        device_, host_ = iter(device), iter(host_slices)
        return [next(host_) if h else next(device_) for h in self.host]

    def apply(self, carry: list, layer: list, consts: list, policy: Any) -> list:
        tree = jax.tree_util.tree_unflatten(self.carry_tree, carry)
        return jax.tree_util.tree_leaves(self.call(tree, layer, consts, policy))

    def primal(self, carry: list, device: list, by_segment: list, consts: list) -> list:
        for (start, stop, policy), host_pieces in zip(self.segments, by_segment):

            def step(carry, xs, policy=policy):
                i, host_slices = xs
                layer = self.layer(_at(device, i), host_slices)
                return self.apply(carry, layer, consts, policy), None

            with jax.named_scope(OX_SCAN_SCOPE):
                xs = (jnp.arange(start, stop), host_pieces)
                carry = jax.lax.scan(step, carry, xs, unroll=self.unroll)[0]
        return carry

    def forward(self, carry: list, device: list, by_segment: list, consts: list) -> tuple:
        kept_all = []
        self.layouts = []
        self.carry_types = [jax.ShapeDtypeStruct(jnp.shape(x), x.dtype) for x in carry]
        for (start, stop, policy), host_pieces in zip(self.segments, by_segment):
            layout: list = []

            def step(carry, xs, policy=policy, layout=layout):
                i, host_slices = xs
                device_slices = _at(device, i)
                out, vjp, mask = _vjp(
                    lambda c, d, h, k: self.apply(c, self.layer(d, h), k, policy),
                    carry,
                    device_slices,
                    host_slices,
                    consts,
                )
                known = {"device": device_slices, "host": host_slices, "const": consts}
                kept, layout[:] = _strip(vjp, known)
                layout.append(mask)
                return out, kept

            with jax.named_scope(OX_SCAN_SCOPE):
                xs = (jnp.arange(start, stop), host_pieces)
                carry, kept = jax.lax.scan(step, carry, xs, unroll=self.unroll)
            kept_all.append(kept)
            self.layouts.append(layout)
        return carry, (device, by_segment, consts, kept_all)

    def backward(self, residuals: tuple, ct_carry: list) -> tuple:
        device, by_segment, consts, kept_all = residuals
        # One buffer per stacked device leaf, carried from the last segment's loop to the
        # first's; each layer's gradient written at its index (in place).
        grads = [_zero_cotangent(x) for x in device]
        ct_consts = [_zero_cotangent(x) for x in consts]
        host_grads = []
        inexact = [jnp.issubdtype(t.dtype, jnp.inexact) for t in self.carry_types]
        for segment in reversed(range(len(self.segments))):
            start, stop, _ = self.segments[segment]
            layout = self.layouts[segment]

            def step(state, xs, layout=layout):
                ct, grads, ct_consts = state
                i, host_slices, kept = xs
                ct = [_float0_like(t) if c is None else c for c, t in zip(ct, self.carry_types)]
                device_slices = _at(device, i)
                known = {"device": device_slices, "host": host_slices, "const": consts}
                vjp = _rebuild(layout[:2], kept, known)
                d_carry, d_device, d_host, d_consts = _cotangents(vjp, layout[2], ct)
                grads = [_written(g, d, i) for g, d in zip(grads, d_device)]
                ct_consts = [_added(a, b) for a, b in zip(ct_consts, d_consts)]
                return (d_carry, grads, ct_consts), d_host

            ct_carry = [c if d else None for c, d in zip(ct_carry, inexact)]
            xs = (jnp.arange(start, stop), by_segment[segment], kept_all[segment])
            state = (ct_carry, grads, ct_consts)
            state, d_host = jax.lax.scan(step, state, xs, reverse=True, unroll=self.unroll)
            ct_carry, grads, ct_consts = state
            host_grads.append(d_host)
        return ct_carry, grads, host_grads[::-1], ct_consts


def _at(device: list, i: Any) -> list:
    return [jax.lax.dynamic_index_in_dim(x, i, keepdims=False) for x in device]


def _vjp(fn: Callable, *primals: Any) -> tuple:
    """`jax.vjp` of `fn` with respect to the floating-point leaves of its arguments (the
    others, integer leaves of a carry or a layer, are closed over): `(out, vjp, mask)`,
    `mask` telling which leaves of `primals` `vjp` gives cotangents for."""
    flat, tree = jax.tree_util.tree_flatten(primals)
    inexact = [eqx.is_inexact_array(x) for x in flat]

    def of_inexact(*values):
        values_ = iter(values)
        full = [next(values_) if d else x for x, d in zip(flat, inexact)]
        return fn(*jax.tree_util.tree_unflatten(tree, full))

    out, vjp = jax.vjp(of_inexact, *(x for x, d in zip(flat, inexact) if d))
    return out, vjp, (tree, inexact)


def _cotangents(vjp: Callable, mask: tuple, ct: Any) -> Any:
    """`vjp(ct)` in the structure of the primals, None where a leaf is not floating-point
    (a zero cotangent, as a `custom_vjp` rule may give it)."""
    tree, inexact = mask
    cts = iter(vjp(ct))
    return jax.tree_util.tree_unflatten(tree, [next(cts) if d else None for d in inexact])


def _strip(vjp: Any, known: dict[str, list]) -> tuple[list, list]:
    """The residual leaves of a layer's `vjp` to stack over the layers, and how to rebuild
    it: a leaf that is one of the layer's weights or the constants (`known`) is read
    again in the backward pass, not stacked (a copy of the whole stack otherwise)."""
    where = {id(x): (kind, j) for kind, xs in known.items() for j, x in enumerate(xs)}
    leaves, tree = jax.tree_util.tree_flatten(vjp)
    kept, kinds = [], []
    for leaf in leaves:
        if id(leaf) in where:
            kinds.append(where[id(leaf)])
        elif eqx.is_array(leaf):
            kinds.append(None)
            kept.append(leaf)
        else:
            kinds.append(("static", leaf))
    return kept, [tree, kinds]


def _rebuild(layout: list, kept: list, known: dict[str, list]) -> Callable:
    tree, kinds = layout
    kept_ = iter(kept)
    leaves = []
    for kind in kinds:
        if kind is None:
            leaves.append(next(kept_))
        elif kind[0] == "static":
            leaves.append(kind[1])
        else:
            leaves.append(known[kind[0]][kind[1]])
    return jax.tree_util.tree_unflatten(tree, leaves)


def _float0_like(x: Any) -> Any:
    return np.zeros(x.shape, dtype=jax.dtypes.float0)


def _zero_cotangent(x: Any) -> Any:
    return jnp.zeros_like(x) if eqx.is_inexact_array(x) else None


def _written(grad: Any, layer_grad: Any, i: Any) -> Any:
    if grad is None or layer_grad is None:
        return grad
    return jax.lax.dynamic_update_index_in_dim(grad, layer_grad.astype(grad.dtype), i, 0)


def _added(total: Any, more: Any) -> Any:
    return total if total is None or more is None else total + more


def _split_layers(x: Any, cuts: tuple[int, ...]) -> list:
    """A host-resident stacked leaf split at `cuts` along its layer axis, in host memory:
    the split and its transpose (a concatenation of the segments' gradients) are host
    computations of their own, which XLA would otherwise make with a warning each."""
    return list(_host_split(x, cuts))


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _host_split(x: Any, cuts: tuple[int, ...]) -> tuple:
    return tuple(on_host(lambda x: jnp.split(x, cuts), x, flatten=False, name="layer split"))


def _host_split_forward(x: Any, cuts: tuple[int, ...]) -> tuple:
    return _host_split(x, cuts), None


def _host_split_backward(cuts: tuple[int, ...], _: None, cotangents: tuple) -> tuple:
    pieces = [to_host(c) for c in cotangents]
    joined = on_host(lambda *p: jnp.concatenate(p), *pieces, flatten=False, name="layer join")
    return (joined,)


_host_split.defvjp(_host_split_forward, _host_split_backward)
