"""Modules whose own `__call__` uses their host-resident fields bring their own region.

A module that declares `w: jax.Array = ox.field(memory="pinned_host")` and computes with
`self.w` in its `__call__` cannot run outside a region: the weight must be fetched inside
one. So every class that declares a field with `ox.field` has its `__call__` (and its other
public methods, such as `generate`) wrapped when the class is made: when the module holds
host-resident arrays directly under such fields (no region fetched them), the call runs in
`ox.checkpoint` (as `ox.annotate` does for modules you cannot edit). A module under such a
field brings a region of its own instead, as if `ox.annotate` had selected it, so that
`ox.scan` over a stacked module there fetches one layer at a time. A module whose fields
are all on the device is called as it was written, so device placements compile exactly as
before.
"""

import dataclasses
import functools
from typing import Any

import equinox as eqx
import jax

from .._declare.placement import ON_DECLARING_CLASS, field_placement
from .._sharding.memory_space import is_host_typed
from .annotate import (
    REGION_ATTRIBUTE,
    Call,
    copy_as,
    original_classes,
    region_class,
    region_methods,
)
from .regions import checkpoint


def owns_host_leaves(module: Any) -> bool:
    """Whether a field the module declares with `ox.field` holds a host-typed array."""
    for f in dataclasses.fields(module):
        if field_placement(f) is None:
            continue
        value = getattr(module, f.name, None)
        if any(is_host_typed(x) for x in jax.tree_util.tree_leaves(value)):
            return True
    return False


def _is_module(x: Any) -> bool:
    return isinstance(x, eqx.Module)


def _delegated(x: Any) -> bool:
    """A module that brings its own region under a declared field: one holding host-typed
    arrays. An `eqx.nn.Shared` only returns the modules it ties, to be called by the
    class's method: it stays with the class, whose region fetches it."""
    return (
        _is_module(x)
        and not isinstance(x, eqx.nn.Shared)
        and any(is_host_typed(leaf) for leaf in jax.tree_util.tree_leaves(x))
    )


def _split(module: Any) -> tuple[Any, dict[str, Any]]:
    """The modules under the fields `module` declares with `ox.field` that hold
    host-typed arrays bring their own region, as if `ox.annotate` had selected them, so
    that `ox.scan(self.layers, x)` fetches one layer at a time and a frozen backbone is
    not fetched again for the backward pass of what follows it: `(module without them,
    {field: them, each of a region_class})`. The arrays the fields hold directly stay
    with the module, whose region fetches them."""
    delegated: dict[str, Any] = {}
    for f in dataclasses.fields(module):
        value = getattr(module, f.name, None)
        if field_placement(f) is None or not any(
            _delegated(x) for x in jax.tree_util.tree_leaves(value, is_leaf=_is_module)
        ):
            continue
        delegated[f.name] = jax.tree_util.tree_map(
            lambda x: copy_as(x, region_class(type(x))) if _delegated(x) else None,
            value,
            is_leaf=_is_module,
        )
    if not delegated:
        return module, delegated
    stub = copy_as(module, type(module))
    for name in delegated:
        value = jax.tree_util.tree_map(
            lambda x: None if _delegated(x) else x,
            getattr(module, name),
            is_leaf=_is_module,
        )
        object.__setattr__(stub, name, value)
    return stub, delegated


def _joined(stub: Any, delegated: dict[str, Any]) -> Any:
    joined = copy_as(stub, type(stub))
    for name, modules in delegated.items():
        value = eqx.combine(getattr(stub, name), modules, is_leaf=_is_module)
        object.__setattr__(joined, name, value)
    return joined


class _CallWith(eqx.Module):
    """`method(module joined with the modules it delegates, ...)`: those modules are an
    argument of the region, which does not fetch them (each brings its own region)."""

    module: Any
    method: Any = eqx.field(static=True)

    def __call__(self, delegated, *args, **kwargs):
        return self.method(_joined(self.module, delegated), *args, **kwargs)


def _own_region(method: Any) -> Any:
    @functools.wraps(method)
    def in_region(self, *args, **kwargs):
        stub, delegated = _split(self)
        if not delegated:
            if not owns_host_leaves(self):
                return method(self, *args, **kwargs)
            return checkpoint(Call(self, method), *args, **kwargs)
        if not owns_host_leaves(stub):
            out = method(_joined(stub, delegated), *args, **kwargs)
        else:
            out = checkpoint(_CallWith(stub, method), delegated, *args, **kwargs)
        return original_classes(out)

    return in_region


def _bring_region(owner: type) -> None:
    """Wrap `__call__` and the public methods (`generate`, ...) the class defines."""
    if vars(owner).get(REGION_ATTRIBUTE, False) or not issubclass(owner, eqx.Module):
        return
    for name, method in region_methods(owner, inherited=False).items():
        setattr(owner, name, _own_region(method))
    setattr(owner, REGION_ATTRIBUTE, True)


ON_DECLARING_CLASS.append(_bring_region)
