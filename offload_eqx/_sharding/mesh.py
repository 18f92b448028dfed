"""Meshes: placements whose partition specs shard leaves over the one mesh the user gives.

A placement's `spec` names mesh axes. The mesh is given once (`ox.place(model, mesh=mesh)`
or `ox.filter_jit(..., mesh=mesh)`); afterwards it is found on the placed arrays
themselves, so the jitted step, the optimizer's `init` and later `ox.place` calls need no
`mesh=`. Every leaf's sharding is then a `NamedSharding(mesh, spec, memory_kind=...)`.

Both axis types work. Under `Auto` axes the compiler propagates shardings through the
program and the outputs keep the shardings it chose; under `Explicit` axes the sharding
is part of each traced type, so the outputs get exactly the shardings of their types.
"""

import functools
from collections.abc import Iterable, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding, PartitionSpec

AnyMesh = Mesh | AbstractMesh

_NO_MESH = (
    "Leaf `{path}` has the partition spec {spec}, but no mesh was given and none of the "
    "arrays passed is on a mesh, so there is nothing to shard it over. Give the mesh "
    "once: `ox.place(model, mesh=mesh)` (later calls find it on the placed arrays) or "
    "`ox.filter_jit(..., mesh=mesh)`; or drop the spec to keep the leaf on one device."
)
_UNKNOWN_AXIS = (
    "Leaf `{path}` has the partition spec {spec}, which names the mesh axis {axis!r}, but "
    "the mesh has the axes {allowed}. Use one of those names in the spec, or give a mesh "
    "that has an axis named {axis!r} (e.g. `jax.make_mesh(..., axis_names=(..., {axis!r}))`)."
)
_TOO_LONG = (
    "Leaf `{path}` of shape {shape} has the partition spec {spec} with {length} entries, "
    "but the leaf has only {ndim} dimensions. Give at most one entry per dimension (None "
    "for a dimension that is not sharded)."
)
_INDIVISIBLE = (
    "Leaf `{path}` of shape {shape} has the partition spec {spec}, which splits "
    "dimension {dim} (size {size}) over the mesh axes {axes}, that is over {count} "
    "devices; {size} is not a multiple of {count}. That dimension can only be split over "
    "axes whose sizes multiply to a divisor of {size} (axis sizes: {sizes}). Shard "
    "another dimension, use fewer or smaller axes, or pad the array."
)
_DUPLICATE_AXIS = (
    "Leaf `{path}` has the partition spec {spec}, which uses the mesh axis {axis!r} twice: "
    "an array dimension can be split over an axis only once. Name each axis at most once "
    "in the spec, e.g. `P({axis!r}, None)`."
)
_TWO_MESHES = (
    "Arrays from two different meshes are used together: {first} is on {first_mesh}, and "
    "`{second}` is on {second_mesh}. One program runs on one mesh: place every array on "
    "the same mesh, e.g. `ox.place(tree, mesh=mesh)` for each pytree with the same `mesh`."
)
_NOT_A_MESH = (
    "{where} was given {value!r}, a {kind}; expected a `jax.sharding.Mesh` (e.g. "
    "`jax.make_mesh((2, 4), ('data', 'fsdp'))`), a `jax.sharding.AbstractMesh`, or None."
)


def describe_mesh(mesh: AnyMesh) -> str:
    axes = ", ".join(f"{name!r}: {size}" for name, size in mesh.shape.items())
    types = {str(t).rsplit(".", 1)[-1] for t in mesh.axis_types}
    return f"the mesh {{{axes}}} ({'/'.join(sorted(types))} axes)"


def check_mesh(mesh: object, *, where: str) -> None:
    """Validate a `mesh=` option when a wrapper is built, not when it is first called."""
    if mesh is not None and not isinstance(mesh, (Mesh, AbstractMesh)):
        raise TypeError(_NOT_A_MESH.format(where=where, value=mesh, kind=type(mesh).__name__))


