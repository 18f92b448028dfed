"""A host computation split into chained calls, so that XLA:GPU can update in place.

XLA:GPU runs a host computation as a call of its own whose results get buffers of their
own; written into donated arguments, each result is a temporary copy. One call for the
whole optimizer update therefore holds a second copy of every result at once: two copies
of the state in host memory. Split into one call per group of results (a parameter's new
master, moments and value), each call waiting for the one before, only one group's
results are temporaries at a time (measured deviceless on h100: four 4 MiB leaves, 16 MiB
of host temporaries in one call, 4 MiB chained).

A group is the results that read the same large operands (the arrays of more than one
element): a leaf's gradient, master and moments. Scalars (Adam's count, the delayed
update's flag) are shared by every group and link none. A result that reads every
gradient (a global norm: `clip_by_global_norm`) joins every group into one, and the
computation stays whole. Groups are then merged in order while their results' bytes stay
within the largest group's, which bounds the temporaries the same and makes fewer calls.
"""

from collections.abc import Sequence
from typing import Any

import numpy as np
from jax.extend.core import ClosedJaxpr, Literal

from .._base.jax_private import dce_jaxpr_consts

_NONE: frozenset = frozenset()
# Primitives whose one sub-jaxpr maps the equation's operands to its results.
_CALLS = ("pjit", "jit", "closed_call", "core_call", "remat", "checkpoint")


def _size(aval: Any) -> int:
    return int(np.prod(getattr(aval, "shape", ()), dtype=np.int64))


def _nbytes(aval: Any) -> int:
    return _size(aval) * np.dtype(aval.dtype).itemsize


def _dependencies(jaxpr: Any, inputs: Sequence[frozenset]) -> list[frozenset]:
    """For each result of `jaxpr`, the large operands (by index) it reads, given those of
    each input; through `cond` branch by branch and into called jaxprs, else every
    operand of an equation reaching every result of it."""
    env: dict[Any, frozenset] = dict(zip(jaxpr.invars, inputs))

    def read(var: Any) -> frozenset:
        return _NONE if isinstance(var, Literal) else env.get(var, _NONE)

    for eqn in jaxpr.eqns:
        found = [read(v) for v in eqn.invars]
        name = eqn.primitive.name
        if name == "cond":
            predicate, operands = found[0], found[1:]
            branches = [_dependencies(b.jaxpr, operands) for b in eqn.params["branches"]]
            outs = [predicate.union(*parts) for parts in zip(*branches)]
        elif name in _CALLS and "jaxpr" in eqn.params:
            inner = eqn.params["jaxpr"]
            outs = _dependencies(getattr(inner, "jaxpr", inner), found)
        else:
            outs = [_NONE.union(*found)] * len(eqn.outvars)
        env.update(zip(eqn.outvars, outs))
    return [read(v) for v in jaxpr.outvars]


def result_groups(closed: ClosedJaxpr, cap: int | None = None) -> list[list[int]]:
    """The results of `closed` by index, in groups, each reading large operands no other
    group reads; in order of their first result, merged while within the largest group's
    bytes (and within `cap`, if given), each group's indices in order."""
    jaxpr = closed.jaxpr
    large = [frozenset({i}) if _size(v.aval) > 1 else _NONE for i, v in enumerate(jaxpr.invars)]
    reads = _dependencies(jaxpr, large)
    owner = list(range(len(reads)))  # union-find over results sharing a large operand

    def root(i: int) -> int:
        while owner[i] != i:
            owner[i] = owner[owner[i]]
            i = owner[i]
        return i

    first_reader: dict[int, int] = {}
    for result, operands in enumerate(reads):
        for operand in operands:
            other = first_reader.setdefault(operand, result)
            owner[root(result)] = root(other)
    groups: dict[int, list[int]] = {}
    for result in range(len(reads)):
        groups.setdefault(root(result), []).append(result)
    # Results that read no large operand (Adam's new count) go with the first group.
    linked = [g for g in groups.values() if any(reads[i] for i in g)]
    free = [i for g in groups.values() if not any(reads[i] for i in g) for i in g]
    if not linked:
        return [free]
    linked[0] = sorted(linked[0] + free)
    merged = _merged(linked, [_nbytes(v.aval) for v in jaxpr.outvars], cap)
    return [sorted(group) for group in merged]


def _merged(groups: list[list[int]], sizes: list[int], cap: int | None) -> list[list[int]]:
    """Consecutive groups joined while their results' bytes stay within the largest's
    (and `cap`)."""
    bound = max((sum(sizes[i] for i in g) for g in groups), default=0)
    bound = bound if cap is None else min(bound, cap)
    merged: list[list[int]] = []
    held = 0
    for group in groups:
        size = sum(sizes[i] for i in group)
        if merged and held + size <= bound:
            merged[-1] = merged[-1] + group
            held += size
        else:
            merged.append(list(group))
            held = size
    return merged


def group_program(closed: ClosedJaxpr, group: Sequence[int]) -> tuple[ClosedJaxpr, list[bool]]:
    """The computation of `group`'s results alone, and which operands it reads."""
    wanted = set(group)
    used = [i in wanted for i in range(len(closed.jaxpr.outvars))]
    jaxpr, used_consts, used_operands = dce_jaxpr_consts(closed.jaxpr, used)
    consts = [c for c, u in zip(closed.consts, used_consts) if u]
    return ClosedJaxpr(jaxpr, consts), list(used_operands)
