"""What a call writes into the dicts and lists it was given, carried out of a region.

A region (`ox.checkpoint`, the region an annotated module or a class declaring `ox.field`
brings) runs its call on copies of the arguments: `jax.checkpoint` flattens them and
rebuilds them inside. A method that updates a container it was given in place (a decoding
step writing `cache[self.layer_idx] = state`) would update the copy only, and the caller's
cache would stay as it was. So the region notes, after the call, which containers of its
arguments the call changed, returns their new contents as outputs of the region, and
writes them into the caller's containers: the call behaves as it does without the region.
"""

import dataclasses
from typing import Any

import jax

from .._plan.walk import format_keys

_LOOP_WRITE = (
    "ox.scan: the layers write into the {kind} `{path}`, an argument passed to every "
    "layer. The layers run as one `jax.lax.scan` body, traced once for all of them, so "
    "what a layer writes into a container it was given cannot reach the caller. Carry "
    "the container instead and return its new value (`x, cache = ox.scan(block, (x, "
    "cache))`, each layer returning `(x, cache)`), or call the layers in a Python loop."
)


@dataclasses.dataclass(frozen=True)
class _Container:
    """A value written into a container that is one of the call's own containers (its
    position among them): the caller's container at that position, not a copy."""

    index: int


@dataclasses.dataclass(frozen=True)
class _Argument:
    """A value written into a container that is an argument leaf, unchanged (its
    position among the leaves): the caller's leaf, not the region's copy of it."""

    position: int


def containers(tree: Any) -> list[tuple[Any, tuple]]:
    """The dicts and lists reachable in `tree` through pytree nodes, each with its key
    path, in an order that depends only on the tree's structure (a copy of the tree made
    by flattening and rebuilding it lists its copies in the same order)."""
    found: list[tuple[Any, tuple]] = []

    def visit(node: Any, keys: tuple) -> None:
        if isinstance(node, (dict, list)):
            found.append((node, keys))
        children = jax.tree_util.tree_flatten_with_path(node, is_leaf=lambda x: x is not node)[0]
        for key, child in children:
            if child is node:  # a leaf
                return
            visit(child, keys + tuple(key))

    visit(tree, ())
    return found


def _contents(container: Any) -> list:
    """What a container holds, each value as an object (compared by identity)."""
    return list(container.items()) if isinstance(container, dict) else list(container)


def _same(container: Any, before: list, after: list) -> bool:
    if len(before) != len(after):
        return False
    if isinstance(container, dict):  # items: (key, value)
        return all(k == j and v is w for (k, v), (j, w) in zip(before, after))
    return all(v is w for v, w in zip(before, after))


class Snapshot:
    """The containers of a call's arguments (inside a region), as they were before the
    call: `changes()` after the call says what it wrote."""

    def __init__(self, arguments: Any):
        self.found = containers(arguments)
        self.before = [_contents(c) for c, _ in self.found]
        self.leaves = {id(x): i for i, x in enumerate(jax.tree_util.tree_leaves(arguments))}
        self.kept = jax.tree_util.tree_leaves(arguments)  # keeps the ids above unique

    def changes(self) -> list[tuple[int, str, list]]:
        """`(index, kind, new contents)` for each container the call changed; the new
        contents refer to the call's own containers and unchanged argument leaves by
        position, so that `write_back` puts the caller's own objects there."""
        own = {id(c): i for i, (c, _) in enumerate(self.found)}
        changed = []
        for index, ((container, _), before) in enumerate(zip(self.found, self.before)):
            after = _contents(container)
            if _same(container, before, after):
                continue
            if isinstance(container, dict):
                encoded = [(key, self._encode(value, own)) for key, value in after]
                changed.append((index, "dict", encoded))
            else:
                changed.append((index, "list", [self._encode(v, own) for v in after]))
        return changed

    def _encode(self, value: Any, own: dict[int, int]) -> Any:
        if id(value) in own and self.found[own[id(value)]][0] is value:
            return _Container(own[id(value)])
        position = self.leaves.get(id(value))
        if position is not None and self.kept[position] is value:
            return _Argument(position)
        return value


def write_back(arguments: Any, changes: list[tuple[int, str, list]]) -> None:
    """Write the new contents of the changed containers into the caller's `arguments`
    (the tree the region's arguments were copied from)."""
    if not changes:
        return
    targets = [c for c, _ in containers(arguments)]
    leaves = jax.tree_util.tree_leaves(arguments)

    def decode(value: Any) -> Any:
        if isinstance(value, _Container):
            return targets[value.index]
        if isinstance(value, _Argument):
            return leaves[value.position]
        return value

    for index, kind, contents in changes:
        target = targets[index]
        if kind == "dict":
            items = [(key, decode(value)) for key, value in contents]
            target.clear()
            target.update(items)
        else:
            target[:] = [decode(value) for value in contents]


def refuse_layer_writes(snapshot: Snapshot, changes: list[tuple[int, str, list]]) -> None:
    """In the body of `ox.scan` (whose region's arguments are `((carry, *args), kwargs)`)
    a write into an argument passed to every layer cannot be carried out: say so, naming
    it. A write into the carry is the layer's business: the carry it returns holds it."""
    for index, kind, _ in changes:
        keys = snapshot.found[index][1]
        if keys[:2] == (jax.tree_util.SequenceKey(0), jax.tree_util.SequenceKey(0)):
            continue
        if keys[0] == jax.tree_util.SequenceKey(0):
            position = getattr(keys[1], "idx") - 1  # a `SequenceKey`
            path = f"args[{position}]" + format_keys(keys[2:])
        else:
            path = "kwargs" + format_keys(keys[1:])
        raise TypeError(_LOOP_WRITE.format(kind=kind, path=path))
