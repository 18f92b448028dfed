"""Where each value of a traced program ends up: the output it is written into unchanged.

A transfer the walk cannot name by what it moves (a new optimizer state computed on the
device and sent back to host memory, an updated host-resident weight) is named by what it
writes: the output leaf its result flows into. A value flows into an output through
equations that move it without computing on it: transfers, views and casts, data
movement (a layer written into its stack with `dynamic_update_slice`, one operand of a
`select_n`), `optimization_barrier`, and the bodies of nested programs (a `cond` branch's
results are the `cond`'s, a `scan` body's carry is the loop's final carry, a `jit` body's
results are the call's). Computing on a value (adding the update to a weight) makes a new
value whose destination is found the same way.

`destinations(jaxpr, outputs)` answers for one program, given what each of its outputs is
(None where unknown): the walk asks it again for each nested body it enters, with the
destinations of the enclosing equation's results, so a body shared by two calls is named
in each by that call's results.
"""

from typing import Any

import jax.extend as jex

from .._base.primitives import DATA_MOVEMENT, VIEWS, is_var

# The operands whose data a data-movement equation's result holds; the others (indices,
# a predicate, a padding value) only say where or which. Unlisted: every operand.
_DATA_OPERANDS = {
    "dynamic_slice": slice(0, 1),
    "dynamic_update_slice": slice(0, 2),
    "gather": slice(0, 1),
    "scatter": slice(0, 3, 2),  # the operand and the updates
    "select_n": slice(1, None),
    "pad": slice(0, 1),
}
_POSITIONAL = frozenset({"device_put", "optimization_barrier"})


def _open(jaxpr: Any) -> Any:
    return getattr(jaxpr, "jaxpr", jaxpr)


def destinations(jaxpr: Any, outputs: list) -> dict:
    """Each variable of `jaxpr` that reaches an output unchanged, mapped to that output's
    entry in `outputs` (aligned with `jaxpr.outvars`; None: unknown). Only variables with
    a known destination are keys."""
    found: dict = {}
    for var, where in zip(jaxpr.outvars, outputs):
        if where is not None and is_var(var):
            found.setdefault(var, where)
    for eqn in reversed(jaxpr.eqns):
        results = [found.get(v) for v in eqn.outvars]
        if not any(r is not None for r in results):
            continue
        for var, where in _operand_destinations(eqn, results):
            if where is not None and is_var(var):
                found.setdefault(var, where)
    return found


def _operand_destinations(eqn: Any, results: list) -> list[tuple[Any, Any]]:
    """(operand, destination) for the operands of `eqn` whose data reaches a result whose
    destination is in `results`."""
    prim, invars = eqn.primitive.name, list(eqn.invars)
    if prim in _POSITIONAL:
        return list(zip(invars, results))
    if prim in VIEWS or prim in DATA_MOVEMENT:
        return [(v, results[0]) for v in invars[_DATA_OPERANDS.get(prim, slice(None))]]
    params = eqn.params
    if prim == "cond":
        pairs = []
        for branch in params["branches"]:
            branch = _open(branch)
            inner = destinations(branch, results)
            pairs += [(v, inner.get(b)) for v, b in zip(invars[1:], branch.invars)]
        return pairs
    if prim == "while":
        body = _open(params["body_jaxpr"])
        inner = destinations(body, results)
        return [(v, inner.get(b)) for v, b in zip(invars[params["cond_nconsts"] :], body.invars)]
    pairs = []
    for body in jex.core.jaxprs_in_params(params):  # scan, jit, remat, custom_*, compute_on
        body = _open(body)
        if len(body.invars) == len(invars) and len(body.outvars) == len(results):
            inner = destinations(body, results)
            pairs += [(v, inner.get(b)) for v, b in zip(invars, body.invars)]
    return pairs
