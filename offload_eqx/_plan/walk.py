"""Reading annotations off pytrees: each array leaf's declared placement, each declared name.

The walk follows pytrees by key path and reads the placement metadata of `eqx.Module`
fields (`ox.field`, `ox.annotate`) and the activation declarations (`ox.activations`,
`ox.annotate(..., activations=...)`). A declaration applies to every array under its
field; an inner declaration wins over an outer one. The plan (`plan`) turns what the
walk finds into placements under a strategy and a mesh.
"""

import dataclasses
from collections.abc import Sequence
from typing import Any

import equinox as eqx
import jax
import numpy as np

from .._base.equinox_private import SharedNode
from .._declare.activations import Activations, Policy
from .._declare.placement import Placement, field_placement

# Set by `ox.annotate` on the subclasses it makes: their activation declarations.
ANNOTATION_ATTRIBUTE = "__offload_eqx_activations__"

# The array types the plan places: the leaves `ox.filter_jit` traces.
ARRAY_TYPES = (jax.Array, np.ndarray, np.generic, jax.ShapeDtypeStruct)

_NON_ARRAY_FIELD = (
    "Field `{path}` is declared with `ox.field(memory={memory!r})` but holds {value!r} (a "
    "{kind}), not an array: only arrays have a memory. Declare it with `eqx.field(...)` "
    "(or `eqx.field(static=True)` for a hyperparameter), or store arrays in it "
    "(`jnp.asarray(...)`)."
)

# Marks a subtree whose module field declarations are ignored: a copy of the model kept
# by an optax state (Adam's mu and nu) outside `ox.offload_optimizer` is not the model.
_MIRROR = Placement(memory="device", role="param")


# Where `eqx.nn.Shared` ties a leaf to another, its pytree holds this marker instead of
# the array, which `Shared.__call__` puts back: an array, as far as placements go.
_SHARED_NODE: Any = SharedNode


def holds_an_array(x: Any) -> bool:
    """An array leaf, or the place of one (a leaf `eqx.nn.Shared` ties to another)."""
    return is_array_leaf(x) or isinstance(x, _SHARED_NODE)


def is_array_leaf(x: Any) -> bool:
    """An array the plan places: a `jax.Array` (tracers included), a NumPy array or
    scalar (uploaded once, explicitly), or a `jax.ShapeDtypeStruct`."""
    return isinstance(x, ARRAY_TYPES)


def format_keys(keys: Any) -> str:
    """`.layers[0].weight` for a key path (a tuple of JAX keys)."""
    return jax.tree_util.keystr(tuple(keys), simple=False, separator="")


def _leaves_of(value: Any) -> list[Any]:
    return jax.tree_util.tree_leaves(value)


def _children(node: Any) -> list[tuple[tuple, Any]]:
    """One level of a pytree node's children, with their keys."""
    children, _ = jax.tree_util.tree_flatten_with_path(node, is_leaf=lambda x: x is not node)
    return children


@dataclasses.dataclass
class Annotations:
    """What the walk found: a placement per array-leaf path (None: not managed), and the
    declared activation names with their policy and the module that declared them."""

    placements: dict[str, Placement | None] = dataclasses.field(default_factory=dict)
    names: list[tuple[str, Policy, str]] = dataclasses.field(default_factory=list)


def walk(node: Any, path: str, inherited: Placement | None, found: Annotations) -> None:
    """Record the placement of every array leaf under `node` (whose path is `path`)."""
    if is_array_leaf(node) or node is None:
        found.placements[path] = None if inherited is _MIRROR else inherited
        return
    if isinstance(node, eqx.nn.StateIndex) and not _is_optimizer(inherited):
        # A stateful layer's initial state (`BatchNorm`'s running statistics before
        # `eqx.nn.make_with_state`) is not a parameter: no memory declared above applies.
        # The optimizer's state for it (Adam's moments of a trained initial state) is
        # optimizer state like the rest, and lives where the optimizer keeps its state.
        inherited = None
    if isinstance(node, eqx.Module):
        extra = getattr(type(node), ANNOTATION_ATTRIBUTE, None)
        if extra is not None:
            found.names.extend((name, policy, path) for name, policy in extra.items())
        for f in dataclasses.fields(node):
            try:
                value = getattr(node, f.name)
            except AttributeError:
                continue
            if f.metadata.get("static", False):
                if isinstance(value, Activations):
                    found.names.extend((name, policy, path) for name, policy in value.items())
                continue
            declared = field_placement(f)
            if _is_optimizer(inherited) or inherited is _MIRROR:
                # Optimizer state mirrors the model: the model's field declarations do not
                # apply inside it.
                declared = None
            if declared is not None:
                _check_holds_arrays(f"{path}.{f.name}", value, declared)
            walk(value, f"{path}.{f.name}", declared or inherited, found)
        return
    if isinstance(node, tuple) and hasattr(node, "_fields") and inherited is None:
        # A NamedTuple outside `ox.offload_optimizer` is an optax state (or the like): its
        # copies of the model are not the model, so they stay wherever they are.
        inherited = _MIRROR
    for key, child in _children(node):
        if child is node:  # a leaf that is not an array (a function, a string, ...)
            return
        walk(child, path + format_keys(key), inherited, found)


def _is_optimizer(placement: Placement | None) -> bool:
    return placement is not None and placement.role == "optimizer"


def _check_holds_arrays(path: str, value: Any, declared: Placement) -> None:
    """A field declared with a memory must hold arrays (or nothing) under it."""
    leaves = _leaves_of(value)
    non_arrays = [x for x in leaves if not holds_an_array(x)]
    if non_arrays and not any(holds_an_array(x) for x in leaves):
        shown = value if len(repr(value)) <= 60 else non_arrays[0]
        raise ValueError(
            _NON_ARRAY_FIELD.format(
                path=path, value=shown, kind=type(shown).__name__, memory=declared.memory
            )
        )


def match_subtrees(
    treedef: Any, candidates: Sequence[tuple[Any, tuple]], unique: bool = False
) -> dict[int, Any]:
    """For each leaf index of `treedef`, the entry at the same place in the first
    candidate structure that a subtree containing it has. With `unique`, each candidate
    matches one subtree at most (the first, in leaf order). A candidate whose structure
    is None matches nothing."""
    placeholders = jax.tree_util.tree_unflatten(treedef, list(range(treedef.num_leaves)))
    matched: dict[int, Any] = {}
    used: set[int] = set()

    def visit(subtree: Any) -> None:
        indices, sub_treedef = jax.tree_util.tree_flatten(subtree)
        for number, (candidate, entries) in enumerate(candidates):
            if (
                candidate is not None
                and sub_treedef == candidate
                and not (unique and number in used)
            ):
                used.add(number)
                for index, entry in zip(indices, entries):
                    if entry is not None:
                        matched.setdefault(index, entry)
                return
        children = jax.tree_util.tree_flatten(subtree, is_leaf=lambda x: x is not subtree)[0]
        for child in children:
            if child is not subtree:
                visit(child)

    visit(placeholders)
    return matched


def format_path(root: str, keys: Any) -> str:
    """`model.layers.w1`: an argument's label followed by a key path."""
    return root + format_keys(keys)
