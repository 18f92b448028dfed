"""One group of a split host computation (`host_split`) computed a slice at a time.

Split by parameter, XLA:GPU still holds one parameter's results beside the state: for a
stacked weight of a large model that is a lot (Llama-2-70B's feed-forward weights: their
master, moments and bfloat16 value are 263 GB). When every result of a group is computed
element by element from operands of the same number of elements (Adam, AdamW, SGD, Lion:
`optax` builds them from elementwise operations, reshapes and scalars), the group can be
computed one slice of that flat element order at a time, in a loop: each trip's host call
reads its slice of the operands, and its results are written into the slice of the
buffers the group replaces (the state it reads, donated), so the host holds no second
copy at all. XLA:GPU places each host call's result in device memory and writes it back
with a kernel, so a slice's results cross the link twice: the price of holding the state
once.

`chunk_count` says into how many slices a group is cut (1: whole; `CHUNK_BYTES` bounds a
slice's results), and `slice_program` builds the function one trip's host call computes.
"""

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.core import ShapedArray
from jax.extend.core import ClosedJaxpr, Literal

# A group whose results add up to more bytes than this is computed in slices of at most
# this many: the device memory one trip's results take (a few per cent of an H100).
CHUNK_BYTES = 1 << 30

# Primitives that compute each element of their output from the same element of their
# inputs (or from scalars).
ELEMENTWISE = frozenset(
    """abs acos acosh add and asin asinh atan atan2 atanh cbrt ceil clamp convert_element_type
    copy copy_p cos cosh div eq erf erf_inv erfc exp exp2 expm1 floor ge gt imag integer_pow
    is_finite le lgamma digamma log log1p logistic lt max min mul ne neg nextafter not or pow
    real reduce_precision rem round rsqrt select_n sign sin sinh sqrt square stop_gradient sub
    tan tanh xor""".split()
)
# Primitives that keep the row-major order of their elements (a reshape without
# `dimensions`, a squeeze, a broadcast that only adds axes of length one).
_SAME_ORDER = frozenset({"reshape", "squeeze", "expand_dims", "broadcast_in_dim"})
_CALLS = frozenset({"pjit", "jit", "closed_call", "core_call"})
# Our host kernels that compute each element of their results from the same element of
# their array operands and from whole small operands (`kernels/adamw.cc`: the step's
# scalars): a call on slices computes the slices of its results.
ELEMENTWISE_CALLS = frozenset({"offload_eqx_adamw"})
# A value computed whole inside a slice's program (no sliced operand) has at most this
# many elements (the kernel's scalars): more would be a second copy of large data.
_WHOLE = 64


class NotSliceable(Exception):
    """The group reads or writes an element from other elements: computed whole."""


def _size(aval: Any) -> int:
    return int(np.prod(getattr(aval, "shape", ()), dtype=np.int64))


def _nbytes(aval: Any) -> int:
    return _size(aval) * np.dtype(aval.dtype).itemsize


def elements(closed: ClosedJaxpr) -> int | None:
    """The number of elements every array operand and result of `closed` of more than one
    element has (None if they differ, or if none has more than one)."""
    sizes = {_size(v.aval) for v in (*closed.jaxpr.invars, *closed.jaxpr.outvars)}
    sizes -= {0, 1}
    return sizes.pop() if len(sizes) == 1 else None


def _eval(jaxpr: Any, consts: Sequence, args: Sequence, size: int, length: int) -> list:
    """`jaxpr` evaluated on one slice of `length` elements: a value of `size` elements is
    given (and made) as its slice, a one-dimensional array; scalars as they are. Raises
    `NotSliceable` at the first equation that mixes elements."""
    env: dict[Any, Any] = {}
    sliced: dict[Any, bool] = {}

    def read(var: Any) -> tuple[Any, bool]:
        if isinstance(var, Literal):
            return var.val, False
        return env[var], sliced[var]

    for var, value in zip(jaxpr.constvars, consts):  # whole: a large one is not sliceable
        env[var], sliced[var] = value, False
    for var, value in zip(jaxpr.invars, args):
        env[var], sliced[var] = value, _size(var.aval) == size
    for eqn in jaxpr.eqns:
        pairs = [read(v) for v in eqn.invars]
        values, flags = [v for v, _ in pairs], [f for _, f in pairs]
        outs, out_flags = _apply(eqn, values, flags, size, length)
        for var, value, flag in zip(eqn.outvars, outs, out_flags):
            env[var], sliced[var] = value, flag
    return [read(v)[0] for v in jaxpr.outvars]


