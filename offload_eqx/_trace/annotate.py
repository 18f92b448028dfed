"""Annotating modules you cannot edit (the `eqx.nn` layers) from outside.

`ox.annotate(model, where, memory=...)` works like `eqx.tree_at`: `where` selects
modules or fields, and the result is a copy of the model in which the selected modules
are instances of a subclass whose fields carry the placement metadata. The subclass keeps
the original `__call__`, so the model computes exactly as before and
`isinstance(layer, eqx.nn.Linear)` still holds.
"""

import contextlib
import dataclasses
import functools
import inspect
from collections.abc import Callable
from typing import Any, cast

import equinox as eqx
import jax
from jax.sharding import PartitionSpec

from .._declare.activations import Activations, check_name, check_policy
from .._declare.placement import METADATA_KEY, Memory, Placement, check_memory
from .._plan.remat_policy import MODULE_SCOPE
from .._plan.walk import ANNOTATION_ATTRIBUTE, format_keys, holds_an_array
from .._sharding.memory_space import is_host_typed
from .regions import call_in_region, name_boundary
from .state import argument_path, current, inside_region

_SUBCLASSES: dict[tuple, type] = {}
# Set on the classes whose `__call__` brings its own region.
REGION_ATTRIBUTE = "__offload_eqx_region__"
# Set on the classes `region_class` makes: the class they were made from.
ORIGINAL_ATTRIBUTE = "__offload_eqx_original__"


class _Marker:
    """Wraps a node selected by `where` while the tree is rebuilt."""

    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value


class Call(eqx.Module):
    """`method(module, ...)`: the original `__call__` of an annotated module, as a module
    whose arrays a region sees (and fetches)."""

    module: Any
    method: Any = eqx.field(static=True)

    def __call__(self, *args, **kwargs):
        return self.method(self.module, *args, **kwargs)


@dataclasses.dataclass(frozen=True)
class Boundary:
    """The names an annotated module gives the floating-point arrays of its call's first
    argument (`inputs`) and of what the call returns (`outputs`)."""

    inputs: str | None = None
    outputs: str | None = None

    def __bool__(self) -> bool:
        return self.inputs is not None or self.outputs is not None


def with_region(method: Any, boundary: Boundary = Boundary(), region: bool = True) -> Any:
    """A method of an annotated module (its `__call__`, or another public method such as
    `generate`): the original one, inside a region (so the module's host-resident
    leaves are fetched there, and its activations follow the step's strategy), unless
    a region that fetched its leaves encloses it. Outside `ox.filter_jit`, a module whose
    arrays are all on the device runs as written, exactly as the unannotated one. With
    a `boundary`, its input and output carry the names it declares: at the boundary of
    its own region, or inside the enclosing one."""

    @functools.wraps(method)
    def in_region(self, *args, **kwargs):
        own = _holds_host_arrays(self) or (current() is not None and not inside_region())
        if region and own:
            path = _module_path(self)
            with jax.named_scope(MODULE_SCOPE + path) if path else contextlib.nullcontext():
                return call_in_region(
                    Call(self, method), args, kwargs, boundary.inputs, boundary.outputs
                )
        if args and boundary.inputs is not None:
            args = (name_boundary(args[0], boundary.inputs), *args[1:])
        return name_boundary(method(self, *args, **kwargs), boundary.outputs)

    return in_region


def _module_path(module: Any) -> str | None:
    """The plan path of a module whose leaves are arguments of the step being traced
    (`model.blocks[2]`), found from one of its leaves; None for a module made inside
    the step, or outside `ox.filter_jit`."""
    for keys, leaf in jax.tree_util.tree_flatten_with_path(module)[0]:
        path = argument_path(leaf)
        suffix = format_keys(keys)
        if path is not None and path.endswith(suffix):
            return path[: len(path) - len(suffix)] or None
    return None


# Methods that answer a question about the layer rather than compute with its arrays
# (`eqx.nn.Sequential` asks each layer `is_stateful()` while it runs).
_PROTOCOL = frozenset(vars(eqx.nn.StatefulLayer)) - {"__call__"}


