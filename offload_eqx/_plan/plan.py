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

from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding

from .._declare.activations import LayerSplit, Policy, policies_of
from .._declare.strategy import Strategy, resolve_strategy
from .._sharding.memory_space import is_host_aval
from .._sharding.mesh import AnyMesh, leaf_sharding, output_sharding, resolve_mesh
from .leaf import (
    LeafPlan,
    committed_device,
    current_sharding,
    effective_memory,
    mirror_states,
)
from .printing import format_plan
from .remat_policy import check_names, check_offloads, effective_policy, remat_policy
from .walk import Annotations, format_keys, is_array_leaf, match_subtrees, walk

_CONFLICTING_POLICIES = (
    "Activation {name!r} is given two policies: {first!r} by `{first_path}` and "
    "{second!r} by `{second_path}`. A name has one policy for the whole model (it is "
    "compiled into one remat policy); give it the same policy in both places, or rename "
    "one of the activations."
)


class Plan:
    """Placements of the array leaves of some pytrees, and the activation policy.

    Build one with `ox.plan(tree, strategy=...)` or `step.plan(*args)`; `print(plan)`
    shows a table. Give a plan to `ox.filter_jit(..., strategy=plan)` to compile its
    strategy and mesh.

    - `leaves`: one `ox.LeafPlan` per array leaf, in the order of the trees' leaves.
    - `strategy`: the `ox.Strategy` it was built under; `mesh`: its mesh (None: one
        device).
    - `roots`: the labels of its trees (`("model", "opt_state", "x")` for a step).
    - `activations`: each declared activation name with its policy under the strategy.

    Plans are immutable and compare equal when they place the same.
    """

    def __init__(
        self,
        roots: Sequence[tuple[str, Any]],
        strategy: Strategy | str | None = None,
        mesh: AnyMesh | None = None,
        *,
        specs_need_a_mesh: bool = True,
    ):
        strategy = resolve_strategy(strategy)
        self.strategy = strategy
        # The mesh is given once; later calls find it on the arrays placed over it.
        self.mesh: AnyMesh | None = resolve_mesh(roots, mesh)
        # Off a mesh, the device of the committed arguments (uncommitted ones follow).
        arrays = (x for _, tree in roots for x in jax.tree_util.tree_leaves(tree))
        self.device = committed_device(arrays) or jax.devices()[0]
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
                # As jit traces it: a NumPy float64 batch is float32 (no x64).
                dtype = jax.dtypes.canonicalize_dtype(leaf.dtype, allow_extended_dtype=True)
                entries.append(
                    dict(
                        path=path,
                        shape=tuple(np.shape(leaf)),
                        dtype=dtype,
                        memory=effective_memory(
                            placement, np.ndim(leaf), strategy, path, dtype=dtype
                        ),
                        declared=None if placement is None else placement.memory,
                        role=None if placement is None else placement.role,
                        spec=None if placement is None else placement.spec,
                        root=r,
                        uploaded=isinstance(leaf, (np.ndarray, np.generic)),
                        keys=tuple(keys),
                        current=current_sharding(leaf),
                    )
                )
            self._structure.append((treedef, tuple(indices)))

        shardings = mirror_states(
            entries,
            found.placements,
            strategy,
            self.mesh is not None,
            # `specs_need_a_mesh` is False where only memories are asked for (an optimizer
            # state initialised under `eqx.filter_eval_shape`, which has no mesh).
            lambda entry: leaf_sharding(entry, self.mesh, specs_need_a_mesh, self.device),
        )
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
        self.activations: dict[str, Policy | LayerSplit] = {
            name: effective_policy(name, policy, strategy)
            for name, (policy, _) in self.declared_activations.items()
        }
        # Outside a scan (and in a scan's layers past every split), a split name follows
        # its `rest` policy.
        self.policy: Callable[..., Any] = self._policy_at(None)

    # -- the rules ---------------------------------------------------------------------

    def _policy_at(self, layer: int | None) -> Callable[..., Any]:
        """The remat policy of layer `layer` of a scan (None: outside any scan)."""
        at: dict[str, Policy] = {
            name: (p.at(layer) if layer is not None else p.rest) if isinstance(p, LayerSplit) else p
            for name, p in self.activations.items()
        }
        return remat_policy(at, self.strategy)

    def segments(self, length: int) -> list[tuple[int, int, Callable[..., Any]]]:
        """A scan of `length` layers as consecutive `(start, stop, remat policy)`
        segments: one, unless a name's policy is split by layers (`LayerSplit`), in which
        case the scan is cut where a split changes policy."""
        cuts = sorted(
            {p.layers for p in self.activations.values() if isinstance(p, LayerSplit)}
            & set(range(1, length))
        )
        bounds = [0, *cuts, length]
        split = any(isinstance(p, LayerSplit) for p in self.activations.values())
        return [
            (start, stop, self._policy_at(start) if split else self.policy)
            for start, stop in zip(bounds, bounds[1:])
        ]

    @property
    def devices(self) -> int:
        """How many devices the step runs on: its mesh's size (1 off a mesh). Per-device
        figures (memory bounds, the work each device does) divide by it."""
        return 1 if self.mesh is None else int(np.prod(list(self.mesh.shape.values())))

    @property
    def offloads_activations(self) -> bool:
        """True when the remat policy offloads some named activation (in some layer)."""
        return any("offload" in policies_of(p) for p in self.activations.values())

    @property
    def saves_everything(self) -> bool:
        """True when the activation mode keeps every residual (no rematerialisation)."""
        return self.strategy.activations == "save"

    def memory_kinds(self, root: int | str = 0) -> list[str]:
        """The memory kind of each array leaf of argument `root`, in leaf order."""
        index = self.roots.index(root) if isinstance(root, str) else root
        return [leaf.sharding.memory_kind for leaf in self.leaves if leaf.root == index]

    def tree_shardings(self, root: int | str = 0) -> Any:
        """A pytree like argument `root` holding each array leaf's planned sharding
        (None at every other leaf)."""
        index = self.roots.index(root) if isinstance(root, str) else root
        treedef, indices = self._structure[index]
        return jax.tree_util.tree_unflatten(
            treedef, [None if i is None else self.leaves[i].sharding for i in indices]
        )

    def mirrored_sharding(self, path: str | None, memory: str) -> NamedSharding | None:
        """How a value that mirrors the argument leaf at `path` (its gradient, its
        update) is sharded over the mesh: as that leaf, in `memory`. None off a mesh, or
        for a path that names no leaf sharded by a spec."""
        if self.mesh is None or path is None:
            return None
        for leaf in self.leaves:
            if leaf.path == path and isinstance(leaf.sharding, NamedSharding):
                return NamedSharding(self.mesh, leaf.sharding.spec, memory_kind=memory)
        return None

    def donated(
        self,
        donate: str,
        out_treedef: Any,
        out_mask: Sequence[bool],
        out_avals,
        keep_root,
        host_update: bool = False,
        fetched: Sequence[bool] = (),
        host_in_place: bool = False,
    ) -> tuple:
        """The argument leaves to donate: under any `donate` but `"none"` (`"all"`,
        `"warn"`, ...) each leaf the step returns a new value of, in the same memory (the
        updated model, the new optimizer state: `output_arguments`, matched by
        structure), except the leaves of argument `keep_root` (`"all-except-first"`,
        `"warn-except-first"`) and NumPy leaves (copied in anyway). An
        argument that is a bare array (a batch, a loss scale) is never donated, even when
        an output has its shape: nothing says the output is its new value.

        With `host_update` (the optimizer state updated on the host), the state in
        host memory is donated where the update writes it in place (`host_in_place`):
        XLA:CPU inlines the host computation (fresh buffers, a page fault per 4 KiB each
        step, made a 50M-parameter update 3-5x slower), and on XLA:GPU an update split
        into chained calls (`on_host(split=True)`) holds one group's results as
        temporaries at a time. A host update XLA:GPU runs as one call is not donated:
        its results get buffers of their own, copied into donated ones afterwards (8 x
        1024^2 with Adam, delayed, h100: four 32 MiB copies, 6.89 ms a step simulated
        against 3.05), saving nothing. For the same reason a device-resident leaf whose
        new value such a call computes and the step fetches as it is (`fetched`, one
        flag per output: a parameter cast from its float32 master on the host) is not
        donated there: the call's result has a device buffer of its own from the call's
        start, and a donated old value made XLA copy it for the passes and copy the new
        one into it afterwards; beside a delayed update spanning the step, the scheduler
        then waited for the update before the backward loop (a 4-layer scan of 256²,
        h100: 0.69 ms a step against 0.44, no less device memory). Only beside a delayed
        update (whose call spans the step): an update after the passes writes its
        results where the activations were, and the donated buffer saves the output's."""
        if donate == "none":
            return ()
        news = self.output_arguments(
            out_treedef, out_mask, out_avals, containers_only=True, last=keep_root
        )
        index = {id(leaf): i for i, leaf in enumerate(self.leaves)}
        donated = set()
        fetched = tuple(fetched) or (False,) * len(news)
        for leaf, aval, from_host in zip(news, out_avals, fetched):
            if leaf is None or leaf.uploaded or leaf.root == keep_root:
                continue
            host = getattr(leaf.sharding, "memory_kind", None) == "pinned_host"
            if (host or from_host) and host_update and not host_in_place:
                continue
            if host == is_host_aval(aval):  # else the output cannot reuse its buffer
                donated.add(index[id(leaf)])
        return tuple(sorted(donated))

    def output_arguments(
        self,
        out_treedef: Any,
        out_mask: Sequence[bool],
        out_avals,
        unique: bool = True,
        containers_only: bool = False,
        last: int | None = None,
    ) -> tuple:
        """For each array output, the `LeafPlan` of the argument leaf it is the new value
        of (or None): the first output subtree with the structure of an argument (the
        updated model, the new optimizer state) matches it leaf by leaf, where shapes
        and dtypes agree. With `unique=False` every such subtree matches (updates shaped
        like the parameters are sharded like them). With `containers_only`, arguments
        that are a bare array are not matched (any array output has their structure).
        Argument `last` is matched after the others (`step(grads, model, state)`: the
        new model is the model's, not the gradients', which have its structure)."""
        structure = list(self._structure)
        if containers_only:
            structure = [
                (None, ()) if jax.tree_util.treedef_is_leaf(treedef) else (treedef, entries)
                for treedef, entries in structure
            ]
        if last is not None and 0 <= last < len(structure):
            structure.append(structure.pop(last))
        matched = match_subtrees(out_treedef, structure, unique)
        dynamic = [i for i, m in enumerate(out_mask) if m]
        result = []
        for index, aval in zip(dynamic, out_avals):
            leaf = None if matched.get(index) is None else self.leaves[matched[index]]
            if leaf is not None and (leaf.shape, leaf.dtype) != (tuple(aval.shape), aval.dtype):
                leaf = None
            result.append(leaf)
        return tuple(result)

    def outputs(self, out_treedef, out_static, out_mask, out_avals) -> tuple:
        """For each array output that the step creates, its `LeafPlan` under its own
        annotations and this strategy (a model built from a key: `ox.filter_jit(lambda
        key: Model(key))`, an optimizer state: `ox.filter_jit(opt.init)`); None for the
        others and for those nothing annotates. An output with the structure of a pytree
        argument is that argument's new value, or a value derived from it (gradients,
        updates), and stays where the step computes it."""
        new_values = self.output_arguments(
            out_treedef, out_mask, out_avals, unique=False, containers_only=True
        )
        dynamic = iter(jax.ShapeDtypeStruct(tuple(a.shape), a.dtype) for a in out_avals)
        static = iter(out_static)
        tree = jax.tree_util.tree_unflatten(
            out_treedef, [next(dynamic) if m else next(static) for m in out_mask]
        )
        own = Plan([("output", tree)], self.strategy, self.mesh).leaves
        return tuple(
            None if new is not None or leaf.memory is None else leaf
            for new, leaf in zip(new_values, own)
        )

    def argument_shardings(self, to_jit: bool = False) -> tuple:
        """The sharding each argument leaf is compiled with: its planned one. With
        `to_jit` (off a mesh, for a program that places values on devices itself: a
        sharding constraint), a leaf in device memory is left to jit (None), which places
        it as `jax.jit` does: where it is committed, or where the program puts it. (A
        `pinned_host` array passed there is traced as host memory, which the program
        refuses, and is moved as the plan says.)"""
        return tuple(
            None
            if to_jit and getattr(leaf.sharding, "memory_kind", None) == "device"
            else leaf.sharding
            for leaf in self.leaves
        )

    def output_shardings(
        self, out_treedef, out_mask, out_avals, device, created=(), donated=(), to_jit=False
    ) -> tuple:
        """Each array output's sharding: its memory follows its traced type; over a mesh
        an output that is the new value of a pytree argument keeps that argument's spec
        (so the next step moves nothing), an output the step creates takes the spec its
        annotations give it (`created`, from `outputs`), and other outputs follow their
        type under Explicit axes, or are left to the compiler (None) under Auto axes,
        keeping the sharding the program constrains them to. Off a mesh, outputs are on
        `device`, except that with `to_jit` (see `argument_shardings`) device outputs
        are left to the compiler. An output left to the compiler that has the shape and
        dtype of a donated argument (`donated`, indices) in host memory is given its
        sharding explicitly: XLA would otherwise alias the host buffer to a device result
        and abort the process."""
        result = []
        like = self.output_arguments(
            out_treedef, out_mask, out_avals, unique=False, containers_only=True
        )
        created = tuple(created) or (None,) * len(out_avals)
        host_donated = {
            (self.leaves[i].shape, self.leaves[i].dtype)
            for i in donated
            if getattr(self.leaves[i].sharding, "memory_kind", None) == "pinned_host"
        }
        for aval, leaf, own in zip(out_avals, like, created):
            memory = "pinned_host" if is_host_aval(aval) else "device"
            leaf = own if own is not None else leaf
            if self.mesh is None:
                sharding = SingleDeviceSharding(device, memory_kind=memory)
                result.append(None if to_jit and memory == "device" else sharding)
            elif leaf is not None and isinstance(leaf.sharding, NamedSharding):
                result.append(NamedSharding(self.mesh, leaf.sharding.spec, memory_kind=memory))
            else:
                result.append(output_sharding(aval, self.mesh, memory))
            if result[-1] is None and (tuple(aval.shape), aval.dtype) in host_donated:
                result[-1] = (
                    SingleDeviceSharding(device, memory_kind=memory)
                    if self.mesh is None
                    else NamedSharding(self.mesh, PartitionSpec(), memory_kind=memory)
                )
        return tuple(result)

    # -- checks --------------------------------------------------------------------------

    def check_strategy(self, created: Sequence[Any] = ()) -> None:
        """The strategy's leaf patterns each match a leaf, and a strategy that asks for
        host memory finds something to put there: among the arguments, or among the
        outputs the step creates (`created`, from `outputs`)."""
        leaves = [leaf for leaf in (*self.leaves, *created) if leaf is not None]
        self.strategy.check_patterns(leaves)
        self.strategy.check_offloads_something(
            {leaf.role for leaf in leaves}, bool(self.declared_activations)
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
