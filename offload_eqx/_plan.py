"""The plan: every array leaf's placement and every activation name's policy.

Built by walking pytrees by key path and dataclass field metadata, then overriding the
model's own annotations with a strategy. The plan is what `ox.place`, `ox.filter_jit`,
the regions and the optimizer wrapper act on, and it prints as a table.
"""

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, cast

import equinox as eqx
import jax
import numpy as np
from jax import checkpoint_policies
from jax.sharding import PartitionSpec

from ._activations import Activations, Policy
from ._placement import Memory, Placement, Role, field_placement
from ._strategy import Strategy

ANNOTATION_ATTRIBUTE = "__offload_eqx_activations__"

_CONFLICTING_POLICIES = (
    "Activation {name!r} is given two policies: {first!r} by `{first_path}` and "
    "{second!r} by `{second_path}`. A name has one policy for the whole model (it is "
    "compiled into one remat policy); give it the same policy in both places, or rename "
    "one of the activations."
)


_NON_ARRAY_FIELD = (
    "Field `{path}` is declared with `ox.field(memory={memory!r})` but holds {value!r} (a "
    "{kind}), not an array: only arrays have a memory. Declare it with `eqx.field(...)` "
    "(or `eqx.field(static=True)` for a hyperparameter), or store an array in it."
)


# Marks a subtree whose module field declarations are ignored (see `_walk`).
_MIRROR = Placement(memory="device", role="param")


def _is_non_array_leaf(value: Any) -> bool:
    if value is None or eqx.is_array(value) or isinstance(value, jax.ShapeDtypeStruct):
        return False
    return jax.tree_util.treedef_is_leaf(jax.tree_util.tree_structure(value))


@dataclasses.dataclass(frozen=True)
class LeafPlan:
    """The plan for one array leaf."""

    path: str
    shape: tuple[int, ...]
    dtype: np.dtype
    memory: Memory | None  # None: not managed, stays wherever it is
    declared: Memory | None
    role: Role | None
    spec: PartitionSpec | None

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * np.dtype(self.dtype).itemsize


def format_path(root: str, path: Sequence[Any]) -> str:
    return root + jax.tree_util.keystr(tuple(path), simple=False, separator="")


def _children(node: Any) -> list[tuple[tuple, Any]]:
    """One level of a pytree node's children, with their keys."""
    children, _ = jax.tree_util.tree_flatten_with_path(node, is_leaf=lambda x: x is not node)
    return children


def _walk(
    node: Any,
    path: tuple,
    root: str,
    inherited: Placement | None,
    placements: dict[str, Placement | None],
    declared_activations: list[tuple[str, Policy, str]],
) -> None:
    if eqx.is_array(node) or isinstance(node, jax.ShapeDtypeStruct) or node is None:
        placements[format_path(root, path)] = None if inherited is _MIRROR else inherited
        return
    if isinstance(node, eqx.Module):
        module_path = format_path(root, path)
        extra = getattr(type(node), ANNOTATION_ATTRIBUTE, None)
        if extra is not None:
            for name, policy in extra.items():
                declared_activations.append((name, policy, module_path))
        for f in dataclasses.fields(node):
            try:
                value = getattr(node, f.name)
            except AttributeError:
                continue
            if f.metadata.get("static", False):
                if isinstance(value, Activations):
                    for name, policy in value.items():
                        declared_activations.append((name, policy, module_path))
                continue
            declared = field_placement(f)
            if inherited is not None and (inherited.role == "optimizer" or inherited is _MIRROR):
                # Optimizer state mirrors the model (Adam's mu and nu are models): the
                # model's own field declarations do not apply inside it.
                declared = None
            if declared is not None and _is_non_array_leaf(value):
                raise ValueError(
                    _NON_ARRAY_FIELD.format(
                        path=f"{module_path}.{f.name}",
                        value=value,
                        kind=type(value).__name__,
                        memory=declared.memory,
                    )
                )
            placement = declared or inherited
            _walk(
                value,
                path + (jax.tree_util.GetAttrKey(f.name),),
                root,
                placement,
                placements,
                declared_activations,
            )
        return
    if isinstance(node, tuple) and hasattr(node, "_fields") and inherited is None:
        # A NamedTuple outside `ox.offload_optimizer` is an optax state (or the like):
        # its copies of the model (Adam's mu, nu) are not the model, so the model's field
        # declarations do not place them. They stay wherever they are.
        inherited = _MIRROR
    for key, child in _children(node):
        if child is node:  # a leaf that is not an array (a function, a string, ...)
            return
        _walk(child, path + tuple(key), root, inherited, placements, declared_activations)