def region_methods(cls: type, inherited: bool = True) -> dict[str, Any]:
    """The methods of `cls` that bring a region: `__call__` and every public method
    (`generate`, `sample`, `encode`, ...), each of which may compute with the module's
    host-resident leaves. With `inherited`, those its base classes define too (an
    annotated `eqx.nn` layer, or a model with a `generate` method)."""
    found: dict[str, Any] = {}
    seen: set[str] = set()  # the nearest class's attribute of a name is the one in use
    classes = [c for c in cls.__mro__ if issubclass(c, eqx.Module) and c is not eqx.Module]
    for klass in classes if inherited else [cls]:
        for name, value in vars(klass).items():
            if name in seen:
                continue
            seen.add(name)
            public = name == "__call__" or not name.startswith("_")
            if public and name not in _PROTOCOL and inspect.isfunction(value):
                found[name] = value
    return found


def _holds_host_arrays(module: Any) -> bool:
    return any(is_host_typed(x) for x in jax.tree_util.tree_leaves(module))


def _annotated_class(
    cls: type,
    fields: frozenset[tuple[str, Placement]],
    activations: Activations | None,
    region: bool = False,
    boundary: Boundary = Boundary(),
) -> type:
    key = (cls, fields, activations, region, boundary)
    try:
        return _SUBCLASSES[key]
    except KeyError:
        pass
    originals = {f.name: f for f in dataclasses.fields(cls)}
    namespace: dict[str, Any] = {"__annotations__": {}, "__module__": cls.__module__}
    for name, placement in fields:
        original = originals[name]
        metadata = dict(original.metadata)
        metadata[METADATA_KEY] = placement
        namespace["__annotations__"][name] = original.type
        namespace[name] = dataclasses.field(
            default=original.default,
            default_factory=original.default_factory,
            init=original.init,
            repr=original.repr,
            hash=original.hash,
            compare=original.compare,
            metadata=metadata,
            kw_only=original.kw_only,
        )
    if activations is not None:
        inherited = getattr(cls, ANNOTATION_ATTRIBUTE, None)
        merged = dict(inherited.items()) if inherited is not None else {}
        merged.update(activations.items())
        namespace[ANNOTATION_ATTRIBUTE] = Activations(**merged)
    if region and fields:
        namespace.update({name: with_region(m) for name, m in region_methods(cls).items()})
        namespace[REGION_ATTRIBUTE] = True
    call = region_methods(cls).get("__call__")
    if boundary and call is not None:  # no call: its names are never produced (an error)
        namespace["__call__"] = with_region(call, boundary, region)
    # Pickled by what it was made from: the class itself is made here, so pickle cannot
    # find it by name (a copy or a checkpoint of an annotated model would fail).
    namespace["__reduce__"] = lambda self: (_rebuild, (key, _field_values(self)))
    subclass = type(cls.__name__, (cls,), namespace)
    # The node type of the annotated module differs from the plain one's, so a tree built
    # from the plain model does not map over it: JAX's error names both types, which
    # this suffix tells apart (they would both read `<class '...Linear'>`).
    suffix = " (annotated)"
    subclass.__qualname__ = cls.__qualname__ + ("" if cls.__qualname__.endswith(suffix) else suffix)
    _SUBCLASSES[key] = subclass
    return subclass


def _field_values(module: eqx.Module) -> dict[str, Any]:
    return {
        f.name: vars(module)[f.name] for f in dataclasses.fields(module) if f.name in vars(module)
    }


def _rebuild(key: tuple, values: dict[str, Any]) -> eqx.Module:
    """An annotated module from its annotation and field values (see `__reduce__`)."""
    new = object.__new__(_annotated_class(*key))
    for name, value in values.items():
        object.__setattr__(new, name, value)
    return new


def region_class(cls: type) -> type:
    """`cls` with each of its region methods bringing a region as an annotated module's
    do, and its fields as they are: the class of a module held under a field declared
    with `ox.field`, while the class declaring the field runs (see `own_regions`)."""
    key = (cls, "region")
    subclass = _SUBCLASSES.get(key)
    if subclass is None:
        namespace: dict[str, Any] = {"__annotations__": {}, "__module__": cls.__module__}
        namespace.update({name: with_region(m) for name, m in region_methods(cls).items()})
        namespace[REGION_ATTRIBUTE] = True
        namespace[ORIGINAL_ATTRIBUTE] = cls
        subclass = _SUBCLASSES[key] = type(cls.__name__, (cls,), namespace)
        subclass.__qualname__ = cls.__qualname__
    return subclass


