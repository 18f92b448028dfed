"""One compiled entry of `ox.filter_jit`: a flat function of the array leaves, compiled
with the plan's shardings and donation.

The function the user wrote takes pytrees; the entry's `flat` takes the array leaves in
plan order and rebuilds the call around the static leaves of the cache key. Tracing
installs the trace state (the plan, for the regions and `ox.name`), and checks afterwards
that every declared name was produced.
"""

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.core import Tracer

from ._errors import is_host_use_error
from ._host_compute import check_host_compute
from ._host_use import locate_host_use
from ._memory_space import is_host_aval
from ._plan import LeafPlan, Plan
from ._plan_walk import format_keys, is_array_leaf
from ._trace_state import tracing


@functools.cache
def _single_device_mesh(device: Any) -> jax.sharding.Mesh:
    return jax.sharding.Mesh(np.array([device]), ("_device",))


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


def make_flat(
    call: Callable[[Any], Any],
    plan: Plan,
    treedef: Any,
    mask: Sequence[bool],
    statics: tuple,
    out_cell: list,
    check: bool = True,
) -> Callable[..., list]:
    """The function of the array leaves: rebuild the arguments, call under `plan`."""

    def flat(*dynamic):
        if tuple((tuple(x.shape), x.dtype) for x in dynamic) != plan.types:
            raise NewArgumentTypes()
        dynamic_iter, static_iter = iter(dynamic), iter(statics)
        leaves = [next(dynamic_iter) if m else next(static_iter) for m in mask]
        with tracing(plan, dynamic) as state:
            out = call(jax.tree_util.tree_unflatten(treedef, leaves))
        if check:
            plan.check_names(state.inside_regions, state.outside_regions, state.regions)
        out_leaves, out_treedef = jax.tree_util.tree_flatten(out)
        out_mask = tuple(map(is_array_leaf, out_leaves))
        out_cell[:] = [
            out_treedef,
            tuple(x for x, m in zip(out_leaves, out_mask) if not m),
            out_mask,
        ]
        return [x for x, m in zip(out_leaves, out_mask) if m]

    return flat


class NewArgumentTypes(Exception):
    """A compiled entry's program is traced again for other shapes or dtypes than its
    plan's: `ox.filter_jit` compiles (and validates) a new entry for them."""


@dataclasses.dataclass
class Compilation:
    """What `ox.filter_jit` compiles for one cache entry: a flat function of the array
    leaves, and everything needed to compile it for another backend (`ox.memory_report`)
    or to walk its program (`ox.audit`)."""

    jitted: Any  # jax.jit(flat, in_shardings, out_shardings, donate_argnums)
    flat: Callable[..., list]  # array leaves in, array leaves out
    plan: Plan  # plan.leaves[i] describes argument i of `flat`
    in_shardings: tuple
    out_avals: tuple  # traced output types (memory space included)
    out_shardings: tuple
    donate_argnums: tuple[int, ...]
    # [out_treedef, out_static, out_mask], written by each trace of the function.
    out_cell: list
    remake: Callable[[Plan], Callable[..., list]]  # `flat` under another plan
    # The program traced when the entry was made (a ClosedJaxpr): the audit walks it
    # rather than tracing again.
    jaxpr: Any = None

    @property
    def types(self) -> tuple:
        """The shapes and dtypes of the arguments this entry was compiled for."""
        return self.plan.types

    def abstract(self, dynamic: Sequence[Any]) -> list[jax.ShapeDtypeStruct]:
        """Abstract arguments typed by their planned memory."""
        return [
            jax.ShapeDtypeStruct(np.shape(leaf), leaf.dtype, sharding=typed(s))
            for leaf, s in zip(dynamic, self.in_shardings)
        ]

    @property
    def out_memories(self) -> tuple[str, ...]:
        return tuple("pinned_host" if is_host_aval(a) else "device" for a in self.out_avals)

    @property
    def output_arguments(self) -> tuple[LeafPlan | None, ...]:
        """For each array output, the argument leaf it is the new value of (or None)."""
        out_treedef, _, out_mask = self.out_cell
        return self.plan.output_arguments(out_treedef, out_mask, self.out_avals)

    def output_paths(self, root: str = "output") -> list[str]:
        """The leaf path of each array output, e.g. `output[0].layers.w1`."""
        out_treedef, _, out_mask = self.out_cell
        placeholders = jax.tree_util.tree_unflatten(out_treedef, list(range(len(out_mask))))
        paths = jax.tree_util.tree_flatten_with_path(placeholders)[0]
        return [root + format_keys(path) for (path, i) in paths if out_mask[i]]

    def flat_on(self, mesh: Any) -> Callable[..., list]:
        """`flat` with the plan's mesh replaced by `mesh` (a compile-only target's mesh of
        the same axes), for `ox.shard` inside the step."""
        return self.remake(self.plan.on_mesh(mesh))

    def rebuild(self, dynamic_out: Sequence[Any]) -> Any:
        out_treedef, out_static, out_mask = self.out_cell
        if not out_static:  # all outputs are arrays: the common case, kept cheap
            return jax.tree_util.tree_unflatten(out_treedef, dynamic_out)
        dynamic_iter, static_iter = iter(dynamic_out), iter(out_static)
        leaves = [next(dynamic_iter) if m else next(static_iter) for m in out_mask]
        return jax.tree_util.tree_unflatten(out_treedef, leaves)


def _device_of(leaves: Sequence[Any]) -> Any:
    for leaf in leaves:
        if isinstance(leaf, jax.Array) and not isinstance(leaf, Tracer):
            devices = leaf.sharding.device_set
            if len(devices) == 1:
                return next(iter(devices))
    return jax.devices()[0]


def compile_entry(
    call: Callable[[Any], Any],
    plan: Plan,
    treedef: Any,
    mask: Sequence[bool],
    statics: tuple,
    dynamic: Sequence[Any],
    donate: str,
    keep_root: int | None,
    caller: str,
) -> Compilation:
    """Trace `call` on abstract values typed by the plan, then build its `jax.jit`."""
    cell: list = []

    def remake(other: Plan, check: bool = True) -> Callable[..., list]:
        return make_flat(call, other, treedef, mask, statics, cell, check)

    flat = remake(plan)
    in_shardings = tuple(leaf.sharding for leaf in plan.leaves)
    entry = Compilation(None, flat, plan, in_shardings, (), (), (), cell, remake)
    # Trace on abstract values typed by the *planned* memory, whatever memory the
    # arguments are in now (they are moved before the first call).
    abstract = entry.abstract(dynamic)
    try:
        traced = jax.jit(flat).trace(*abstract)
    except ValueError as error:
        if not is_host_use_error(error):
            raise
        raise locate_host_use(remake(plan, False), abstract, plan, error, caller) from None
    plan.check_offloads(traced.jaxpr.jaxpr)
    platform = _device_of(dynamic).platform
    check_host_compute(traced.jaxpr, platform, f"this machine's {platform!r} device")
    entry.jaxpr = traced.jaxpr
    entry.out_avals = tuple(traced.jaxpr.out_avals)
    out_treedef, _, out_mask = cell
    entry.out_shardings = plan.output_shardings(
        out_treedef, out_mask, entry.out_avals, _device_of(dynamic)
    )
    entry.donate_argnums = plan.donated(donate, out_treedef, out_mask, entry.out_avals, keep_root)
    entry.jitted = jax.jit(
        flat,
        in_shardings=in_shardings,
        out_shardings=list(entry.out_shardings),
        donate_argnums=entry.donate_argnums,
    )
    return entry
