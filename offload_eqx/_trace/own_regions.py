"""Modules whose own `__call__` uses their host-resident fields bring their own region.

A module that declares `w: jax.Array = ox.field(memory="pinned_host")` and computes with
`self.w` in its `__call__` cannot run outside a region: the weight must be fetched inside
one. So every class that declares a field with `ox.field` has its `__call__` (and its other
public methods, such as `generate`) wrapped when the class is made: when the module holds
host-resident arrays under such fields and no region encloses the call, the call runs in
`ox.checkpoint` (as `ox.annotate` does for modules you cannot edit). A module whose fields
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
from .annotate import REGION_ATTRIBUTE, Call, region_methods
from .regions import checkpoint
from .state import inside_region


def owns_host_leaves(module: Any) -> bool:
    """Whether a field the module declares with `ox.field` holds a host-typed array."""
    for f in dataclasses.fields(module):
        if field_placement(f) is None:
            continue
        value = getattr(module, f.name, None)
        if any(is_host_typed(x) for x in jax.tree_util.tree_leaves(value)):
            return True
    return False


def _own_region(method: Any) -> Any:
    @functools.wraps(method)
    def in_region(self, *args, **kwargs):
        if inside_region() or not owns_host_leaves(self):
            return method(self, *args, **kwargs)
        return checkpoint(Call(self, method), *args, **kwargs)

    return in_region


def _bring_region(owner: type) -> None:
    """Wrap `__call__` and the public methods (`generate`, ...) the class defines."""
    if vars(owner).get(REGION_ATTRIBUTE, False) or not issubclass(owner, eqx.Module):
        return
    for name, method in region_methods(owner, inherited=False).items():
        setattr(owner, name, _own_region(method))
    setattr(owner, REGION_ATTRIBUTE, True)


ON_DECLARING_CLASS.append(_bring_region)
