"""The plan: every placement rule, decided once for a call's arguments under a strategy.

For every array leaf of the arguments the plan holds its memory and its sharding (on one
device or over the one mesh); for every declared activation name its policy, and the one
remat policy the regions compile. It also answers the questions everything else asks:
where an optimizer-state leaf lives (sharded like the parameter whose key path it
mirrors), which arguments are donated, which output is the new value of which argument,
and whether a trace produced every declared name. `ox.place`, `ox.filter_jit`, the
regions, the optimizer and the inspection tools ask the plan; none derives a placement
of its own.

A plan is built from pytrees without tracing, is immutable, compares equal to a plan of
the same placements, and prints as a table.
"""

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, cast

import jax
import numpy as np
from jax.core import Tracer
from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding

from ._activations import Policy
from ._memory_space import is_host_aval
from ._mesh import AnyMesh, check_spec, output_sharding, resolve_mesh, spec_problem
from ._placement import Memory, Placement, Role
from ._plan_walk import Annotations, format_keys, is_array_leaf, match_subtrees, walk
from ._remat_policy import check_names, check_offloads, effective_policy, remat_policy
from ._strategy import Strategy, resolve_strategy
from ._table import format_bytes, format_table

_CONFLICTING_POLICIES = (
    "Activation {name!r} is given two policies: {first!r} by `{first_path}` and "
    "{second!r} by `{second_path}`. A name has one policy for the whole model (it is "
    "compiled into one remat policy); give it the same policy in both places, or rename "
    "one of the activations."
)
_NO_MESH = (
    "Leaf `{path}` has the partition spec {spec}, but no mesh was given and none of the "
    "arrays passed is on a mesh, so there is nothing to shard it over. Give the mesh "
    "once: `ox.place(model, mesh=mesh)` (later calls find it on the placed arrays) or "
    "`ox.filter_jit(..., mesh=mesh)`; or drop the spec to keep the leaf on one device."
)
_OFFLOADS_NOTHING = (
    "Strategy {strategy!r} offloads {what}, but {missing}, so it would offload nothing. {fix}"
)


@dataclasses.dataclass(frozen=True)
class LeafPlan:
    """The plan for one array leaf.

    - `path`: its path from the argument it belongs to (`model.layers.w1`).
    - `memory`: where it lives under the strategy; None for a leaf nothing manages
        (it stays in the memory it is in).
    - `declared`: the memory its annotation declares (None: not annotated).
    - `role`: `"param"` (a model field), `"optimizer"` (optimizer state) or None.
    - `spec`: the `PartitionSpec` it is sharded with over the plan's mesh, declared or
        mirrored from its parameter (None: none declared).
    - `sharding`: its planned sharding, the one `ox.filter_jit` compiles it with.
    - `mirrors`: for optimizer state, the path of the parameter it mirrors.
    """

    path: str
    shape: tuple[int, ...]
    dtype: Any
    memory: Memory | None
    declared: Memory | None
    role: Role | None
    spec: PartitionSpec | None
    sharding: Any = None
    mirrors: str | None = None
    root: int = dataclasses.field(default=0, repr=False)
    uploaded: bool = dataclasses.field(default=False, repr=False)  # a NumPy leaf
    keys: tuple = dataclasses.field(default=(), repr=False, compare=False)

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize


def _current_sharding(leaf: Any) -> Any:
    if isinstance(leaf, Tracer):
        return None  # a call inside another trace: the outer program decides
    return getattr(leaf, "sharding", None)


def _effective_memory(placement: Placement | None, leaf: Any, strategy: Strategy) -> Memory | None:
    if placement is None:
        return None
    mode = strategy.params if placement.role == "param" else strategy.optimizer
    if placement.role == "optimizer" and strategy.update_of(placement.update) == "host":
        return "pinned_host"  # updated on the host: all of it lives there, never moved
    if placement.role == "optimizer" and np.ndim(leaf) == 0:
        # Scalars (Adam's step count, injected hyperparameters) stay on the device: they
        # are bytes, every update reads them, and a donated host scalar that XLA aliases
        # to a device output aborts the process (see ../shared/reference).
        return "device"
    return placement.memory if mode == "annotated" else cast(Memory, mode)


def _mirrored(keys: tuple, shape: tuple, params: dict[tuple, int], leaves: list) -> int | None:
    """The parameter whose key path occurs in an optimizer-state leaf's key path (the
    longest such path), if its shape is the state leaf's: Adam's `mu.layers.w1` mirrors
    `layers.w1`, a streamed `leaves.layers.w1[0].mu` too."""
    n = len(keys)
    for length in range(n, 0, -1):
        for start in range(0, n - length + 1):
            index = params.get(keys[start : start + length])
            if index is not None and leaves[index]["shape"] == shape:
                return index
    return None


