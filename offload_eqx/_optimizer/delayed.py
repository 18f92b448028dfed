"""The delayed update, `ox.offload_optimizer(..., delay=1)` (ZeRO-Offload's delayed
parameter update).

Definition. With parameters `p_t` and the gradient `g_t = grad L(p_t, batch_t)` of step
`t`, a step of the delayed update returns

    p_{t+1} = p_t + U(g_{t-1}, s_{t-1}, p_t)        (p_{t+1} = p_t at the first step)

and keeps `g_t` for the next step: each gradient is applied one step late, to the
parameters of the step after the one that computed it. `U` is the wrapped optax
transformation and `s` its state, updated only when a gradient is applied. The update of
a step therefore reads nothing that step computes: with the update on the host, its host
computation depends on the step's inputs alone, and XLA runs it while the device computes
the forward and backward passes (XLA:GPU's schedule issues the host call before the
loops, or after the forward loop when the backward loop alone covers it, and waits for
it after them).

The state is `Delayed(state, pending, ready)`: the transformation's state, the gradient
waiting to be applied (shaped and placed like the parameters, in the optimizer state's
memory) and whether one is waiting (False after `init` and after `ox.apply_pending`).
It is part of the optimizer state, so a checkpoint of the state holds the pending
gradient and a restarted run continues exactly.
"""

from collections.abc import Callable
from typing import Any, cast

import equinox as eqx
import jax
import jax.numpy as jnp
import optax

from .state import call_update, cond, eval_shape

DELAYS = (0, 1)


class Delayed(eqx.Module):
    """The inner state of `ox.offload_optimizer(..., delay=1)`: `state` is the wrapped
    transformation's, `pending` the last step's gradients (the parameters' structure:
    `pending.layers.w` mirrors `layers.w`), `ready` whether they are still to be applied."""

    state: Any
    pending: Any
    ready: Any


class DelayedUpdate:
    """The `update` of the delayed transformation: applies the pending gradients (if any)
    and keeps the new ones. Host updates find `tx` on it and split the two, so that the
    host computation never waits for the step's own gradients."""

    def __init__(self, tx: optax.GradientTransformation):
        self.tx = tx

    def __call__(self, grads: Any, state: Delayed, params: Any = None, **extra_args: Any):
        def full():
            return call_update(self.tx, state.pending, state.state, params, extra_args)

        def kept(shapes):
            return zeros(shapes[0]), state.state

        labels = ("updates", "opt_state.inner.state")
        updates, inner = when_ready(state.ready, full, kept, labels)
        return updates, Delayed(inner, as_pending(grads, state.pending), jnp.asarray(True))


def delayed(tx: optax.GradientTransformation) -> optax.GradientTransformationExtraArgs:
    """`tx` with a one-step delay (see the module docstring)."""

    def init(params: Any) -> Delayed:
        pending = jax.tree_util.tree_map(jnp.zeros_like, params)
        return Delayed(tx.init(params), pending, jnp.asarray(False))

    return optax.GradientTransformationExtraArgs(cast(Any, init), cast(Any, DelayedUpdate(tx)))


def as_pending(grads: Any, pending: Any) -> Any:
    """The step's gradients as the new pending ones, each in the dtype of the pending
    gradient it replaces, so that the state's types never change between steps (an
    optimizer with masters initialised from float32 parameters keeps float32 pending
    gradients for a bfloat16 model)."""
    return jax.tree_util.tree_map(lambda g, old: g.astype(old.dtype), grads, pending)


def delayed_tx(inner: Any) -> optax.GradientTransformation | None:
    """The wrapped transformation when `inner` is a delayed one, else None."""
    update = getattr(inner, "update", None)
    return update.tx if isinstance(update, DelayedUpdate) else None


def zeros(shapes: Any) -> Any:
    """Zeros of the shapes and dtypes of `shapes` (None leaves stay None)."""
    return jax.tree_util.tree_map(
        lambda s: None if s is None else jnp.zeros(s.shape, s.dtype),
        shapes,
        is_leaf=lambda x: x is None,
    )


def when_ready(
    ready: Any, full: Callable[[], Any], kept: Callable[[Any], Any], labels: tuple[str, ...]
) -> Any:
    """`full()` when `ready` (a boolean scalar, or None: always), else `kept(shapes)`,
    where `shapes` are `full()`'s output shapes: a `jax.lax.cond`, so that the first
    step of a delayed update (nothing pending) changes neither the parameters nor the
    state (Adam's count, weight decay). Python values of the state are the same either
    way (an error naming the value otherwise; `labels` names `full()`'s results)."""
    if ready is None:
        return full()
    shapes = eval_shape(full)

    def skip():
        out = kept(shapes)
        return jax.tree_util.tree_map(
            lambda x, s: jnp.asarray(x).astype(s.dtype) if hasattr(s, "dtype") else x,
            out,
            shapes,
            is_leaf=lambda x: x is None,
        )

    without = "after a step that applies no gradient (the first one with `delay=1`)"
    return cond(ready, full, skip, without=without, labels=labels)
