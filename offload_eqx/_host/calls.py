"""A traced host computation bound as host calls of the step (`host_compute.on_host`):
one call (`bind`), or one per group of results, chained (`chained`, `host_split`), a
large elementwise group computed a slice at a time (`host_chunks`), its results written
over the operands they replace (`slots_of`); the groups and slices are `groups`'s, each
piece a host call here."""

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.core import ShapedArray

from .._base.jax_private import compute_on_p, extend_compute_type
from .._sharding.memory_space import is_host_typed, to_host
from . import chunks as host_chunks, groups
from .chunks import slice_program

HOST = "device_host"
# The name scope of a group's host calls computed in slices (`_trip`).
SLICES_SCOPE = "ox_host_slices"
# Under `slice_all`, the fewest slices a group is computed in (a loop of one trip would
# be no loop: XLA removes it, and its results are copied into the state after the call).
LEAST_SLICES = 4


def device_aval(x: Any) -> Any:
    """`x`'s shape and dtype, typed as device memory: what a host computation is traced
    with (inside it, every value is in host memory)."""
    return ShapedArray(np.shape(x), x.dtype, weak_type=jax.typeof(x).weak_type)


def slots_of(out_shape: Any, with_path: list, reuse: dict[int, int], offset: int) -> dict:
    """For each result (by index) that `reuse` says replaces an argument's leaf at the
    same path, that leaf's index among the operands (`offset` constants first)."""
    key = jax.tree_util.keystr
    by_path = {
        (getattr(path[0], "idx", None), key(path[1:])): offset + n
        for n, (path, _) in enumerate(with_path)
    }
    slots = {}
    for index, (path, _) in enumerate(jax.tree_util.tree_flatten_with_path(out_shape)[0]):
        part = getattr(path[0], "idx", None) if path else None
        found = by_path.get((reuse.get(part), key(path[1:]))) if part in reuse else None
        if found is not None:
            slots[index] = found
    return slots


def bind(jaxpr: Any, operands: list) -> list:
    """One host computation of `jaxpr` (closed) on `operands`, its results in host memory."""
    return compute_on_p.bind(
        *operands,
        jaxpr=jaxpr,
        compute_type=HOST,
        out_memory_spaces=tuple(jax.memory.Space.Host for _ in jaxpr.out_avals),
        compiler_options_json=None,
    )


def chained(
    jaxpr: Any,
    operands: list,
    slots: dict[int, int],
    scope: str,
    sliced: bool,
    slice_all: bool = False,
) -> list:
    """`jaxpr` as one host computation per group of results (`host_split`), each group's
    operands held back (`optimization_barrier`) until the group before has its results.
    With `sliced`, a group whose results exceed `host_chunks.CHUNK_BYTES` and that is
    elementwise is computed a slice at a time (`groups`: each slice a host call), its
    results written into the operands `slots` names for them (result index -> operand
    index). With `slice_all`, every elementwise group is, in at least `LEAST_SLICES`
    slices."""
    # Sliced, groups are merged only within a slice's bytes: a merged group mixes
    # parameters of several sizes, which cannot be sliced together.
    cap = 0 if slice_all else host_chunks.CHUNK_BYTES if sliced else None
    planned = groups.plan(
        jaxpr, cap, lambda program: _bound(program, slice_all) if sliced else None
    )
    if len(planned) == 1 and planned[0].chunks == 1:
        return bind(jaxpr, operands)
    where = groups.Where(
        whole=bind,
        trip=lambda program, chunks: _trip(program, chunks, scope),
        fits=_fits,
        fresh=lambda _, aval: _host_zeros(aval),
        chained=True,
    )
    return groups.run(jaxpr, operands, planned, slots, where)


def _bound(program: Any, slice_all: bool) -> int:
    """The most bytes of results one slice of `program` computes."""
    if not slice_all:
        return host_chunks.CHUNK_BYTES
    held = sum(_size(v.aval) * v.aval.dtype.itemsize for v in program.jaxpr.outvars)
    return max(1, min(host_chunks.CHUNK_BYTES, held // LEAST_SLICES))


def _size(aval: Any) -> int:
    return int(np.prod(aval.shape, dtype=np.int64))


def _fits(operand: Any, aval: Any) -> bool:
    """Whether a result of type `aval` can be written over `operand`: in host memory, of
    the same dtype and number of elements."""
    return (
        is_host_typed(operand)
        and operand.dtype == aval.dtype
        and _size(jax.typeof(operand)) == _size(aval)
    )


def _trip(program: Any, chunks: int, scope: str) -> Callable[..., list]:
    """A trip of a group computed in slices: one host call that reads slice `k` of its
    operands and returns the results' slices, which the loop writes into their buffers.
    The operands are sliced inside the call, along their first axis, which its dynamic
    slices read alone (a reshape inside it would read the whole operand, as XLA:CPU
    compiles it). XLA:GPU places each host call's results in device memory and writes
    them back with a kernel: slice by slice, the host holds no second copy of what the
    group replaces."""
    run = slice_program(program, chunks)

    def compute(k: Any, current: list) -> list:
        with jax.named_scope(SLICES_SCOPE), jax.named_scope(scope):
            return _traced_bind(run, [to_host(k), *current])

    return compute


def _traced_bind(fn: Callable[..., Any], operands: list) -> list:
    """`fn(*operands)` (host-typed operands) traced and bound as one host computation."""
    with extend_compute_type(HOST):
        closed = jax.make_jaxpr(fn)(*[device_aval(x) for x in operands])
    return list(bind(closed, operands))


def _host_zeros(aval: Any) -> Any:
    """A fresh buffer in host memory (zeros: a sliced result's buffer that replaces no
    operand), as JAX's own offloading makes one: zeros moved to host memory, which
    XLA:GPU's host offloader turns into a host allocation. Made by a host computation
    instead, jaxlib 0.12's host offloader aborted the process at the first slice written
    into it (`HostOffloader::CreateAllocateBufferForDynamicUpdateSlice`, a shape without
    a layout)."""
    return to_host(jnp.zeros(aval.shape, aval.dtype))
