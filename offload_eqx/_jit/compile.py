"""One compiled entry of `ox.filter_jit`: the user's function traced once into a program
of its array leaves, compiled with the plan's shardings and donation.

The function the user wrote takes pytrees; `make_flat` makes it a function of the array
leaves in plan order that rebuilds the call around the static leaves of the cache key,
traces it under the plan (the regions and `ox.name` read it) and checks that every
declared name was produced. That function is traced once per entry: the program that is
compiled and run evaluates the traced jaxpr, with the outputs the step creates moved to
the memory their annotations give them, so the output types, donation and shardings
are decided from one trace (as `eqx.filter_jit` traces once), and the user's Python runs
once per compilation.
"""

import dataclasses
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.extend as jex
import numpy as np
from jax.core import eval_jaxpr

from .._host.compute import (
    HOST_UPDATE,
    check_host_compute,
    compiler_options,
    fetched_from_host,
    host_computations,
    on_host_if_cheap,
    writes_in_place,
)
from .._plan.plan import LeafPlan, Plan
from .._plan.walk import format_keys, is_array_leaf
from .._sharding.memory_space import (
    is_host_aval,
    is_host_typed,
    match_type,
    to_device,
    to_host,
)
from .._sharding.mesh import put, same_place, traced_type
from .._trace.state import tracing
from .gpu_compiles import chosen_at_first_call
from .host_use import complex_saved_error, is_host_use, locate_host_use, saves_complex
from .miscompiled import refuse_miscompiled
from .ordered import check_ordered_with_host
from .retrace import check_types, types_of
from .runtime_errors import checks_at_run_time, raises_at_run_time
from .sent_per_trip import evaluated_sending, sent_per_trip

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
) -> Callable[..., list]:
    """The user's function of the array leaves: rebuild the arguments, call under `plan`,
    check the names, and return the array outputs (their structure goes in `out_cell`)."""

    def flat(*dynamic):
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
        if check:
            plan.check_names(state.inside_regions, state.outside_regions, state.regions)
        return [x for x, m in zip(out_leaves, out_mask) if m]

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


def _placing(fn: Callable[..., list], memories: tuple | None, flatten: bool) -> Callable:
    """`fn` with its outputs placed in `memories` (None: as traced)."""
    if memories is None:
        return fn

    def placed(*dynamic):
        return _placed(fn(*dynamic), memories, fn, dynamic, flatten)

    return placed


def program_of(closed: Any, memories: tuple | None, flatten: bool, name: str) -> Callable:
    """The program an entry compiles: the traced jaxpr `closed` evaluated on the array
    leaves, with its outputs placed in `memories`. Named like the user's function, so
    that the compiled module is `jit_<name>`."""

    def run(*dynamic):
        return eval_jaxpr(closed.jaxpr, closed.consts, *dynamic)

    placed = _placing(run, memories, flatten)

    def program(*dynamic):
        check_types(dynamic, closed.in_avals)
        return placed(*dynamic)

    program.__name__ = program.__qualname__ = name
    return program


@dataclasses.dataclass
class Compilation:
    """What `ox.filter_jit` compiles for one cache entry: a flat function of the array
    leaves, and everything needed to compile it for another backend (`ox.memory_report`)
    or to walk its program (`ox.audit`)."""

    jitted: Any  # jax.jit(flat, in_shardings, out_shardings, donate_argnums)
    flat: Callable[..., list]  # array leaves in, array leaves out (the program)
    plan: Plan  # plan.leaves[i] describes argument i of `flat`
    types: tuple  # the arguments' shapes, dtypes and weak types (`types_of`)
    in_shardings: tuple  # each argument's planned sharding (where it is moved if not there)
    out_avals: tuple  # traced output types (memory space included)
    out_shardings: tuple
    donate_argnums: tuple[int, ...]
    # [out_treedef, out_static, out_mask], from the trace of the function.
    out_cell: list
    remake: Callable[..., Callable[..., list]]  # the user's function under another plan
    # The program (a ClosedJaxpr): the audit walks it rather than tracing again.
    jaxpr: Any = None
    # Whether the program can raise at run time (`eqx.error_if`): its calls then wait for
    # it to finish, so that the error is raised by the call, as `eqx.filter_jit` does.
    checks: bool = False
    key: Any = None  # the cache key it is held under (structure and static leaves)
    donate: str = "none"  # the wrapper's option (its warnings at the compiling call)
    first_call: bool = True  # the next call compiles the program
    # The donated arguments in host memory that only a target inlining the host
    # computation donates (`Plan.donated`); the deviceless compiles read it.
    host_donated: tuple[int, ...] = ()

    def moved(self, dynamic: Sequence[Any]) -> list:
        """The arguments, each not yet in its planned memory (or, over a mesh, sharding)
        moved there explicitly; NumPy leaves planned in host memory uploaded there; an
        array in place whose type names another memory (Orbax restores host arrays typed
        as device memory) retyped without a copy."""
        return [
            put(x, s)
            if s is not None
            and (
                # jit uploads NumPy leaves itself, except into host memory
                (isinstance(x, (np.ndarray, np.generic)) and s.memory_kind == "pinned_host")
                or (isinstance(x, jax.Array) and not same_place(x.sharding, s, x.ndim))
            )
            else match_type(x)
            for x, s in zip(dynamic, self.in_shardings)
        ]

    def abstract(self, dynamic: Sequence[Any]) -> list[jax.ShapeDtypeStruct]:
        """Abstract arguments typed by their planned memory."""
        return abstract_arguments(self.plan, dynamic)

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
        """The user's function with the plan's mesh replaced by `mesh` (a compile-only
        target's mesh of the same axes), for `ox.shard` inside the step."""
        return self.remake(self.plan.on_mesh(mesh))

    def rebuild(self, dynamic_out: Sequence[Any]) -> Any:
        out_treedef, out_static, out_mask = self.out_cell
        if not out_static:  # all outputs are arrays: the common case, kept cheap
            return jax.tree_util.tree_unflatten(out_treedef, dynamic_out)
        dynamic_iter, static_iter = iter(dynamic_out), iter(out_static)
        leaves = [next(dynamic_iter) if m else next(static_iter) for m in out_mask]
        return jax.tree_util.tree_unflatten(out_treedef, leaves)


