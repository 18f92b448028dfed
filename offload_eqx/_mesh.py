"""Meshes: placements whose partition specs shard leaves over the one mesh the user gives.

A placement's `spec` names mesh axes. The mesh is given once (`ox.place(model, mesh=mesh)`
or `ox.filter_jit(..., mesh=mesh)`); afterwards it is found on the placed arrays
themselves, so the jitted step, the optimizer's `init` and later `ox.place` calls need no
`mesh=`. Every leaf's sharding is then a `NamedSharding(mesh, spec, memory_kind=...)`.

Both axis types work. Under `Auto` axes the compiler propagates shardings through the
program and the outputs keep the shardings it chose; under `Explicit` axes the sharding
is part of each traced type, so the outputs get exactly the shardings of their types.
"""

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import equinox as eqx
import jax
import numpy as np
from jax.core import Tracer
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding, PartitionSpec

from ._plan import LeafPlan, format_path

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
        # `_jit._typed` wraps single-device shardings in a one-device mesh to type
        # abstract arguments; that mesh is an implementation detail, not the user's.
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
                found = (f"`{format_path(root, path)}`", mesh)
            elif mesh != found[1]:
                raise ValueError(
                    _TWO_MESHES.format(
                        first=found[0],
                        first_mesh=describe_mesh(found[1]),
                        second=format_path(root, path),
                        second_mesh=describe_mesh(mesh),
                    )
                )
    if given is not None:
        return given
    return None if found is None else found[1]


def _axes(entry: Any) -> tuple[str, ...]:
    if entry is None or entry is PartitionSpec.UNCONSTRAINED:
        return ()
    if isinstance(entry, (tuple, list)):
        return tuple(entry)
    return (entry,)


def spec_problem(path: str, shape: Sequence[int], spec: PartitionSpec, mesh: AnyMesh) -> str | None:
    """Why `spec` cannot shard an array of `shape` over `mesh`, or None if it can."""
    sizes = dict(mesh.shape)
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


def no_mesh_error(leaf_plan: LeafPlan) -> ValueError:
    return ValueError(_NO_MESH.format(path=leaf_plan.path, spec=leaf_plan.spec))


def mesh_sharding(
    mesh: AnyMesh, leaf_plan: LeafPlan, current: jax.sharding.Sharding | None
) -> NamedSharding:
    """The planned `NamedSharding` of a leaf over `mesh`.

    A leaf with a spec is sharded by it. A leaf without one keeps the spec it already has
    on this mesh (a batch the user sharded, a leaf placed earlier) and is otherwise
    replicated. Optimizer state inherits its parameter's spec, but a state leaf whose
    shape the spec does not fit (a factored second moment, a scalar) is replicated.
    """
    memory = leaf_plan.memory or getattr(current, "memory_kind", None) or "device"
    spec = leaf_plan.spec
    if spec is None:
        if isinstance(current, NamedSharding) and current.mesh == mesh:
            spec = current.spec
        else:
            spec = PartitionSpec()
    elif leaf_plan.role == "optimizer":
        if spec_problem(leaf_plan.path, leaf_plan.shape, spec, mesh) is not None:
            spec = PartitionSpec()
    else:
        check_spec(leaf_plan.path, leaf_plan.shape, spec, mesh)
    return NamedSharding(mesh, spec, memory_kind=memory)


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


def shard(
    x: Any,
    spec: PartitionSpec,
    mesh: AnyMesh | None = None,
    *,
    memory: str = "device",
) -> Any:
    """Shard an array (or every array of a pytree) over a mesh: a batch or an activation.

    **Arguments:**

    - `x`: an array or a pytree of arrays.
    - `spec`: a `PartitionSpec` over mesh axis names, e.g. `P('data')` for a batch.
    - `mesh`: the mesh. Inside `ox.filter_jit` it defaults to the step's mesh.
    - `memory`: `"device"` or `"pinned_host"` (outside a trace only).

    Outside a trace this is one explicit transfer (also onto a mesh spanning several
    processes: each process passes the same whole value). Inside a trace it constrains
    the sharding of an activation (`reshard` under `Explicit` axes,
    `with_sharding_constraint` under `Auto` axes).
    """
    from ._context import active_plan

    if not isinstance(spec, PartitionSpec):
        raise TypeError(
            f"ox.shard(x, spec={spec!r}): the spec is a {type(spec).__name__}; expected a "
            "`jax.sharding.PartitionSpec`, e.g. `P('data')`."
        )
    leaves = jax.tree_util.tree_flatten_with_path(x)[0]
    traced = any(isinstance(leaf, Tracer) for _, leaf in leaves)
    if mesh is None:
        plan = active_plan() if traced else None
        mesh = None if plan is None else plan.mesh
        if mesh is None:
            mesh = resolve_mesh([("x", x)])
    check_mesh(mesh, where="ox.shard(mesh=...)")
    if mesh is None:
        raise ValueError(
            f"ox.shard(x, {spec}) was given no mesh, is not inside an `ox.filter_jit` with "
            "a mesh, and `x` is on no mesh. Pass the mesh: `ox.shard(x, spec, mesh)`."
        )
    for path, leaf in leaves:
        if eqx.is_array(leaf):
            check_spec(format_path("x", path), np.shape(leaf), spec, mesh)

    def one(leaf):
        if not eqx.is_array(leaf):
            return leaf
        if traced:
            if any(t == AxisType.Explicit for t in mesh.axis_types):
                return jax.sharding.reshard(leaf, NamedSharding(mesh, spec))
            return jax.lax.with_sharding_constraint(leaf, NamedSharding(mesh, spec))
        return put(leaf, NamedSharding(mesh, spec, memory_kind=memory))

    return jax.tree_util.tree_map(one, x)


