"""Which optax transformations can be streamed, decided by tracing them.

`stream="leaf"` applies the per-leaf transformation to one parameter at a time: every
update and state leaf must depend on one parameter only (`check_per_leaf`).
`stream="layer"` also applies it to one layer slice of a stacked parameter at a time:
it must be elementwise within the leaf (`check_elementwise`).
"""

from collections.abc import Sequence
from typing import Any

import equinox as eqx
import jax
import jax.extend
import numpy as np
import optax

from .._host.chunks import ELEMENTWISE
from .fused_adamw import optax_only
from .state import NAME, call_update, eval_shape


def _call_body(eqn: Any) -> Any:
    """The jaxpr an equation calls with its operands, one to one (`jit`, `closed_call`,
    `remat`, `custom_jvp_call`, ...), or None: its outputs depend on its inputs as the
    body's do, not all on all (a transformation written under `jax.jit` traces as one such
    equation with every leaf in and out)."""
    bodies = list(jax.extend.core.jaxprs_in_params(eqn.params))
    if len(bodies) != 1:
        return None
    body = getattr(bodies[0], "jaxpr", bodies[0])
    if len(body.invars) == len(eqn.invars) and len(body.outvars) == len(eqn.outvars):
        return body
    return None


def _leaf_dependencies(jaxpr: Any, labels: Sequence[frozenset]) -> list[frozenset]:
    """For each output of `jaxpr`, the union of the labels of the inputs it depends on
    (conservative: every output of an equation depends on all its inputs, except through
    a call, whose body is followed)."""
    deps: dict[Any, frozenset] = dict(zip(jaxpr.invars, labels))

    def of(var: Any) -> frozenset:
        return (
            frozenset() if isinstance(var, jax.extend.core.Literal) else deps.get(var, frozenset())
        )

    for eqn in jaxpr.eqns:
        body = _call_body(eqn)
        if body is not None:
            deps.update(zip(eqn.outvars, _leaf_dependencies(body, [of(v) for v in eqn.invars])))
            continue
        found = frozenset().union(*(of(v) for v in eqn.invars))
        for var in eqn.outvars:
            deps[var] = found
    return [
        frozenset() if isinstance(v, jax.extend.core.Literal) else deps.get(v, frozenset())
        for v in jaxpr.outvars
    ]


def _arrays_and_values(state: Any) -> tuple[Any, Any]:
    """An abstract state's arrays (`ShapeDtypeStruct`s), traced, and its Python values
    (an int, a string), which the trace closes over."""
    return eqx.partition(state, lambda x: isinstance(x, jax.ShapeDtypeStruct))


def check_per_leaf(transform: optax.GradientTransformation, params: Any) -> None:
    """Raise a `ValueError` unless `transform`, traced on all of `params` at once, computes
    every update and every new state leaf from the gradient and value of one parameter.

    Elementwise transformations (`adam`, `adamw`, `sgd`, `lion`, `rmsprop`, ...) and
    per-parameter ones (`scale_by_trust_ratio`, `adafactor`) pass; `clip_by_global_norm`
    and anything else that reduces over several parameters fails, naming the leaves.
    """
    params = eqx.filter(params, eqx.is_inexact_array)
    abstract = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), params)
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(abstract)[0]]
    if len(paths) < 2:
        return
    state, values = _arrays_and_values(eval_shape(transform.init, abstract))

    def update(grads, state, params):
        out = call_update(transform, grads, eqx.combine(state, values), params, {})
        return eqx.filter(out, eqx.is_array)

    with optax_only():  # the definition's dependencies, not the host kernel's
        closed, out_shape = jax.make_jaxpr(update, return_shape=True)(abstract, state, abstract)
    n_state = len(jax.tree_util.tree_leaves(state))
    own = [frozenset([i]) for i in range(len(paths))]
    labels = own + [frozenset()] * n_state + own
    deps = _leaf_dependencies(closed.jaxpr, labels)
    out_paths = [
        ("update" if i == 0 else "new state") + jax.tree_util.keystr(p)
        for i, part in enumerate(out_shape)
        for p, _ in jax.tree_util.tree_flatten_with_path(part)[0]
    ]
    for out_path, dep in zip(out_paths, deps):
        if len(dep) > 1:
            names = ", ".join(f"`{paths[i]}`" for i in sorted(dep)[:3])
            raise ValueError(
                f"{NAME}(stream=...): the transformation `tx` couples parameters: its "
                f"{out_path} depends on the gradients or values of {names}. Only "
                "transformations that treat each parameter on its own (adam, adamw, sgd, "
                "lion, ...) can be applied one parameter at a time; pass global ones such as "
                "`optax.clip_by_global_norm` as `global_transform=`, or pass "
                "`stream=None` to update the whole state at once."
            )