def _effective_memory(placement: Placement | None, leaf: Any, strategy: Strategy) -> Memory | None:
    if placement is None:
        return None
    mode = strategy.params if placement.role == "param" else strategy.optimizer
    memory = placement.memory if mode == "annotated" else mode
    if placement.role == "optimizer" and np.ndim(leaf) == 0:
        # Scalars (Adam's step count, injected hyperparameters) stay on the device: they
        # are bytes, every update reads them, and a donated host scalar that XLA aliases
        # to a device output aborts the process (see ../shared/reference).
        return "device"
    return memory


class Plan:
    """Placements of the array leaves of some pytrees, and the activation policy.

    Build one with `ox.plan(tree, strategy=...)`; `print(plan)` shows a table.
    """

    def __init__(
        self,
        roots: Sequence[tuple[str, Any]],
        strategy: Strategy,
        mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh | None = None,
    ):
        self.strategy = strategy
        from ._mesh import resolve_mesh  # late import: _mesh imports the plan

        # The mesh is given once; later calls find it on the arrays placed over it.
        self.mesh = resolve_mesh(roots, mesh)
        placements: dict[str, Placement | None] = {}
        declared: list[tuple[str, Policy, str]] = []
        for root, tree in roots:
            _walk(tree, (), root, None, placements, declared)
        leaves: list[LeafPlan] = []
        for root, tree in roots:
            for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
                if not eqx.is_array(leaf) and not isinstance(leaf, jax.ShapeDtypeStruct):
                    continue
                key = format_path(root, path)
                placement = placements.get(key)
                leaves.append(
                    LeafPlan(
                        path=key,
                        shape=tuple(np.shape(leaf)),
                        dtype=np.dtype(leaf.dtype),
                        memory=_effective_memory(placement, leaf, strategy),
                        declared=None if placement is None else placement.memory,
                        role=None if placement is None else placement.role,
                        spec=None if placement is None else placement.spec,
                    )
                )
        self.leaves: tuple[LeafPlan, ...] = tuple(leaves)
        self.declared_activations: dict[str, tuple[Policy, str]] = {}
        for name, policy, module_path in declared:
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
            name: _effective_policy(policy, strategy)
            for name, (policy, _) in self.declared_activations.items()
        }
        self.policy: Callable[..., Any] = _remat_policy(self.activations, strategy)

    # -- queries ---------------------------------------------------------------------

    def leaves_in(self, memory: Memory) -> tuple[LeafPlan, ...]:
        return tuple(leaf for leaf in self.leaves if leaf.memory == memory)

    @property
    def saves_everything(self) -> bool:
        """True when the activation mode keeps every residual (no rematerialisation)."""
        return self.strategy.activations == "save"

    def sharding(self, leaf_plan: LeafPlan, current: jax.sharding.Sharding | None):
        """The sharding a leaf should have: its current one with the planned memory kind,
        or, when the plan has a mesh, a `NamedSharding` over it (see `_mesh.mesh_sharding`).
        A spec without a mesh is an error."""
        from ._mesh import mesh_sharding, no_mesh_error

        memory = leaf_plan.memory
        if self.mesh is not None:
            return mesh_sharding(self.mesh, leaf_plan, current)
        if leaf_plan.spec is not None:
            raise no_mesh_error(leaf_plan)
        if current is None:
            device = jax.devices()[0]
            return jax.sharding.SingleDeviceSharding(device, memory_kind=memory or "device")
        if memory is None or current.memory_kind == memory:
            return current
        return current.with_memory_kind(memory)

    # -- checks ----------------------------------------------------------------------

    def check_strategy(self) -> None:
        """A strategy that asks for host memory must find something to put there."""
        strategy = self.strategy
        roles = {leaf.role for leaf in self.leaves}
        if strategy.params == "pinned_host" and "param" not in roles:
            raise ValueError(
                f"Strategy {strategy.name!r} offloads parameters, but no array leaf is "
                "declared with `ox.field(...)` or `ox.annotate(...)`, so it would offload "
                "nothing. Mark the fields that may live in host memory, e.g. "
                "`w: jax.Array = ox.field(memory='device')`."
            )
        if strategy.activations == "offload" and not self.declared_activations:
            raise ValueError(
                f"Strategy {strategy.name!r} offloads activations, but no module declares "
                "any activation names, so it would offload nothing. Name activations with "
                "`ox.name(x, 'x')` and declare them with `ox.activations(x='offload')`."
            )

    def check_trace(
        self, inside_regions: set[str], outside_regions: set[str], regions: int
    ) -> None:
        """After tracing: every declared name must have been produced inside a region.

        A program that enters no region and produces no declared name (applying
        updates, an optimizer init) does not run the model, so it is not checked."""
        produced = inside_regions | outside_regions
        if regions == 0 and not produced & self.declared_activations.keys():
            return
        for name, (policy, module_path) in self.declared_activations.items():
            effective = self.activations[name]
            if name in inside_regions:
                continue
            if name in outside_regions:
                if effective == "save" and self.saves_everything:
                    continue
                raise ValueError(
                    f"Activation {name!r} (declared {policy!r} by `{module_path}`) is only "
                    "produced outside `ox.scan`/`ox.checkpoint` regions, where no remat "
                    "policy applies, so it would be kept on the device whatever its "
                    "policy. Call the module that names it through `ox.scan(...)` or "
                    "`ox.checkpoint(...)`."
                )
            produced = sorted(inside_regions | outside_regions)
            raise ValueError(
                f"Activation {name!r} is declared {policy!r} by `{module_path}`, but the "
                f"program never produces it (names produced: {produced or 'none'}). JAX "
                "would silently ignore it. Fix the spelling, call `ox.name(x, "
                f"{name!r})` where the activation is computed, or remove the declaration."
            )

    # -- printing --------------------------------------------------------------------

    def __str__(self) -> str:
        return format_plan(self)

    __repr__ = __str__


