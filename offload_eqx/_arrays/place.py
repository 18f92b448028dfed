"""Moving arrays to where the plan puts them: `ox.place` for pytrees, `ox.shard` for batches
and activations."""

from typing import Any

import equinox as eqx
import jax
import numpy as np
from jax.core import Tracer
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from .._declare.placement import check_memory
from .._declare.strategy import Strategy
from .._plan.plan import Plan
from .._plan.walk import format_keys, format_path
from .._sharding.memory_space import match_type as match_type, retyped, to_host, type_matches
from .._sharding.mesh import AnyMesh, check_mesh, check_spec, put, resolve_mesh, typed
from .._trace.state import active_plan

_DELETED_LEAF = (
    "{caller}: `{path}` has been deleted: it was donated to a step (`donate=`), whose "
    "outputs replaced it, or `.delete()`d. {fix}"
)
_PLACE_OUTPUTS = (
    "Place the step's outputs, which replace the donated inputs: after `model, "
    "opt_state, loss = step(model, opt_state, x)`, `ox.place(model, ...)`; or place the "
    "tree before a step donates it."
)


def check_not_deleted(tree: Any, root: str, caller: str, fix: str) -> None:
    """A `ValueError` naming the first array leaf of `tree` whose buffer is gone (donated
    or deleted), raised before any work: JAX's own "Array has been deleted" names no leaf,
    and comes only after some leaves were moved or written."""
    for keys, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if isinstance(leaf, jax.Array) and not isinstance(leaf, Tracer) and leaf.is_deleted():
            path = format_path(root, keys)
            raise ValueError(_DELETED_LEAF.format(caller=caller, path=path, fix=fix))


def place(
    tree: Any,
    strategy: "str | Strategy | None" = None,
    *,
    mesh: AnyMesh | None = None,
) -> Any:
    """Move every array leaf of `tree` to the memory (and sharding) its plan gives it.

    **Arguments:**

    - `tree`: a model, an optimizer state, or any pytree of them.
    - `strategy`: a strategy name (`"baseline"`, `"hybrid"`, ...) or an `ox.Strategy`;
        by default the model's own annotations.
    - `mesh`: the mesh over which leaves with a `spec` are sharded.

    Leaves that nothing manages stay where they are. Each move is one explicit
    `jax.device_put`; leaves already in place are not copied. Returns a new pytree.

    **Raises:** `ValueError` naming the first leaf that has been deleted (donated to a
    step), before anything moves: place the step's outputs instead.
    """
    check_not_deleted(tree, "tree", "ox.place", _PLACE_OUTPUTS)
    shardings = Plan([("tree", tree)], strategy, mesh).tree_shardings(0)

    def move(leaf, sharding):
        if sharding is None or not eqx.is_array(leaf):
            return leaf
        if isinstance(leaf, jax.Array) and leaf.sharding == sharding and type_matches(leaf):
            return leaf
        return retyped(put(leaf, sharding), sharding)  # also across processes

    return jax.tree_util.tree_map(move, tree, shardings, is_leaf=lambda x: x is None)


def abstract(
    tree: Any,
    strategy: "str | Strategy | None" = None,
    *,
    mesh: AnyMesh | None = None,
) -> Any:
    """`tree` with every array leaf replaced by a `jax.ShapeDtypeStruct` of its shape,
    dtype and planned sharding, memory kind included: the target that restores a
    checkpoint straight into planned memory.

    **Arguments:**

    - `tree`: a model, an optimizer state, or a pytree of them (`(model, opt_state)`);
        its array leaves may be arrays or `jax.ShapeDtypeStruct`s (from
        `eqx.filter_eval_shape`: nothing is allocated).
    - `strategy`: the strategy the state will be used under (`"hybrid"`, ...); by default
        the model's own annotations.
    - `mesh`: the mesh over which leaves with a `spec` are sharded (optimizer state
        mirrors its parameter's spec).

    Non-array leaves are returned unchanged. A single-device leaf's sharding is typed by
    its memory (a `NamedSharding` on a one-device mesh), so that what is restored into it
    is a host-typed array, as `ox.place` would give:

    ```python
    target = ox.abstract((model, opt_state), "hybrid")
    arrays = eqx.filter(target, lambda x: isinstance(x, jax.ShapeDtypeStruct))
    restored = ocp.StandardCheckpointer().restore(path, arrays)
    model, opt_state = eqx.combine(restored, target)  # the non-array leaves from `target`
    ```
    """
    shardings = Plan([("tree", tree)], strategy, mesh).tree_shardings(0)

    def one(leaf: Any, sharding: Any) -> Any:
        if sharding is None:  # not an array: no sharding planned
            return leaf
        return jax.ShapeDtypeStruct(np.shape(leaf), leaf.dtype, sharding=typed(sharding))

    return jax.tree_util.tree_map(one, tree, shardings, is_leaf=lambda x: x is None)


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
    - `memory`: `"device"` or `"pinned_host"`.

    Outside a trace this is one explicit transfer (also onto a mesh spanning several
    processes: each process passes the same whole value). Inside a trace it constrains
    the sharding of an activation (`reshard` under `Explicit` axes,
    `with_sharding_constraint` under `Auto` axes), and `memory="pinned_host"` then moves
    it to host memory explicitly.

    **Returns:** `x` with each array sharded over the mesh by `spec`, in `memory`.
    """
    if not isinstance(spec, PartitionSpec):
        raise TypeError(
            f"ox.shard(x, spec={spec!r}): the spec is a {type(spec).__name__}; expected a "
            "`jax.sharding.PartitionSpec`, e.g. `P('data')`."
        )
    check_memory(memory, where="ox.shard(memory=...)")
    leaves = jax.tree_util.tree_flatten_with_path(x)[0]
    not_arrays = [(p, v) for p, v in leaves if not eqx.is_array(v)]
    if not_arrays or not leaves:
        path, value = not_arrays[0] if not_arrays else ((), x)
        raise TypeError(
            f"ox.shard: `x{format_keys(path)}` is {value!r} (a {type(value).__name__}), not an "
            "array. Shard arrays: convert it first, e.g. `ox.shard(jnp.asarray(x), spec, mesh)`."
        )
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
        check_spec("x" + format_keys(path), np.shape(leaf), spec, mesh)
    explicit = any(t == AxisType.Explicit for t in mesh.axis_types)

    def one(leaf):
        if traced:
            if explicit:
                out = jax.sharding.reshard(leaf, NamedSharding(mesh, spec))
            else:
                out = jax.lax.with_sharding_constraint(leaf, NamedSharding(mesh, spec))
            return to_host(out) if memory == "pinned_host" else out
        return put(leaf, NamedSharding(mesh, spec, memory_kind=memory))

    return jax.tree_util.tree_map(one, x)
