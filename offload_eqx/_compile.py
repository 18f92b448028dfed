"""One compiled entry of `ox.filter_jit`: a flat function of the array leaves, compiled
with the plan's shardings and donation.

The function the user wrote takes pytrees; the entry's `flat` takes the array leaves in
plan order and rebuilds the call around the static leaves of the cache key. Tracing
installs the trace state (the plan, for the regions and `ox.name`), and checks afterwards
that every declared name was produced.
"""

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.core import Tracer

from ._errors import is_host_use_error
from ._host_compute import check_host_compute, on_host_if_cheap
from ._host_use import locate_host_use
from ._memory_space import is_host_aval, is_host_typed, to_device, to_host
from ._mesh import typed
from ._plan import LeafPlan, Plan
from ._plan_walk import format_keys, is_array_leaf
from ._trace_state import tracing

# A host-resident output is built on the host when what it reads of the device is at
# most this many bytes (a PRNG key, a shape): the model never exists on the device.
HOST_BUILD_LIMIT = 2**20


def make_flat(
    call: Callable[[Any], Any],
    plan: Plan,
    treedef: Any,
    mask: Sequence[bool],
    statics: tuple,
    out_cell: list,
    check: bool = True,
    placing: tuple | None = None,
) -> Callable[..., list]:
    """The function of the array leaves: rebuild the arguments, call under `plan`, and
    put each output in the memory `placing` gives it (None: as traced)."""

    def outputs(*dynamic) -> tuple[Any, list]:
        dynamic_iter, static_iter = iter(dynamic), iter(statics)
        leaves = [next(dynamic_iter) if m else next(static_iter) for m in mask]
        with tracing(plan, dynamic) as state:
            out = call(jax.tree_util.tree_unflatten(treedef, leaves))
        out_leaves, out_treedef = jax.tree_util.tree_flatten(out)
        out_mask = tuple(map(is_array_leaf, out_leaves))
        out_cell[:] = [
            out_treedef,
            tuple(x for x, m in zip(out_leaves, out_mask) if not m),
            out_mask,
        ]
        return state, [x for x, m in zip(out_leaves, out_mask) if m]

    def flat(*dynamic):
        if tuple((tuple(x.shape), x.dtype) for x in dynamic) != plan.types:
            raise NewArgumentTypes()
        state, outs = outputs(*dynamic)
        if check:
            plan.check_names(state.inside_regions, state.outside_regions, state.regions)
        if placing is not None:
            flatten = plan.mesh is None  # on a mesh, a reshape could reshard
            outs = _placed(outs, placing, lambda *d: outputs(*d)[1], dynamic, flatten)
        return outs

    return flat


def _placed(outs: list, memories: tuple, recompute: Callable, dynamic, flatten: bool) -> list:
    """Outputs moved to the memory their own annotations give them (a model or an
    optimizer state the step creates). Host-resident ones are computed on the host when
    they read little of the device; else computed on the device and moved there."""
    outs = list(outs)
    hosted = [
        i
        for i, (x, m) in enumerate(zip(outs, memories))
        if m == "pinned_host" and not is_host_typed(x)
    ]
    for i, (x, m) in enumerate(zip(outs, memories)):
        if m == "device" and is_host_typed(x):
            outs[i] = to_device(x)
    if not hosted:
        return outs
    built = on_host_if_cheap(
        lambda *d: [recompute(*d)[i] for i in hosted],
        list(dynamic),
        HOST_BUILD_LIMIT,
        name="building host-resident outputs",
        flatten=flatten,
    )
    for i, x in zip(hosted, built or [to_host(outs[i]) for i in hosted]):
        outs[i] = x
    return outs


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
    remake: Callable[..., Callable[..., list]]  # `flat` under another plan
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
    """Trace `call` on abstract values typed by the plan, place the outputs it creates
    where their annotations say, then build its `jax.jit`."""
    cell: list = []
    placing: list = [None]  # each output's memory, once the first trace has shown them
    platform = _device_of(dynamic).platform

    def remake(other: Plan, check: bool = True) -> Callable[..., list]:
        return make_flat(call, other, treedef, mask, statics, cell, check, placing[0])

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
    out_treedef, out_static, out_mask = cell
    created = plan.outputs(out_treedef, out_static, out_mask, traced.jaxpr.out_avals)
    plan.check_strategy(created)
    memories = tuple(None if leaf is None else leaf.memory for leaf in created)
    traced_memories = (
        "pinned_host" if is_host_aval(a) else "device" for a in traced.jaxpr.out_avals
    )
    if any(m is not None and m != t for m, t in zip(memories, traced_memories)):
        placing[0] = memories
        entry.flat = flat = remake(plan)
        traced = jax.jit(flat).trace(*abstract)
    plan.check_offloads(traced.jaxpr.jaxpr)
    check_host_compute(traced.jaxpr, platform, f"this machine's {platform!r} device")
    entry.jaxpr = traced.jaxpr
    entry.out_avals = tuple(traced.jaxpr.out_avals)
    entry.out_shardings = plan.output_shardings(
        out_treedef, out_mask, entry.out_avals, _device_of(dynamic), created
    )
    entry.donate_argnums = plan.donated(donate, out_treedef, out_mask, entry.out_avals, keep_root)
    entry.jitted = jax.jit(
        flat,
        in_shardings=in_shardings,
        out_shardings=list(entry.out_shardings),
        donate_argnums=entry.donate_argnums,
    )
    return entry