def _mesh_of_leaf(leaf: Any) -> Mesh | None:
    sharding = getattr(leaf, "sharding", None)
    if isinstance(sharding, NamedSharding) and isinstance(sharding.mesh, Mesh):
        # `typed` wraps single-device shardings in a one-device mesh to type abstract
        # arguments; that mesh is an implementation detail, not the user's.
        if sharding.mesh.axis_names != ("_device",):
            return sharding.mesh
    return None


def resolve_mesh(roots: Iterable[tuple[str, Any]], given: AnyMesh | None = None) -> AnyMesh | None:
    """The mesh for these pytrees: `given`, or else the mesh their sharded leaves share.

    Single-device arrays are on no mesh (they are moved onto it). Two different meshes,
    among the leaves or between a leaf and `given`, are an error naming both.
    """
    check_mesh(given, where="mesh=")
    found: tuple[str, Mesh] | None = None
    if isinstance(given, Mesh):
        found = ("the mesh given as `mesh=`", given)
    for root, tree in roots:
        for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
            mesh = _mesh_of_leaf(leaf)
            if mesh is None:
                continue
            if found is None:
                found = (f"`{_path(root, path)}`", mesh)
            elif mesh != found[1]:
                raise ValueError(
                    _TWO_MESHES.format(
                        first=found[0],
                        first_mesh=describe_mesh(found[1]),
                        second=_path(root, path),
                        second_mesh=describe_mesh(mesh),
                    )
                )
    if given is not None:
        return given
    return None if found is None else found[1]


def _path(root: str, keys: Any) -> str:
    return root + jax.tree_util.keystr(tuple(keys), simple=False, separator="")


def _axes(entry: Any) -> tuple[str, ...]:
    if entry is None or entry is PartitionSpec.UNCONSTRAINED:
        return ()
    if isinstance(entry, (tuple, list)):
        return tuple(entry)
    return (entry,)


def spec_problem(path: str, shape: Sequence[int], spec: PartitionSpec, mesh: AnyMesh) -> str | None:
    """Why `spec` cannot shard an array of `shape` over `mesh`, or None if it can."""
    sizes = dict(mesh.shape)
    used: list[str] = []
    for entry in spec:
        for axis in _axes(entry):
            if axis in used:
                return _DUPLICATE_AXIS.format(path=path, spec=spec, axis=axis)
            used.append(axis)
    for entry in spec:
        for axis in _axes(entry):
            if axis not in sizes:
                allowed = ", ".join(repr(a) for a in sizes)
                return _UNKNOWN_AXIS.format(path=path, spec=spec, axis=axis, allowed=allowed)
    if len(spec) > len(shape):
        return _TOO_LONG.format(
            path=path, shape=tuple(shape), spec=spec, length=len(spec), ndim=len(shape)
        )
    for dim, (entry, size) in enumerate(zip(spec, shape)):
        axes = _axes(entry)
        count = int(np.prod([sizes[a] for a in axes], dtype=np.int64))
        if size % count:
            return _INDIVISIBLE.format(
                path=path,
                shape=tuple(shape),
                spec=spec,
                dim=dim,
                size=size,
                axes=", ".join(repr(a) for a in axes),
                count=count,
                sizes=", ".join(f"{a!r}: {sizes[a]}" for a in axes),
            )
    return None


def check_spec(path: str, shape: Sequence[int], spec: PartitionSpec, mesh: AnyMesh) -> None:
    problem = spec_problem(path, shape, spec, mesh)
    if problem is not None:
        raise ValueError(problem)