def abstract_arguments(plan: Plan, dynamic: Sequence[Any]) -> list[jax.ShapeDtypeStruct]:
    """The arguments as `ShapeDtypeStruct`s typed by their planned memory, with the dtype
    and weak type jit gives them."""
    return [
        jax.ShapeDtypeStruct(shape, dtype, sharding=traced_type(leaf.sharding), weak_type=weak)
        for (shape, dtype, weak), leaf in zip(types_of(dynamic), plan.leaves)
    ]


def places_on_devices(closed: Any) -> bool:
    """Whether a traced program says where its values go among devices (a
    `with_sharding_constraint` or `eqx.filter_shard` over several devices, a
    `jax.device_put` onto a sharding, a `shard_map`): off a mesh, jit then places the
    device arguments and results, as `jax.jit` does, so that they follow."""
    for eqn in getattr(closed, "jaxpr", closed).eqns:
        name = eqn.primitive.name
        if name == "shard_map":
            return True
        if name == "sharding_constraint" and _several_devices(eqn.params.get("sharding")):
            return True
        if name == "device_put" and any(
            isinstance(d, jax.sharding.Sharding) for d in eqn.params.get("devices", ())
        ):
            return True
        if any(places_on_devices(sub) for sub in jex.core.jaxprs_in_params(eqn.params)):
            return True
    return False


def _several_devices(sharding: Any) -> bool:
    try:
        return len(sharding.device_set) > 1
    except Exception:  # a sharding over an abstract mesh: devices not known here
        return True


def _trace(
    user: Callable[..., list], abstract: list, plan: Plan, caller: str, remake: Callable
) -> Any:
    """The one trace of the user's function, stacks sent a slice per trip (`sent_per_trip`);
    a host-resident leaf used where JAX cannot use it is reported by path."""
    try:
        return sent_per_trip(jax.jit(user).trace(*abstract).jaxpr)
    except (ValueError, TypeError) as error:
        if saves_complex(error):
            raise complex_saved_error(error, plan, caller) from None
        if not is_host_use(error):
            raise
        raise locate_host_use(remake(plan, False), abstract, plan, error, caller) from None


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
    name: str = "step",
    donate_on_error: bool = False,
) -> Compilation:
    """Trace `call` once on abstract values typed by the plan, place the outputs it
    creates where their annotations say, then build its `jax.jit`."""
    cell: list = []
    placing: list = [None]  # each output's memory, once the trace has shown them
    flatten = plan.mesh is None  # on a mesh, a reshape could reshard

    def remake(other: Plan, check: bool = True) -> Callable[..., list]:
        user = make_flat(call, other, treedef, mask, statics, [], check)
        return _placing(evaluated_sending(user), placing[0], flatten)

    # Traced on abstract values typed by the *planned* memory, whatever memory the
    # arguments are in now (they are moved before the first call).
    abstract = abstract_arguments(plan, dynamic)
    closed = _trace(
        make_flat(call, plan, treedef, mask, statics, cell), abstract, plan, caller, remake
    )
    out_treedef, out_static, out_mask = cell
    created = plan.outputs(out_treedef, out_static, out_mask, closed.out_avals)
    plan.check_strategy(created)
    memories = tuple(None if leaf is None else leaf.memory for leaf in created)
    traced_memories = ("pinned_host" if is_host_aval(a) else "device" for a in closed.out_avals)
    if any(m is not None and m != t for m, t in zip(memories, traced_memories)):
        placing[0] = memories
    program = program_of(closed, placing[0], flatten, name)
    if placing[0] is not None:
        closed = jax.jit(program).trace(*abstract).jaxpr
    plan.check_offloads(closed.jaxpr)
    hosted = [leaf.path for leaf in (*plan.leaves, *created) if _in_host(leaf)]
    check_ordered_with_host(closed, list(dict.fromkeys(hosted)), caller)
    platform = plan.device.platform
    check_host_compute(closed, platform, f"this machine's {platform!r} device")
    out_avals = tuple(closed.out_avals)
    host_update = bool(set(host_computations(closed)) & set(HOST_UPDATE))
    donation = (donate, out_treedef, out_mask, out_avals, keep_root, host_update)
    donation += (fetched_from_host(closed.jaxpr),)
    donated = plan.donated(*donation, host_in_place=writes_in_place(closed, platform))
    if donated and not donate_on_error:
        donated = _unless_it_can_raise(closed, donated, caller)
    # What a target whose host update is one call of its own (XLA:GPU, not split) does
    # not donate (`writes_in_place`), for the deviceless compiles (`Program.donated_on`).
    host_donated = tuple(sorted(set(donated) - set(plan.donated(*donation, host_in_place=False))))
    # Off a mesh, a program that places values on devices itself gets jit's placement
    # for its device arguments and results (None), as under `jax.jit`.
    to_jit = plan.mesh is None and places_on_devices(closed)
    out_shardings = plan.output_shardings(
        out_treedef, out_mask, out_avals, plan.device, created, donated, to_jit
    )

    def jit_with(options: dict[str, Any] | None) -> Any:
        return jax.jit(
            program,
            in_shardings=plan.argument_shardings(to_jit),
            out_shardings=list(out_shardings),
            donate_argnums=donated,
            # A donated argument the program does not read (the parameters an optimizer
            # with masters writes anew) is kept, so that its buffer takes the new value
            # in place; pruned, its donation is lost and every step allocates the output
            # afresh.
            keep_unused=bool(donated),
            compiler_options=options,
        )

    options = compiler_options(closed, platform)
    jitted = jit_with(options)
    entry = Compilation(
        jitted=jitted,
        flat=program,
        plan=plan,
        types=types_of(dynamic),
        in_shardings=tuple(leaf.sharding for leaf in plan.leaves),
        out_avals=out_avals,
        out_shardings=out_shardings,
        donate_argnums=donated,
        host_donated=host_donated,
        out_cell=cell,
        remake=remake,
        jaxpr=closed,
        checks=checks_at_run_time(closed),
        donate=donate,
    )
    entry = chosen_at_first_call(entry, options, jit_with)  # on a GPU, compiled ahead
    return refuse_miscompiled(entry, caller)  # on a GPU with a release known to miscompile


