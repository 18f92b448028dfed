"""`ox.place`: move every array leaf to the memory its plan gives it."""

from typing import Any

import equinox as eqx
import jax

from ._context import type_matches
from ._mesh import put
from ._plan import Plan
from ._strategy import Strategy, resolve_strategy


def planned_shardings(
    tree: Any,
    strategy: "str | Strategy | None" = None,
    *,
    mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh | None = None,
    name: str = "tree",
) -> Any:
    """A pytree like `tree` holding each array leaf's planned sharding (None elsewhere)."""
    plan = Plan([(name, tree)], resolve_strategy(strategy), mesh)
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    plans = iter(plan.leaves)
    shardings = []
    for leaf in leaves:
        if eqx.is_array(leaf) or isinstance(leaf, jax.ShapeDtypeStruct):
            leaf_plan = next(plans)
            current = getattr(leaf, "sharding", None)
            shardings.append(plan.sharding(leaf_plan, current))
        else:
            shardings.append(None)
    return jax.tree_util.tree_unflatten(treedef, shardings)


def place(
    tree: Any,
    strategy: "str | Strategy | None" = None,
    *,
    mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh | None = None,
) -> Any:
    """Move every array leaf of `tree` to the memory (and sharding) its plan gives it.

    **Arguments:**

    - `tree`: a model, an optimizer state, or any pytree of them.
    - `strategy`: a strategy name (`"baseline"`, `"hybrid"`, ...) or an `ox.Strategy`;
        by default the model's own annotations.
    - `mesh`: the mesh over which leaves with a `spec` are sharded.

    Leaves that nothing manages stay where they are. Each move is one explicit
    `jax.device_put`; leaves already in place are not copied. Returns a new pytree.
    """
    shardings = planned_shardings(tree, strategy, mesh=mesh)

    def move(leaf, sharding):
        if sharding is None or not eqx.is_array(leaf):
            return leaf
        if isinstance(leaf, jax.Array) and leaf.sharding == sharding and type_matches(leaf):
            return leaf
        moved = put(leaf, sharding)  # also onto a mesh spanning several processes
        if not type_matches(moved):
            # device_put returns an array already in place unchanged, even when its type
            # disagrees with its memory kind; retype it with an explicit move.
            space = (
                jax.memory.Space.Host
                if sharding.memory_kind == "pinned_host"
                else jax.memory.Space.Device
            )
            moved = jax.device_put(moved, space)
        return moved

    return jax.tree_util.tree_map(move, tree, shardings, is_leaf=lambda x: x is None)