class Plan:
    """Placements of the array leaves of some pytrees, and the activation policy.

    Build one with `ox.plan(tree, strategy=...)` or `step.plan(*args)`; `print(plan)`
    shows a table. Give a plan to `ox.filter_jit(..., strategy=plan)` to compile its
    strategy and mesh.
    """

    def __init__(
        self,
        roots: Sequence[tuple[str, Any]],
        strategy: Strategy | str | None = None,
        mesh: AnyMesh | None = None,
    ):
        strategy = resolve_strategy(strategy)
        self.strategy = strategy
        # The mesh is given once; later calls find it on the arrays placed over it.
        self.mesh: AnyMesh | None = resolve_mesh(roots, mesh)
        self.roots: tuple[str, ...] = tuple(label for label, _ in roots)
        found = Annotations()
        for label, tree in roots:
            walk(tree, label, None, found)

        entries: list[dict[str, Any]] = []
        self._structure: list[tuple[Any, tuple[int | None, ...]]] = []
        for r, (label, tree) in enumerate(roots):
            with_path, treedef = jax.tree_util.tree_flatten_with_path(tree)
            indices: list[int | None] = []
            for keys, leaf in with_path:
                if not is_array_leaf(leaf):
                    indices.append(None)
                    continue
                indices.append(len(entries))
                path = label + format_keys(keys)
                placement = found.placements.get(path)
                entries.append(
                    dict(
                        path=path,
                        shape=tuple(np.shape(leaf)),
                        dtype=leaf.dtype,
                        memory=_effective_memory(placement, leaf, strategy),
                        declared=None if placement is None else placement.memory,
                        role=None if placement is None else placement.role,
                        spec=None if placement is None else placement.spec,
                        root=r,
                        uploaded=isinstance(leaf, (np.ndarray, np.generic)),
                        keys=tuple(keys),
                        current=_current_sharding(leaf),
                    )
                )
            self._structure.append((treedef, tuple(indices)))

        # Parameters first: optimizer state is sharded like the parameter it mirrors.
        params = {e["keys"]: i for i, e in enumerate(entries) if e["role"] != "optimizer"}
        shardings: list[Any] = [None] * len(entries)
        order = sorted(range(len(entries)), key=lambda i: entries[i]["role"] == "optimizer")
        for i in order:
            entry = entries[i]
            mirror = None
            if entry["role"] == "optimizer":
                mirror = _mirrored(entry["keys"], entry["shape"], params, entries)
                if mirror is not None:
                    entry["mirrors"] = entries[mirror]["path"]
                    mirrored = shardings[mirror]
                    if isinstance(mirrored, NamedSharding) and self.mesh is not None:
                        entry["spec"] = mirrored.spec
            shardings[i] = self._sharding(entry)
        self.leaves: tuple[LeafPlan, ...] = tuple(
            LeafPlan(**{k: v for k, v in e.items() if k != "current"}, sharding=s)
            for e, s in zip(entries, shardings)
        )

        self.types = tuple((leaf.shape, leaf.dtype) for leaf in self.leaves)
        self.declared_activations: dict[str, tuple[Policy, str]] = {}
        for name, policy, module_path in found.names:
            if name in self.declared_activations:
                first, first_path = self.declared_activations[name]
                if first != policy:
                    raise ValueError(
                        _CONFLICTING_POLICIES.format(
                            name=name,
                            first=first,
                            first_path=first_path,
                            second=policy,
                            second_path=module_path,
                        )
                    )
                continue
            self.declared_activations[name] = (policy, module_path)
        self.activations: dict[str, Policy] = {
            name: effective_policy(name, policy, strategy)
            for name, (policy, _) in self.declared_activations.items()
        }
        self.policy: Callable[..., Any] = remat_policy(self.activations, strategy)

    # -- the rules ---------------------------------------------------------------------

    def _sharding(self, entry: dict[str, Any]) -> Any:
        """A leaf's planned sharding: over the mesh a `NamedSharding` with its spec (a
        leaf without one keeps the spec it has on this mesh, or is replicated); off a
        mesh its current sharding in its planned memory."""
        memory, current, spec = entry["memory"], entry["current"], entry["spec"]
        mesh = self.mesh
        if mesh is not None:
            memory = memory or getattr(current, "memory_kind", None) or "device"
            if spec is None:
                on_mesh = isinstance(current, NamedSharding) and current.mesh == mesh
                spec = current.spec if on_mesh else PartitionSpec()
            elif entry["role"] == "optimizer":
                if spec_problem(entry["path"], entry["shape"], spec, mesh) is not None:
                    spec = PartitionSpec()  # a state leaf the spec does not fit
            else:
                check_spec(entry["path"], entry["shape"], spec, mesh)
            return NamedSharding(mesh, spec, memory_kind=memory)
        if spec is not None and entry["role"] != "optimizer":
            raise ValueError(_NO_MESH.format(path=entry["path"], spec=spec))
        if current is None:
            return SingleDeviceSharding(jax.devices()[0], memory_kind=memory or "device")
        if memory is None or current.memory_kind == memory:
            return current
        return current.with_memory_kind(memory)

    @property
    def offloads_activations(self) -> bool:
        """True when the remat policy offloads some named activation."""
        return "offload" in self.activations.values()

    @property
    def saves_everything(self) -> bool:
        """True when the activation mode keeps every residual (no rematerialisation)."""
        return self.strategy.activations == "save"

    def tree_shardings(self, root: int | str = 0) -> Any:
        """A pytree like argument `root` holding each array leaf's planned sharding
        (None at every other leaf)."""
        index = self.roots.index(root) if isinstance(root, str) else root
        treedef, indices = self._structure[index]
        return jax.tree_util.tree_unflatten(
            treedef, [None if i is None else self.leaves[i].sharding for i in indices]
        )

    def donated(self, donate: str, out_avals: Sequence[Any], keep_root: int | None) -> tuple:
        """The argument leaves to donate: under `donate="all"` every leaf that an output
        of the same shape, dtype and memory can reuse, except the leaves of argument
        `keep_root` (`"all-except-first"`) and NumPy leaves (copied in anyway)."""
        if donate == "none":
            return ()
        outputs: dict[tuple, int] = {}
        for aval in out_avals:
            key = (tuple(aval.shape), aval.dtype, is_host_aval(aval))
            outputs[key] = outputs.get(key, 0) + 1
        donated = []
        for i, leaf in enumerate(self.leaves):
            if leaf.uploaded or (keep_root is not None and leaf.root == keep_root):
                continue
            host = getattr(leaf.sharding, "memory_kind", None) == "pinned_host"
            key = (leaf.shape, leaf.dtype, host)
            if outputs.get(key, 0) == 0:
                continue  # no output could reuse it: donating would only warn
            outputs[key] -= 1
            donated.append(i)
        return tuple(donated)

    def output_arguments(
        self, out_treedef: Any, out_mask: Sequence[bool], out_avals, unique: bool = True
    ) -> tuple:
        """For each array output, the `LeafPlan` of the argument leaf it is the new value
        of (or None): the first output subtree with the structure of an argument (the
        updated model, the new optimizer state) matches it leaf by leaf, where shapes
        and dtypes agree. With `unique=False` every such subtree matches (updates shaped
        like the parameters are sharded like them)."""
        matched = match_subtrees(out_treedef, self._structure, unique)
        dynamic = [i for i, m in enumerate(out_mask) if m]
        result = []
        for index, aval in zip(dynamic, out_avals):
            leaf = None if matched.get(index) is None else self.leaves[matched[index]]
            if leaf is not None and (leaf.shape, leaf.dtype) != (tuple(aval.shape), aval.dtype):
                leaf = None
            result.append(leaf)
        return tuple(result)

    def output_shardings(self, out_treedef, out_mask, out_avals, device) -> tuple:
        """Each array output's sharding: its memory follows its traced type; over a mesh
        an output that is the new value of an argument keeps that argument's spec (so
        the next step moves nothing), and other outputs follow their type under Explicit
        axes or are left to the compiler (None) under Auto axes."""
        result = []
        like = self.output_arguments(out_treedef, out_mask, out_avals, unique=False)
        for aval, leaf in zip(out_avals, like):
            memory = "pinned_host" if is_host_aval(aval) else "device"
            if self.mesh is None:
                result.append(SingleDeviceSharding(device, memory_kind=memory))
            elif leaf is not None and isinstance(leaf.sharding, NamedSharding):
                result.append(NamedSharding(self.mesh, leaf.sharding.spec, memory_kind=memory))
            else:
                result.append(output_sharding(aval, self.mesh, memory))
        return tuple(result)

    # -- checks --------------------------------------------------------------------------

    def check_strategy(self) -> None:
        """A strategy that asks for host memory must find something to put there."""
        strategy = self.strategy
        roles = {leaf.role for leaf in self.leaves}
        asked = []
        if strategy.params == "pinned_host":
            asked.append(
                (
                    "parameters",
                    "param" in roles,
                    "no array leaf is declared with `ox.field(...)` or `ox.annotate(...)`",
                    "Mark the fields that may live in host memory, e.g. "
                    "`w: jax.Array = ox.field(memory='device')`, or "
                    "`ox.annotate(model, lambda m: m.layers, memory='device')`.",
                )
            )
        if strategy.activations == "offload":
            asked.append(
                (
                    "activations",
                    bool(self.declared_activations),
                    "no module declares any activation names",
                    "Name activations with `ox.name(x, 'x')` and declare them with "
                    "`ox.activations(x='offload')`.",
                )
            )
        optimizer_found = strategy.optimizer == "pinned_host" and "optimizer" in roles
        if not asked or optimizer_found or any(found for _, found, _, _ in asked):
            return
        what, _, missing, fix = asked[0]
        if len(asked) > 1:
            what = " and ".join(a[0] for a in asked)
            missing = "; ".join(a[2] for a in asked)
            fix = " ".join(a[3] for a in asked)
        raise ValueError(
            _OFFLOADS_NOTHING.format(strategy=strategy.name, what=what, missing=missing, fix=fix)
        )

    def check_names(self, inside_regions: set[str], outside_regions: set[str], regions: int):
        """After a trace: every declared name must have been produced inside a region."""
        check_names(
            self.declared_activations,
            self.activations,
            self.saves_everything,
            inside_regions,
            outside_regions,
            regions,
            self.strategy.name_policies,
            self.strategy.name,
        )

    def check_offloads(self, jaxpr: Any) -> None:
        """After a trace: in a differentiated program, every name the plan offloads is
        moved to host memory (else the backward pass never reads it)."""
        check_offloads(self.declared_activations, self.activations, self.strategy, jaxpr)

    # -- identity and printing -------------------------------------------------------------

    def on_mesh(self, mesh: AnyMesh) -> "Plan":
        """The same plan over another mesh of the same axes (a compile-only target's)."""
        other = object.__new__(Plan)
        other.__dict__.update(self.__dict__)
        other.mesh = mesh
        return other

    def _identity(self) -> tuple:
        return (self.strategy, self.mesh, self.roots, self.leaves, tuple(self.activations.items()))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Plan) and self._identity() == other._identity()

    def __hash__(self) -> int:
        return hash(self._identity())

    def __str__(self) -> str:
        return format_plan(self)

    __repr__ = __str__