def _in_host(leaf: Any) -> bool:
    return leaf is not None and leaf.memory == "pinned_host"


_KEEPS_INPUTS = (
    "{caller}: the step can raise while it runs ({what}), so it donates nothing: a "
    "run-time error in a donating step deletes the model and optimizer state passed in, "
    "leaving nothing to resume from. The device holds the inputs and the outputs at once "
    "during the step; to donate anyway (and lose the inputs if it raises), pass "
    "`ox.filter_jit(..., donate_on_error=True)`."
)


def _unless_it_can_raise(closed: Any, donated: tuple, caller: str) -> tuple:
    """No donation for a program that can raise while it runs (with a warning saying
    what and how to donate anyway)."""
    what = raises_at_run_time(closed)
    if what is None:
        return donated
    warnings.warn(_KEEPS_INPUTS.format(caller=caller, what=what), stacklevel=5)
    return ()


def compile_transformed(
    call: Callable[[Any], Any],
    plan: Plan,
    treedef: Any,
    mask: Sequence[bool],
    statics: tuple,
    dynamic: Sequence[Any],
    caller: str,
    name: str = "step",
) -> Compilation:
    """The entry for a call under `jax.grad` or `jax.vmap` outside any jit (its array
    leaves are tracers): the function traced once on the tracers' own types, run by a
    plain `jax.jit` (no shardings, no donation: the transformation owns the values),
    whose trace JAX keeps, as a nested `eqx.filter_jit` does."""
    cell: list = []
    device = jax.devices()[0]
    abstract = [
        jax.ShapeDtypeStruct(
            shape,
            dtype,
            weak_type=weak,
            sharding=traced_type(
                jax.sharding.SingleDeviceSharding(
                    device, memory_kind="pinned_host" if is_host_typed(x) else "device"
                )
            ),
        )
        for (shape, dtype, weak), x in zip(types_of(dynamic), dynamic)
    ]

    def remake(other: Plan, check: bool = True) -> Callable[..., list]:
        return make_flat(call, other, treedef, mask, statics, [], check)

    closed = _trace(
        make_flat(call, plan, treedef, mask, statics, cell), abstract, plan, caller, remake
    )
    program = program_of(closed, None, True, name)
    return Compilation(
        jitted=jax.jit(program),
        flat=program,
        plan=plan,
        types=transformed_types(dynamic),
        in_shardings=tuple(leaf.sharding for leaf in plan.leaves),
        out_avals=tuple(closed.out_avals),
        out_shardings=(None,) * len(closed.out_avals),
        donate_argnums=(),
        out_cell=cell,
        remake=remake,
        jaxpr=closed,
    )


def transformed_types(dynamic: Sequence[Any]) -> tuple:
    """`types_of` and each leaf's memory space (a tracer's type carries it)."""
    return tuple((*t, is_host_typed(x)) for t, x in zip(types_of(dynamic), dynamic))