def _elementwise_outputs(jaxpr: Any, aligned: Sequence[bool], shape: tuple) -> list[bool]:
    """Propagate "depends on the stacked leaf, element by element" through `jaxpr`: a
    transformation built from `ELEMENTWISE` primitives alone, traced on a stacked leaf,
    treats every layer slice on its own.

    `aligned[k]` says whether input `k` is such a value (of the leaf's shape). Returns the
    same flag for each output, or raises `_NotElementwise` at the first equation that
    mixes elements of an aligned value (a reduction, a matmul, a reshape, ...).
    """
    flags: dict[Any, bool] = dict(zip(jaxpr.invars, aligned))

    def flag(var: Any) -> bool:
        return False if isinstance(var, jax.extend.core.Literal) else flags.get(var, False)

    for eqn in jaxpr.eqns:
        ins = [flag(v) for v in eqn.invars]
        if not any(ins):
            outs = [False] * len(eqn.outvars)
        elif eqn.primitive.name in ELEMENTWISE and all(
            np.shape(v.aval) in ((), shape) for v in eqn.invars
        ):
            outs = [True] * len(eqn.outvars)
        elif eqn.primitive.name == "broadcast_in_dim" and tuple(eqn.params["shape"]) == tuple(
            np.shape(eqn.invars[0].aval)
        ):
            outs = [True]
        elif "jaxpr" in eqn.params or "call_jaxpr" in eqn.params:
            inner = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
            inner = getattr(inner, "jaxpr", inner)
            if len(inner.invars) != len(eqn.invars):
                raise _NotElementwise(eqn.primitive.name)
            outs = _elementwise_outputs(inner, ins, shape)
        else:
            raise _NotElementwise(eqn.primitive.name)
        for var, out in zip(eqn.outvars, outs):
            flags[var] = out
    return [flag(v) for v in jaxpr.outvars]


class _NotElementwise(Exception):
    pass


def is_stacked(leaf: Any, layers: int | None) -> bool:
    shape = np.shape(leaf)
    return layers is not None and len(shape) >= 1 and shape[0] == layers


def check_elementwise(transform: optax.GradientTransformation, leaf: Any, path: str = "") -> None:
    """Raise a `ValueError` unless `transform`, traced on the one parameter `leaf`, computes
    each element of the update and of every state leaf of the parameter's shape from the
    same element of the gradient, the parameter and the state (scalars such as Adam's
    count may be shared), and every other state leaf is a scalar.

    That is what updating a stacked leaf one layer slice at a time needs: `adam`, `adamw`,
    `sgd`, `lion` pass; `scale_by_trust_ratio` (a norm over the leaf) and `adafactor`
    (factored moments) do not.
    """
    shape = tuple(np.shape(leaf))
    abstract = jax.ShapeDtypeStruct(shape, leaf.dtype)
    state, values = _arrays_and_values(eval_shape(transform.init, abstract))
    where = f" on `{path}`" if path else ""
    for state_leaf in jax.tree_util.tree_leaves(state):
        if np.shape(state_leaf) not in ((), shape):
            raise ValueError(
                f"{NAME}(stream='layer'): the transformation `tx`{where} keeps a state "
                f"leaf of shape {np.shape(state_leaf)} for a parameter of shape {shape}, "
                "so it cannot be updated one layer slice at a time. Only state leaves "
                "shaped like the parameter, or scalars, can be streamed; pass "
                "`stream='leaf'` to update stacked leaves whole."
            )

    def update(grad, state, param):
        out = call_update(transform, grad, eqx.combine(state, values), param, {})
        return eqx.filter(out, eqx.is_array)

    with optax_only():  # the definition's operations, not the host kernel's
        closed = jax.make_jaxpr(update)(abstract, state, abstract)
    aligned = [True] + [np.shape(x) == shape for x in jax.tree_util.tree_leaves(state)] + [True]
    try:
        _elementwise_outputs(closed.jaxpr, aligned, shape)
    except _NotElementwise as error:
        raise ValueError(
            f"{NAME}(stream='layer'): the transformation `tx`{where} is not elementwise: "
            f"it applies `{error.args[0]}` to the whole parameter, so updating one layer "
            "slice at a time would change its result. Pass `stream='leaf'` to update "
            "stacked leaves whole, or use an elementwise transformation (adam, adamw, sgd, "
            "lion, ...)."
        ) from None