def format_plan(plan: Plan) -> str:
    header = ("path", "shape", "dtype", "bytes", "memory", "declared")
    rows = [
        (
            leaf.path,
            "x".join(map(str, leaf.shape)) or "()",
            str(leaf.dtype),
            format_bytes(leaf.nbytes),
            leaf.memory or "(as given)",
            leaf.declared or "-",
        )
        for leaf in plan.leaves
    ]
    lines = [f"Plan (strategy {plan.strategy.name!r})", format_table(header, rows)]
    totals: dict[str, int] = {}
    for leaf in plan.leaves:
        key = leaf.memory or "(as given)"
        totals[key] = totals.get(key, 0) + leaf.nbytes
    lines.append(
        "totals: " + ", ".join(f"{k} {format_bytes(v)}" for k, v in sorted(totals.items()))
    )
    if plan.activations:
        rest = "saved" if plan.saves_everything else "recomputed"
        lines.append(
            "activations: "
            + ", ".join(f"{n}={p}" for n, p in sorted(plan.activations.items()))
            + f" (everything else in a region: {rest})"
        )
    return "\n".join(lines)


def plan(
    tree: Any,
    strategy: "str | Strategy | None" = None,
    *,
    mesh: AnyMesh | None = None,
    name: str = "tree",
) -> Plan:
    """The plan for one pytree (a model, an optimizer state, or a tuple of them)."""
    return Plan([(name, tree)], strategy, mesh)


def state_shardings(params: Any, state: Any, *, memory: str = "pinned_host", update="device"):
    """The planned sharding of every array leaf of an optimizer `state` (None at other
    leaves) for `params`: non-scalar state in `memory` as declared by the optimizer,
    sharded like the parameter whose key path it mirrors (replicated where shapes
    differ), on the mesh the parameters are on."""
    strategy = Strategy("init", optimizer=cast(Any, memory), update=cast(Any, update))
    return Plan([("params", params), ("opt_state", state)], strategy).tree_shardings(1)


def format_path(root: str, keys: Any) -> str:
    """`model.layers.w1`: an argument's label followed by a key path."""
    return root + format_keys(keys)
