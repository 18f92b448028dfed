"""Master weights: `ox.offload_optimizer(tx, master_dtype=jnp.float32)`.

Definition. The model holds its parameters `p` in their compute dtype (bfloat16, float16);
the optimizer state holds a master `m` of every trained parameter in `master_dtype` and
`tx`'s state `s`, initialised on the masters (so Adam's moments are float32 unless `tx`
says otherwise, e.g. `mu_dtype`). A step with gradients `g` (in the parameters' dtype, as
the backward pass made them) computes, in `master_dtype`,

    u, s' = tx.update(g.astype(master_dtype), s, m)
    m'    = m + u
    p'    = m'.astype(p.dtype)

so that updates smaller than the parameters' resolution accumulate in the masters instead
of being rounded away. `ox.update_and_apply` writes `p'` itself (exactly, on every path:
the host update, the delayed update, the streamed device update). `opt.update` returns
the updates `p' - p` rounded to the parameters' dtype, so `optax.apply_updates` gives
`p'` up to that rounding (exact while `p'` is within a factor of two of `p`: Sterbenz).

The masters are optimizer state that mirrors a parameter (`inner.master.layers.w1`
mirrors `layers.w1`), so the plan places and shards them like Adam's moments: in the
optimizer's memory, host by default. With the update on the host, the gradients cross the
link in their own dtype and the new parameters come back in theirs: 4 bytes per bfloat16
parameter per step, and no state crosses.
"""

from typing import Any, cast

import equinox as eqx
import jax
import jax.numpy as jnp
import optax

from .fused_adamw import fused_values
from .state import NAME, call_update, is_none

_NOT_A_FLOAT = (
    "{name}(master_dtype=...) is {value!r}; expected None (the parameters are the "
    "masters) or a floating-point dtype such as `jnp.float32` (a master of every trained "
    "parameter in that dtype, in the optimizer state)."
)


def check_master_dtype(value: Any) -> Any:
    """The dtype `value` names (None stays None); a `ValueError` naming the value if it
    is not a floating-point dtype."""
    if value is None:
        return None
    try:
        dtype = jnp.dtype(value)
    except TypeError:
        dtype = None
    if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(_NOT_A_FLOAT.format(name=NAME, value=value))
    return dtype


class Masters(eqx.Module):
    """The inner state of an optimizer with `master_dtype`: `master` has the parameters'
    structure (one master per trained parameter, None elsewhere), `state` is the wrapped
    transformation's state on the masters."""

    master: Any
    state: Any


def _cast_like(tree: Any, like: Any) -> Any:
    """Each leaf of `tree` in the dtype of the leaf of `like` at its place."""
    return jax.tree_util.tree_map(
        lambda x, y: None if x is None else x.astype(y.dtype), tree, like, is_leaf=is_none
    )


class MasterUpdate:
    """The `update` of `with_masters(tx, dtype)`. The optimizer's own paths ask it for the
    parameters' new values (`values`); `__call__` is optax's `update`, for callers who
    apply updates themselves."""

    def __init__(self, tx: optax.GradientTransformation, dtype: Any):
        self.tx = tx
        self.dtype = dtype

    def values(self, grads: Any, state: Masters, extra_args: dict, like: Any = None) -> Any:
        """`(new parameter values, new state)`: the masters updated by `tx` and cast to
        the dtypes of `like` (the parameters; by default the gradients, which the backward
        pass makes in the parameters' dtypes)."""
        like = grads if like is None else like

        def with_optax():
            wide = jax.tree_util.tree_map(lambda g: g.astype(self.dtype), grads)
            updates, inner = call_update(self.tx, wide, state.state, state.master, extra_args)
            master = optax.apply_updates(state.master, updates)
            return _cast_like(master, like), master, inner

        values, master, inner = fused_values(
            self.tx, grads, state.master, state.state, like, extra_args, otherwise=with_optax
        )
        return values, Masters(master, inner)

    def current(self, state: Masters, like: Any) -> Any:
        """The parameters' values the masters stand for, before an update."""
        return _cast_like(state.master, like)

    def __call__(self, grads: Any, state: Masters, params: Any = None, **extra_args: Any):
        like = grads if params is None else params
        new_values, new_state = self.values(grads, state, extra_args, like)
        base = self.current(state, like) if params is None else params
        updates = jax.tree_util.tree_map(
            lambda v, b: (v.astype(self.dtype) - b.astype(self.dtype)).astype(v.dtype),
            new_values,
            base,
        )
        return updates, new_state


def with_masters(tx: optax.GradientTransformation, dtype: Any):
    """`tx` on masters in `dtype` (see the module docstring)."""

    def init(params: Any) -> Masters:
        master = jax.tree_util.tree_map(lambda p: jnp.asarray(p).astype(dtype), params)
        return Masters(master, tx.init(master))

    return optax.GradientTransformationExtraArgs(
        cast(Any, init), cast(Any, MasterUpdate(tx, dtype))
    )


def value_writer(tx: Any) -> Any:
    """The object whose `values(grads, state, extra_args, like)` gives the parameters'
    new values when `tx` writes them (an optimizer with masters), else None."""
    update = getattr(tx, "update", None)
    return update if callable(getattr(update, "values", None)) else None


def step_values(tx: Any, grads: Any, state: Any, params: Any, extra_args: dict) -> Any:
    """`(new parameter values, new state)` of one update of `params`: written from the
    masters where `tx` keeps them, else `params + updates` in each parameter's dtype."""
    writer = value_writer(tx)
    if writer is not None:
        return writer.values(grads, state, extra_args, params)
    updates, new_state = call_update(tx, grads, state, params, extra_args)
    new_values = jax.tree_util.tree_map(
        lambda p, u: p if u is None else (p + u).astype(p.dtype),
        params,
        updates,
        is_leaf=is_none,
    )
    return new_values, new_state