def original_classes(tree: Any) -> Any:
    """`tree` with every module of a `region_class` back in its own class."""

    def is_made(x: Any) -> bool:
        return ORIGINAL_ATTRIBUTE in vars(type(x))

    def back(x: Any) -> Any:
        return copy_as(x, vars(type(x))[ORIGINAL_ATTRIBUTE]) if is_made(x) else x

    return jax.tree_util.tree_map(back, tree, is_leaf=is_made)


def copy_as(module: eqx.Module, cls: type) -> eqx.Module:
    new = object.__new__(cls)
    for f in dataclasses.fields(module):
        try:
            object.__setattr__(new, f.name, getattr(module, f.name))
        except AttributeError:
            pass
    return new


def _array_fields(module: eqx.Module) -> list[str]:
    """The fields of a selected module that hold arrays: a memory applies to those. The
    others (an `eqx.nn.MLP`'s activation, a `BatchNorm`'s axis name, a `Shared`'s `where`
    function, a `Linear`'s missing bias) are left alone."""
    names = []
    for f in dataclasses.fields(module):
        if f.metadata.get("static", False):
            continue
        value = getattr(module, f.name, None)
        if any(holds_an_array(x) for x in jax.tree_util.tree_leaves(value)):
            names.append(f.name)
    return names


def _elements(value: Any) -> Any:
    """A selected list, tuple or dict of modules stands for its elements: each module in
    it is selected on its own (and brings its own region), so that `lambda m: m.blocks`
    means what `lambda m: m.blocks[:]` means, not one region fetching every block at
    once. An `eqx.nn.Shared` stands for the modules it ties (its `__call__` only returns
    them, to be called outside it). Anything else is returned as it is."""
    if isinstance(value, eqx.nn.Shared):
        inner = _elements(value.pytree)
        return value if inner is value.pytree else eqx.tree_at(lambda s: s.pytree, value, inner)
    if isinstance(value, dict):
        items = list(value.values())
    elif type(value) in (list, tuple):
        items = list(value)
    else:
        return value
    if not any(isinstance(item, eqx.Module) for item in items):
        return value
    mark = lambda item: _Marker(item) if isinstance(item, eqx.Module) else item  # noqa: E731
    if isinstance(value, dict):
        return {key: mark(item) for key, item in value.items()}
    return type(value)(mark(item) for item in items)


def _checked(
    where: Any,
    memory: str | None,
    spec: PartitionSpec | None,
    activations: Activations | dict[str, str] | None,
    inputs: str | None,
    outputs: str | None,
) -> tuple[Placement | None, Activations | None, Boundary]:
    """`ox.annotate`'s arguments checked, before any work: the placement, the
    activations and the boundary names they declare."""
    if memory is None and activations is None and inputs is None and outputs is None:
        raise ValueError(
            "ox.annotate(...) was given none of `memory=`, `activations=`, `inputs=` or "
            "`outputs=`: there is nothing to annotate. Pass memory='pinned_host' (or "
            "'device'), and/or activations={'name': 'offload'}, and/or inputs='name'."
        )
    if not callable(where):
        raise TypeError(
            f"ox.annotate(tree, where={where!r}): `where` is a function selecting nodes of "
            "the tree, as in `eqx.tree_at`, e.g. `lambda m: m.layers[0]`."
        )
    placement = None
    if memory is not None:
        check_memory(memory, where="ox.annotate(memory=...)")
        placement = Placement(memory=cast(Memory, memory), spec=spec)
    if isinstance(activations, dict):
        for name, policy in activations.items():
            check_policy(name, policy, where="ox.annotate(activations=...)")
        activations = Activations(**activations)
    for argument, name in (("inputs", inputs), ("outputs", outputs)):
        if name is not None:
            check_name(name, where=f"ox.annotate({argument}=...)")
    return placement, activations, Boundary(inputs, outputs)