def leaf_sharding(
    entry: dict[str, Any], mesh: AnyMesh | None, specs_need_a_mesh: bool, device: Any
) -> Any:
    """A leaf's planned sharding (`entry` holds its `path`, `shape`, `role`, planned
    `memory`, declared `spec` and `current` sharding): over the mesh a `NamedSharding`
    with its spec (a leaf without one keeps the spec it has on this mesh, or is
    replicated; an optimizer-state leaf the mirrored spec does not fit is replicated);
    off a mesh its current sharding in its planned memory (on `device` when it has none
    yet: an uncommitted array, an abstract one)."""
    memory, current, spec = entry["memory"], entry["current"], entry["spec"]
    if mesh is not None:
        memory = memory or getattr(current, "memory_kind", None) or "device"
        if spec is None:
            on_mesh = isinstance(current, NamedSharding) and current.mesh == mesh
            spec = current.spec if on_mesh else PartitionSpec()
        elif entry["role"] == "optimizer":
            if spec_problem(entry["path"], entry["shape"], spec, mesh) is not None:
                spec = PartitionSpec()
        else:
            check_spec(entry["path"], entry["shape"], spec, mesh)
        return NamedSharding(mesh, spec, memory_kind=memory)
    if spec is not None and entry["role"] != "optimizer" and specs_need_a_mesh:
        raise ValueError(_NO_MESH.format(path=entry["path"], spec=spec))
    if current is None:
        return jax.sharding.SingleDeviceSharding(device, memory_kind=memory or "device")
    if memory is None or current.memory_kind == memory:
        return current
    return current.with_memory_kind(memory)


def output_sharding(aval: Any, mesh: AnyMesh, memory: str) -> NamedSharding | None:
    """The sharding of one output of a program over `mesh`.

    Under `Explicit` axes the traced type carries the sharding: use it. Under `Auto`
    axes the type says nothing, so leave it to the compiler (None): the output keeps
    the sharding XLA propagated, and its memory kind follows its type (`<host>` outputs
    come back in `pinned_host`).
    """
    spec = getattr(getattr(aval, "sharding", None), "spec", None)
    if spec is not None and any(t == AxisType.Explicit for t in mesh.axis_types):
        return NamedSharding(mesh, spec, memory_kind=memory)
    return None


def same_place(current: jax.sharding.Sharding, planned: jax.sharding.Sharding, ndim: int) -> bool:
    """Whether an argument is where the plan puts it. Off a mesh only the memory kind is
    compared (as before meshes); over a mesh the sharding too."""
    if current.memory_kind != planned.memory_kind:
        return False
    if isinstance(planned, NamedSharding) and planned.mesh.size > 1:
        return current.is_equivalent_to(planned, ndim)
    return True


def put(x: Any, sharding: jax.sharding.Sharding) -> jax.Array:
    """`jax.device_put`, also onto a mesh spanning several processes.

    Across processes every process passes the same whole value and keeps its own shards.
    """
    if isinstance(x, jax.Array) and x.sharding == sharding:
        return x
    if sharding.is_fully_addressable or (isinstance(x, jax.Array) and not x.is_fully_addressable):
        return jax.device_put(x, sharding)
    value = np.asarray(x)
    return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])


@functools.cache
def _single_device_mesh(device: Any) -> jax.sharding.Mesh:
    return jax.sharding.Mesh(np.array([device]), ("_device",))


_EMPTY_MESH = jax.sharding.AbstractMesh((), ())


def traced_type(sharding: Any) -> Any:
    """The sharding that types a `jax.ShapeDtypeStruct` exactly as jit types a concrete
    array of `sharding`: off a mesh, a sharding over the empty abstract mesh in that
    memory (`f32<host>[...]`), so that a program traced on abstract values and one
    traced on the arrays themselves have the same types; over a mesh, `sharding`."""
    if isinstance(sharding, jax.sharding.SingleDeviceSharding):
        return jax.sharding.NamedSharding(
            _EMPTY_MESH, jax.sharding.PartitionSpec(), memory_kind=sharding.memory_kind
        )
    return sharding


def typed(sharding: Any) -> Any:
    """A sharding that types a `jax.ShapeDtypeStruct` by its memory kind.

    A `ShapeDtypeStruct` with a `SingleDeviceSharding(..., memory_kind="pinned_host")`
    traces as device memory; the equivalent `NamedSharding` traces as `<host>`.
    """
    if isinstance(sharding, jax.sharding.SingleDeviceSharding):
        (device,) = sharding.device_set
        return jax.sharding.NamedSharding(
            _single_device_mesh(device),
            jax.sharding.PartitionSpec(),
            memory_kind=sharding.memory_kind,
        )
    return sharding
