"""A streamed `ox.offload_optimizer` on whole leaves: the global part, then the per-leaf
transformation on each leaf at once. It equals the per-layer loop (the transformation is
elementwise within a leaf, checked by `init`); the host update computes it, with nothing
to fetch there."""

from collections.abc import Callable
from typing import Any, cast

import jax
import optax

from .masters import value_writer
from .state import StreamState, call_update


def whole_leaves(
    tx: optax.GradientTransformation,
    global_tx: optax.GradientTransformation,
    global_update: Callable[..., Any],
) -> optax.GradientTransformationExtraArgs:
    """`tx` on every leaf after `global_update(grads, global_state, params, extra_args)`;
    an `update` that writes the parameters' values when `tx` keeps masters."""

    def init(params: Any) -> Any:
        return StreamState(
            global_state=global_tx.init(params),
            leaves=jax.tree_util.tree_map(tx.init, params),
        )

    kind = _WholeLeaves if value_writer(tx) is None else _WholeLeavesWithMasters
    return optax.GradientTransformationExtraArgs(init, cast(Any, kind(tx, global_update)))


class _WholeLeaves:
    """The `update` of `whole_leaves`."""

    def __init__(self, tx: optax.GradientTransformation, global_update: Callable[..., Any]):
        self.tx = tx
        self.global_update = global_update

    def _per_leaf(self, updates: Any, state: Any, params: Any, extra_args: dict, step) -> Any:
        """The global part, then `step(gradient, leaf state, parameter or None, index)`
        on every leaf: `(the first results, StreamState of the second)`."""
        grads, global_state = self.global_update(updates, state.global_state, params, extra_args)
        leaves, treedef = jax.tree_util.tree_flatten(grads)
        states = treedef.flatten_up_to(state.leaves)
        given = [None] * len(leaves) if params is None else treedef.flatten_up_to(params)
        done = [step(g, s, p, i) for i, (g, s, p) in enumerate(zip(leaves, states, given))]
        firsts = jax.tree_util.tree_unflatten(treedef, [a for a, _ in done])
        new_leaves = jax.tree_util.tree_unflatten(treedef, [b for _, b in done])
        return firsts, StreamState(global_state=global_state, leaves=new_leaves)

    def __call__(self, updates: Any, state: Any, params: Any = None, **extra_args: Any) -> Any:
        tx = self.tx
        return self._per_leaf(
            updates,
            state,
            params,
            extra_args,
            lambda g, s, p, _: call_update(tx, g, s, p, extra_args),
        )


class _WholeLeavesWithMasters(_WholeLeaves):
    """`_WholeLeaves` whose per-leaf transformation keeps masters: it writes the
    parameters' new values (see `masters.MasterUpdate`)."""

    def values(self, grads: Any, state: Any, extra_args: dict, like: Any = None) -> Any:
        writer = value_writer(self.tx)
        likes = jax.tree_util.tree_leaves(grads if like is None else like)
        return self._per_leaf(
            grads,
            state,
            None,
            extra_args,
            lambda g, s, _, i: writer.values(g, s, extra_args, likes[i]),
        )