def _effective_policy(policy: Policy, strategy: Strategy) -> Policy:
    mode = strategy.activations
    if mode == "annotated":
        return policy
    return cast(Policy, mode)


def _is_fetch(prim: Any, params: dict) -> bool:
    if prim.name != "device_put":
        return False
    return any(str(d).endswith("Device") for d in params.get("devices", ()))


def _remat_policy(activations: dict[str, Policy], strategy: Strategy) -> Callable[..., Any]:
    saved = [n for n, p in activations.items() if p == "save"]
    offloaded = [n for n, p in activations.items() if p == "offload"]
    named = checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=saved,
        names_which_can_be_offloaded=offloaded,
        offload_src="device",
        offload_dst="pinned_host",
    )
    save_rest = strategy.activations == "save"

    def policy(prim, *avals, **params):
        if prim.name == "name":
            return named(prim, *avals, **params)
        if save_rest and not _is_fetch(prim, params):
            return True
        # Never save a fetched copy of a host-resident leaf: fetch it again instead.
        return named(prim, *avals, **params)

    return policy


def _format_bytes(n: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def format_plan(plan: Plan) -> str:
    header = ("path", "shape", "dtype", "bytes", "memory", "declared")
    rows = [
        (
            leaf.path,
            "x".join(map(str, leaf.shape)) or "()",
            str(leaf.dtype),
            _format_bytes(leaf.nbytes),
            leaf.memory or "(as given)",
            leaf.declared or "-",
        )
        for leaf in plan.leaves
    ]
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    lines = [f"Plan (strategy {plan.strategy.name!r})"]
    lines.append("  ".join(h.ljust(w) for h, w in zip(header, widths)).rstrip())
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    totals: dict[str, int] = {}
    for leaf in plan.leaves:
        totals[leaf.memory or "(as given)"] = (
            totals.get(leaf.memory or "(as given)", 0) + leaf.nbytes
        )
    lines.append(
        "totals: " + ", ".join(f"{k} {_format_bytes(v)}" for k, v in sorted(totals.items()))
    )
    if plan.activations:
        lines.append(
            "activations: "
            + ", ".join(f"{n}={p}" for n, p in sorted(plan.activations.items()))
            + f" (everything else in a region: "
            f"{'saved' if plan.saves_everything else 'recomputed'})"
        )
    return "\n".join(lines)


def plan(
    tree: Any,
    strategy: "str | Strategy | None" = None,
    *,
    mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh | None = None,
    name: str = "tree",
) -> Plan:
    """The plan for one pytree (a model, an optimizer state, or a tuple of them)."""
    from ._strategy import resolve_strategy

    return Plan([(name, tree)], resolve_strategy(strategy), mesh)