def annotate(
    tree: Any,
    where: Callable[[Any], Any],
    *,
    memory: str | None = None,
    spec: PartitionSpec | None = None,
    activations: Activations | dict[str, str] | None = None,
    inputs: str | None = None,
    outputs: str | None = None,
    region: bool = True,
) -> Any:
    """Declare placements and activation policies on modules you cannot edit.

    **Arguments:**

    - `tree`: the model (any pytree containing `eqx.Module`s).
    - `where`: like `eqx.tree_at`'s, selects one node or a sequence of nodes: a module
        (every array field of it gets the placement) or an array field of a module.
    - `memory`: `"device"` or `"pinned_host"`; marks the selected leaves as managed.
    - `spec`: an optional `PartitionSpec` for the selected leaves.
    - `activations`: per-name policies (`{"h": "offload"}` or `ox.Activations(...)`)
        declared on the selected modules.
    - `inputs`, `outputs`: names for the floating-point arrays of each selected module's
        input (the first argument of its `__call__`) and output, as `ox.name` would give
        them inside the module: a block's input offloaded from outside the library that
        wrote it (`inputs="block_input", activations={"block_input": "offload"}`, what
        MaxText calls `decoder_layer_input=offload`). The name applies at the boundary of
        the module's region (or inside the region that encloses the call: `ox.scan`).
    - `region`: with `memory=` (or `inputs=`/`outputs=`), each selected module (or the
        module owning a selected field) runs its `__call__` (and, with `memory=`, its
        other public methods) in a remat region when no region fetched its leaves, so
        its host-resident leaves are fetched there, one module at a time, under every
        strategy; its cost is that of `ox.checkpoint` (the call is recomputed in the
        backward pass unless the strategy saves everything). `region=False` opts out:
        call the module through `ox.scan`/`ox.checkpoint` yourself.

    **Returns:** a copy of `tree`; the original is not changed.

    ```python
    mlp = ox.annotate(mlp, lambda m: m.layers, memory="pinned_host")
    mlp = ox.annotate(mlp, lambda m: m, activations={"h": "offload"})
    lm = ox.annotate(lm, lambda m: m.blocks, inputs="x", activations={"x": "offload"})
    ```
    """
    placement, activations, boundary = _checked(where, memory, spec, activations, inputs, outputs)
    marked = eqx.tree_at(where, tree, replace_fn=_Marker)

    def rebuild(node: Any, path: str) -> Any:
        if isinstance(node, _Marker) and _elements(node.value) is not node.value:
            return rebuild(_elements(node.value), path)
        if isinstance(node, _Marker):
            inner = rebuild(node.value, path)
            if not isinstance(inner, eqx.Module):
                raise ValueError(
                    f"ox.annotate: `where` selected `{path}`, a "
                    f"{type(inner).__name__} that is not a field of a module. Select a "
                    "module (every array field of it is annotated) or a whole field of a "
                    "module, e.g. `lambda m: m.layers[0]` or `lambda m: m.layers[0].weight`."
                )
            fields = (
                frozenset((name, placement) for name in _array_fields(inner))
                if placement
                else frozenset()
            )
            if not fields and activations is None and not boundary:
                return inner  # no arrays to place (an `eqx.nn.Lambda` in a list of layers)
            annotated = _annotated_class(type(inner), fields, activations, region, boundary)
            return copy_as(inner, annotated)
        if isinstance(node, eqx.Module):
            overrides = []
            values = {}
            for f in dataclasses.fields(node):
                try:
                    value = getattr(node, f.name)
                except AttributeError:
                    continue
                child_path = f"{path}.{f.name}"
                if isinstance(value, _Marker) and _elements(value.value) is not value.value:
                    value = _elements(value.value)  # a list of modules: its elements
                elif isinstance(value, _Marker) and not isinstance(value.value, eqx.Module):
                    if (activations is not None and placement is None) or boundary:
                        what = "inputs and outputs" if boundary else "activations"
                        raise ValueError(
                            f"ox.annotate: `where` selected the field `{child_path}`, but "
                            f"{what} are declared on modules. Select the module "
                            f"`{path}` instead."
                        )
                    overrides.append((f.name, placement))
                    value = value.value
                values[f.name] = rebuild(value, child_path)
            cls = type(node)
            if overrides:
                cls = _annotated_class(cls, frozenset(overrides), None, region)
            new = object.__new__(cls)
            for name, value in values.items():
                object.__setattr__(new, name, value)
            return new
        if eqx.is_array(node) or node is None:
            return node
        children = jax.tree_util.tree_flatten_with_path(node, is_leaf=lambda x: x is not node)[0]
        if len(children) == 1 and children[0][1] is node:
            return node
        return jax.tree_util.tree_map_with_path(
            lambda keys, child: rebuild(child, path + format_keys(keys)),
            node,
            is_leaf=lambda x: x is not node,
        )

    return rebuild(marked, "tree")
