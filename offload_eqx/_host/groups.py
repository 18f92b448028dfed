"""One slicing driver: a traced update computed group by group (`split.result_groups`), a
large elementwise group a slice at a time (`chunks`), each sliced result written over the
operand it replaces, whichever computes the pieces.

The host update (`calls.chained`: each piece a host call) and the device update of
`stream=None` (`_optimizer.whole_slices`: each piece on the device, its slices fetched
from host memory) differ only in where a piece computes; `Where` says that, and
everything else is here: the groups and their slice counts (`plan`), which operand each
result may be written over (only one its own group reads: `targets`), and the loop
whose trip reads a target's old slice from the loop's carry before writing the new one
(`_in_slices`).
"""

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._sharding.memory_space import is_host_typed, to_host
from .chunks import chunk_count
from .split import group_program, result_groups


@dataclasses.dataclass(frozen=True)
class Where:
    """Where the pieces of a grouped computation compute.

    - `whole(program, reads)`: a group's results computed whole from the operands it reads.
    - `trip(program, chunks)`: `compute(k, operands)`, slice `k`'s results, given the
      group's operands (those of the group's number of elements as `(chunks, -1)`
      arrays, the others whole); each result is written where its buffer is.
    - `fits(operand, aval)`: whether a result of `aval` may be written over `operand`.
    - `fresh(index, aval)`: the buffer of a sliced result that replaces no operand.
    - `chained`: each group's operands held back until the group before has its
      results (an `optimization_barrier`), so one group's results are live at a time.
    """

    whole: Callable[[Any, list], list]
    trip: Callable[[Any, int], Callable[..., list]]
    fits: Callable[[Any, Any], bool]
    fresh: Callable[[int, Any], Any]
    chained: bool = False


@dataclasses.dataclass(frozen=True)
class Group:
    """One group's results (by index) and the operands they read (`reads`), those
    computed in slices (`rest`, of more than one element), the program of `rest` (or of
    all), the operands it reads (`used`), and its slices."""

    results: list[int]
    reads: list[bool]
    rest: list[int]
    program: Any
    used: list[bool]
    chunks: int


def _size(aval: Any) -> int:
    return int(np.prod(getattr(aval, "shape", ()), dtype=np.int64))


def plan(closed: Any, cap: int | None, bound: Callable[[Any], int | None]) -> list[Group]:
    """The groups of `closed` (merged within `cap` bytes, `split.result_groups`), each
    with the slices its elementwise results are computed in (`chunks.chunk_count` within
    `bound(program)` bytes; None: computed whole)."""
    groups = []
    for results in result_groups(closed, cap=cap):
        # Results of one element (Adam's count) are computed whole, before the slices.
        rest = [j for j in results if _size(closed.out_avals[j]) > 1]
        program, used = group_program(closed, rest or results)
        limit = bound(program) if rest else None
        chunks = 1 if limit is None else chunk_count(program, limit)
        reads = group_program(closed, results)[1]
        groups.append(Group(results, reads, rest if chunks > 1 else [], program, used, chunks))
    return groups


def run(closed: Any, operands: list, groups: list[Group], slots: dict[int, int], where: Where):
    """`closed`'s results on `operands`, group by group (`plan`), as `where` computes
    the pieces: a sliced result written over the operand `slots` names for it (result
    index -> operand index) where only its own group reads that operand and it `fits`,
    else into `where.fresh`."""
    readers: dict[int, int] = {}  # operand -> the group that reads it
    for number, group in enumerate(groups):
        readers.update((i, number) for i, u in enumerate(group.reads) if u)
    outs: list = [None] * len(closed.out_avals)
    before: list = []
    for number, group in enumerate(groups):
        whole = [j for j in group.results if j not in group.rest]
        places = {
            j: slots[j]
            for j in group.rest
            if j in slots
            and readers.get(slots[j], number) == number
            and where.fits(operands[slots[j]], closed.out_avals[j])
        }
        needed = sorted({i for i, u in enumerate(group.reads) if u} | set(places.values()))
        held = [operands[i] for i in needed]
        if where.chained and before:
            held, _ = jax.lax.optimization_barrier((held, before))
        ready = dict(zip(needed, held))
        before = []
        if whole:
            small, small_used = group_program(closed, whole)
            before += where.whole(small, [ready[i] for i, u in enumerate(small_used) if u])
        if group.rest:
            buffers = [
                ready[places[j]] if j in places else where.fresh(j, closed.out_avals[j])
                for j in group.rest
            ]
            targets = [places.get(j) for j in group.rest]
            before += _in_slices(group, ready, buffers, targets, where)
        for index, result in zip(whole + group.rest, before):
            outs[index] = result
    return outs


def _in_slices(group: Group, ready: dict, buffers: list, targets: list, where: Where) -> list:
    """`group.program` (closed, elementwise) in `group.chunks` slices of its flat element
    order, in a loop: trip `k` computes slice `k` of the results (`where.trip`) from
    slice `k` of the operands of the group's size (the others whole) and writes each into
    its buffer: the operand `targets[j]` (whose old slice `k` the trip reads from the
    loop's carry, before it is overwritten) or a fresh one."""
    chunks, program = group.chunks, group.program
    compute = where.trip(program, chunks)
    avals = program.out_avals
    reads = [i for i, u in enumerate(group.used) if u]
    from_carry = {p: targets.index(i) for p, i in enumerate(reads) if i in targets}
    size = _size(avals[0])
    given = [
        jnp.reshape(ready[i], (chunks, -1)) if _size(jax.typeof(ready[i])) == size else ready[i]
        for i in reads
    ]
    init = [jnp.reshape(x, (chunks, -1)) for x in buffers]

    def body(k: Any, carry: list) -> list:
        current = [carry[from_carry[p]] if p in from_carry else x for p, x in enumerate(given)]
        results = compute(k, current)
        return [
            jax.lax.dynamic_update_index_in_dim(c, to_host(r) if is_host_typed(c) else r, k, 0)
            for c, r in zip(carry, results)
        ]

    final = jax.lax.fori_loop(0, chunks, body, init)
    return [jnp.reshape(x, aval.shape) for x, aval in zip(final, avals)]