def _apply(eqn: Any, values: list, flags: list, size: int, length: int) -> tuple[list, list]:
    """One equation on slices: `(results, which of them are slices)`."""
    name = eqn.primitive.name
    out_sizes = [_size(v.aval) for v in eqn.outvars]
    if name in _CALLS:
        inner = eqn.params["jaxpr"]
        return _eval(inner.jaxpr, inner.consts, values, size, length), [
            s == size for s in out_sizes
        ]
    if name == "cond" and not flags[0]:
        return _cond(eqn, values, size, length), [s == size for s in out_sizes]
    if not any(flags):
        if name == "broadcast_in_dim" and out_sizes == [size] and _size(eqn.invars[0].aval) == 1:
            return [jnp.broadcast_to(jnp.reshape(values[0], ()), (length,))], [True]
        if any(s == size or s > _WHOLE for s in out_sizes):
            raise NotSliceable(name)
        return _bound(eqn, values), [False] * len(out_sizes)
    if name == "ffi_call" and eqn.params.get("target_name") in ELEMENTWISE_CALLS:
        return _ffi_call(eqn, values, flags, size, length), [s == size for s in out_sizes]
    if out_sizes != [size] * len(out_sizes):
        raise NotSliceable(name)
    # (`squeeze`'s `dimensions` are the axes of length one it drops: the order stays.)
    transposes = name == "reshape" and eqn.params.get("dimensions") is not None
    if name in _SAME_ORDER and not transposes and len(values) == 1:
        return [values[0]], [True]
    if name in ELEMENTWISE and all(f or _size(v.aval) == 1 for f, v in zip(flags, eqn.invars)):
        # A one-element operand beside slices is a scalar (its shape may be (1, 1)).
        scalars = [v if f else jnp.reshape(v, ()) for v, f in zip(values, flags)]
        return _bound(eqn, scalars), [True] * len(out_sizes)
    raise NotSliceable(name)


def _cond(eqn: Any, values: list, size: int, length: int) -> list:
    """A `cond` on a whole predicate (the delayed update's `ready`), each branch computed
    on the slices."""

    def branch(closed: Any) -> Any:
        return lambda *operands: _eval(closed.jaxpr, closed.consts, operands, size, length)

    index, *operands = values
    return list(jax.lax.switch(index, [branch(b) for b in eqn.params["branches"]], *operands))


def _ffi_call(eqn: Any, values: list, flags: list, size: int, length: int) -> list:
    """A call of one of our elementwise kernels on slices: its results are slices too
    (whole operands, such as the step's scalars, are passed whole)."""
    results = tuple(
        ShapedArray((length,) if _size(v.aval) == size else v.aval.shape, v.aval.dtype)
        for v in eqn.outvars
    )
    default = lambda rank: tuple(reversed(range(rank)))  # noqa: E731 (the FFI's row-major)
    params = {
        **eqn.params,
        "result_avals": results,
        "input_layouts": tuple(default(np.ndim(x)) for x in values),
        "output_layouts": tuple(default(len(r.shape)) for r in results),
    }
    return _bound_with(eqn, values, params)


def _bound_with(eqn: Any, values: list, params: dict) -> list:
    out = eqn.primitive.bind(*values, **params)
    return list(out) if eqn.primitive.multiple_results else [out]


def _bound(eqn: Any, values: list) -> list:
    out = eqn.primitive.bind(*values, **eqn.params)
    return list(out) if eqn.primitive.multiple_results else [out]


def slice_program(closed: ClosedJaxpr, chunks: int) -> Callable[..., list]:
    """`run(k, *operands)`: `closed`'s results on slice `k` of `chunks` equal slices of the
    flat element order, each one-dimensional; operands of more than one element are
    given whole (flat or not) and sliced here, scalars as they are."""
    size = elements(closed)
    assert size is not None and size % chunks == 0
    length = size // chunks

    on_slices = slices_program(closed, chunks)

    def run(k: Any, *operands: Any) -> list:
        parts = [
            jax.lax.dynamic_index_in_dim(jnp.reshape(x, (chunks, length)), k, keepdims=False)
            if _size(v.aval) == size
            else x
            for x, v in zip(operands, closed.jaxpr.invars)
        ]
        return on_slices(*parts)

    return run


def slices_program(closed: ClosedJaxpr, chunks: int) -> Callable[..., list]:
    """`run(*parts)`: `closed`'s results on one of `chunks` equal slices of the flat
    element order, given its operands of `elements(closed)` elements as their slices
    (one-dimensional, sliced by the caller: in host memory, before a fetch) and the
    others whole."""
    size = elements(closed)
    assert size is not None and size % chunks == 0
    length = size // chunks
    return lambda *parts: _eval(closed.jaxpr, closed.consts, parts, size, length)


def chunk_count(closed: ClosedJaxpr, bound: int | None = None) -> int:
    """How many slices `closed` (one group's program) is computed in: 1 when its results
    are within `bound` bytes or it is not elementwise over one element order; else the
    fewest that divide its elements evenly with each slice's results within `bound`
    (default `CHUNK_BYTES`)."""
    bound = CHUNK_BYTES if bound is None else bound
    size = elements(closed)
    held = sum(_nbytes(v.aval) for v in closed.jaxpr.outvars)
    if size is None or held <= bound or any(_size(v.aval) != size for v in closed.jaxpr.outvars):
        return 1
    least = -(-held // bound)
    chunks = next((d for d in range(least, min(size, 64 * least) + 1) if size % d == 0), 1)
    if chunks == 1:
        return 1
    avals = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in closed.jaxpr.invars]
    try:
        jax.make_jaxpr(slice_program(closed, chunks))(np.int32(0), *avals)
    except NotSliceable:
        return 1
    return chunks