def output_shardings(
    mesh: AnyMesh,
    arguments: tuple[tuple, dict],
    in_shardings: Sequence[Any],
    is_dynamic: Callable[[Any], bool],
    out_cell: list,
    out_avals: Sequence[Any],
) -> tuple[NamedSharding | None, ...]:
    """The shardings of a program's outputs over `mesh`: an output that has the structure
    of an argument (the updated model, the new optimizer state, updates shaped like the
    parameters) keeps that argument's shardings, leaf by leaf.

    Leaving them to the compiler is not enough: under `Auto` axes XLA may return a
    replicated bias sharded, and the next step's planned input sharding would then not
    match. Other outputs (the loss, metrics) get `output_sharding`.
    """
    args, kwargs = arguments
    shardings = iter(in_shardings)
    candidates = []
    for arg in (*args, *(kwargs[key] for key in sorted(kwargs))):
        leaves, treedef = jax.tree_util.tree_flatten(arg)
        per_leaf: list[tuple | None] = []
        for leaf in leaves:
            if not is_dynamic(leaf):
                per_leaf.append(None)
                continue
            sharding = next(shardings)
            if sharding is None:
                sharding = getattr(leaf, "sharding", None)
            if isinstance(sharding, NamedSharding) and sharding.mesh == mesh:
                per_leaf.append((tuple(np.shape(leaf)), np.dtype(leaf.dtype), sharding.spec))
            else:
                per_leaf.append(None)
        candidates.append((treedef, per_leaf))

    out_treedef, _, out_mask = out_cell
    matched = _match_subtrees(out_treedef, candidates)
    dynamic_indices = [i for i, dynamic in enumerate(out_mask) if dynamic]
    result = []
    for index, aval in zip(dynamic_indices, out_avals):
        memory = "pinned_host" if aval.memory_space == jax.memory.Space.Host else "device"
        info = matched.get(index)
        if info is not None and info[:2] == (tuple(aval.shape), np.dtype(aval.dtype)):
            result.append(NamedSharding(mesh, info[2], memory_kind=memory))
        else:
            result.append(output_sharding(aval, mesh, memory))
    return tuple(result)


def _match_subtrees(treedef: Any, candidates: list[tuple[Any, list]]) -> dict[int, Any]:
    """For each leaf index of `treedef`, the information of the candidate leaf at the same
    place in the first candidate structure that a subtree containing it has."""
    placeholders = jax.tree_util.tree_unflatten(treedef, list(range(treedef.num_leaves)))
    matched: dict[int, Any] = {}

    def visit(subtree: Any) -> None:
        indices, sub_treedef = jax.tree_util.tree_flatten(subtree)
        for candidate, per_leaf in candidates:
            if sub_treedef == candidate:
                for index, info in zip(indices, per_leaf):
                    if info is not None:
                        matched.setdefault(index, info)
                return
        children = jax.tree_util.tree_flatten(subtree, is_leaf=lambda x: x is not subtree)[0]
        for child in children:
            if child is not subtree:
                visit(child)

    visit(placeholders)
    return matched


def mirror_parameters(shardings: Any, state: Any, params: Any, mesh: AnyMesh) -> Any:
    """Shard optimizer state shaped like the parameters (Adam's `mu` and `nu`) exactly
    like them, keeping each leaf's planned memory kind. Other state keeps its planned
    sharding (replicated, or its own spec)."""
    infos = []
    param_leaves, param_treedef = jax.tree_util.tree_flatten(params)
    for leaf in param_leaves:
        sharding = getattr(leaf, "sharding", None)
        if isinstance(sharding, NamedSharding) and sharding.mesh == mesh:
            infos.append((tuple(np.shape(leaf)), np.dtype(leaf.dtype), sharding.spec))
        else:
            infos.append(None)
    state_leaves, state_treedef = jax.tree_util.tree_flatten(state)
    matched = _match_subtrees(state_treedef, [(param_treedef, infos)])
    planned, planned_treedef = jax.tree_util.tree_flatten(shardings, is_leaf=lambda x: x is None)
    if len(planned) != len(state_leaves):
        return shardings
    result = []
    for index, (leaf, sharding) in enumerate(zip(state_leaves, planned)):
        info = matched.get(index)
        if (
            isinstance(sharding, NamedSharding)
            and info is not None
            and info[:2] == (tuple(np.shape(leaf)), np.dtype(leaf.dtype))
        ):
            sharding = NamedSharding(mesh, info[2], memory_kind=sharding.memory_kind)
        result.append(sharding)
    return jax.tree_util.tree_unflatten(planned_treedef, result)
