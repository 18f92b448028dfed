"""`ox.filter_jit`: `eqx.filter_jit` that compiles a plan into shardings and donation.

Per call it flattens the arguments once, looks the static part up in a cache, and calls a
`jax.jit` whose arguments are the array leaves themselves: explicit `in_shardings` from
the plan (so an argument in the wrong memory is never silently copied), `out_shardings`
from the memory space of each traced output, and donation decided per leaf.
"""

import dataclasses
import functools
import inspect
from collections.abc import Callable
from typing import Any, Literal

import jax
import numpy as np
from jax.core import Tracer

from ._activations import recording
from ._context import type_matches, using_plan
from ._mesh import check_mesh, output_sharding, output_shardings, put, same_place
from ._plan import Plan, format_path
from ._strategy import Strategy, resolve_strategy

Donate = Literal["all", "all-except-first", "none"]
_DONATE = ("all", "all-except-first", "none")

_HOST_OUTSIDE_REGION = (
    "A host-resident array was used outside any `ox.scan`/`ox.checkpoint` region: "
    "{error} Host-resident leaves in this call: {paths}. Arrays in pinned_host memory are "
    "fetched to the device only inside regions; call the module that uses them through "
    "`ox.scan(...)` or `ox.checkpoint(...)`, or place them on the device "
    "(`ox.field(memory='device')`, or a strategy that keeps parameters on the device)."
)
_MISTYPED = (
    "Argument `{path}` is in {kind!r} memory but its type is `{type}`: it was probably "
    "made by a `jax.jit` whose `out_shardings` put a device-typed result in host memory, "
    "and JAX would compile it as device memory. Re-place it once, outside the step: "
    "`ox.place(...)`, or `jax.device_put(x, jax.memory.Space.Host)`."
)
_MEMORY_MISMATCH = "Memory kinds passed to jax.jit does not match"
_SHARDING_MISMATCH = "Sharding passed to jit does not match"


_DYNAMIC = (jax.Array, np.ndarray, np.generic, jax.ShapeDtypeStruct)


def _is_dynamic(x: Any) -> bool:
    return isinstance(x, _DYNAMIC)


def _labels(fn: Callable, args: tuple, kwargs: dict) -> list[tuple[str, Any]]:
    """Name each argument after the function's parameters, for readable leaf paths."""
    try:
        parameters = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        parameters = []
    roots = []
    positional = [
        p
        for p in parameters
        if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    ]
    for i, arg in enumerate(args):
        label = positional[i].name if i < len(positional) else f"args[{i}]"
        roots.append((label, arg))
    for key in sorted(kwargs):
        roots.append((key, kwargs[key]))
    return roots


@dataclasses.dataclass
class Compilation:
    """What `ox.filter_jit` compiles for one cache entry: a flat function of the array
    leaves, and everything needed to compile it for another backend (`ox.memory_report`)
    or to walk its program (`ox.audit`)."""

    jitted: Any  # jax.jit(flat, in_shardings, out_shardings, donate_argnums)
    flat: Callable[..., list]  # array leaves in, array leaves out
    plan: Plan  # plan.leaves[i] describes argument i of `flat`
    in_shardings: tuple  # None: not managed (compiled wherever the argument is)
    out_avals: tuple  # traced output types (memory space included)
    out_shardings: tuple
    donate_argnums: tuple[int, ...]
    # [out_treedef, out_static, out_mask], written by each trace of the function: a new
    # input shape retraces before the call returns, so the cell always matches the output.
    out_cell: list

    def abstract(self, dynamic: list) -> list[jax.ShapeDtypeStruct]:
        """Abstract arguments typed by their planned memory."""
        return [
            jax.ShapeDtypeStruct(
                np.shape(leaf),
                leaf.dtype,
                sharding=_typed(s if s is not None else getattr(leaf, "sharding", None)),
            )
            for leaf, s in zip(dynamic, self.in_shardings)
        ]

    @property
    def out_memories(self) -> tuple[str, ...]:
        return tuple("pinned_host" if _is_host_aval(a) else "device" for a in self.out_avals)

    def output_paths(self, root: str = "output") -> list[str]:
        """The leaf path of each array output, e.g. `output[0].layers.w1`."""
        out_treedef, out_static, out_mask = self.out_cell
        placeholders = jax.tree_util.tree_unflatten(out_treedef, list(range(len(out_mask))))
        paths = jax.tree_util.tree_flatten_with_path(placeholders)[0]
        return [format_path(root, path) for (path, i) in paths if out_mask[i]]

    def rebuild(self, dynamic_out):
        out_treedef, out_static, out_mask = self.out_cell
        if not out_static:  # all outputs are arrays: the common case, kept cheap
            return jax.tree_util.tree_unflatten(out_treedef, dynamic_out)
        dynamic_iter = iter(dynamic_out)
        static_iter = iter(out_static)
        leaves = [next(dynamic_iter) if m else next(static_iter) for m in out_mask]
        return jax.tree_util.tree_unflatten(out_treedef, leaves)


def _device_of(leaves: list) -> Any:
    for leaf in leaves:
        if isinstance(leaf, jax.Array):
            devices = leaf.sharding.device_set
            if len(devices) == 1:
                return next(iter(devices))
    return jax.devices()[0]


class _JitWrapper:
    __name__: str  # set by `functools.update_wrapper`

    def __init__(self, fn: Callable, strategy: Strategy, donate: Donate, mesh, audit: bool):
        self.fn = fn
        self.audit = audit
        self.strategy = strategy
        self.donate = donate
        self.mesh = mesh
        self._cache: dict[Any, Compilation] = {}
        functools.update_wrapper(self, fn)

    def __get__(self, instance, owner=None):
        if instance is None:
            return self
        return functools.partial(self, instance)

    # -- the per-call path -----------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.audit:
            from ._guard import no_implicit_transfers

            with no_implicit_transfers(_labels(self.fn, args, kwargs)):
                return self._call(args, kwargs)
        return self._call(args, kwargs)

    def _call(self, args: tuple, kwargs: dict) -> Any:
        leaves, treedef = jax.tree_util.tree_flatten((args, kwargs))
        dynamic = []
        statics = []
        mask = []
        for leaf in leaves:
            if isinstance(leaf, _DYNAMIC):
                if isinstance(leaf, Tracer):
                    # Called inside another trace: inline, like a nested jax.jit would.
                    return self.fn(*args, **kwargs)
                dynamic.append(leaf)
                mask.append(True)
            else:
                statics.append(leaf)
                mask.append(False)
        mask = tuple(mask)
        key = (treedef, mask, tuple(statics))
        try:
            entry = self._cache.get(key)
        except TypeError as e:
            raise TypeError(
                f"ox.filter_jit({getattr(self.fn, '__name__', self.fn)}): a non-array "
                f"argument is not hashable ({e}). Non-array leaves are static (part of the "
                "compile cache key), so they must be hashable: pass arrays for values that "
                "change, or make the object hashable."
            ) from None
        if entry is None:
            entry = self._compile(args, kwargs, leaves, treedef, mask, dynamic)
            self._cache[key] = entry
            dynamic = _move(dynamic, entry.in_shardings)
        try:
            out = entry.jitted(*dynamic)
        except ValueError as e:
            if _MEMORY_MISMATCH not in str(e) and _SHARDING_MISMATCH not in str(e):
                raise
            # Arguments not yet where the plan puts them (e.g. a new strategy on a model
            # placed for another): move them once, explicitly. The outputs come back in
            # planned memory, so the next call moves nothing. Under audit, a cached step
            # that keeps receiving misplaced arguments is an error: it would copy them on
            # every call.
            if self.audit:
                _raise_misplaced(entry, dynamic)
            out = entry.jitted(*_move(dynamic, entry.in_shardings))
        return entry.rebuild(out)

    # -- compiling an entry ----------------------------------------------------------

    def plan(self, *args: Any, **kwargs: Any) -> Plan:
        """The plan this function applies to these arguments (nothing is compiled)."""
        return Plan(_labels(self.fn, args, kwargs), self.strategy, self.mesh)

    def _donated(self, plan: Plan, args: tuple, dynamic: list, out_avals) -> tuple[int, ...]:
        if self.donate == "none":
            return ()
        first = 0
        if self.donate == "all-except-first" and args:
            first = sum(1 for leaf in jax.tree_util.tree_leaves(args[0]) if _is_dynamic(leaf))
        outputs: dict[tuple, int] = {}
        for aval in out_avals:
            key = (tuple(aval.shape), aval.dtype, _is_host_aval(aval))
            outputs[key] = outputs.get(key, 0) + 1
        donated = []
        for i, (leaf, leaf_plan) in enumerate(zip(dynamic, plan.leaves)):
            if i < first or isinstance(leaf, (np.ndarray, np.generic)):
                continue  # numpy arguments are copied in anyway: nothing to donate
            current = getattr(leaf, "sharding", None)  # a ShapeDtypeStruct may have none
            host = leaf_plan.memory == "pinned_host" or (
                leaf_plan.memory is None
                and current is not None
                and current.memory_kind == "pinned_host"
            )
            key = (leaf_plan.shape, leaf_plan.dtype, host)
            if outputs.get(key, 0) == 0:
                continue  # no output could reuse it: donating would only warn
            outputs[key] -= 1
            donated.append(i)
        return tuple(donated)

    def _make_flat(self, plan: Plan, treedef, mask, statics, entry_cell: list):
        fn = self.fn

        def flat(*dynamic):
            dynamic_iter = iter(dynamic)
            static_iter = iter(statics)
            leaves = [next(dynamic_iter) if m else next(static_iter) for m in mask]
            args, kwargs = jax.tree_util.tree_unflatten(treedef, leaves)
            with using_plan(plan, dynamic), recording() as record:
                try:
                    out = fn(*args, **kwargs)
                except ValueError as e:
                    if "memory_space of all inputs" not in str(e):
                        raise
                    paths = ", ".join(f"`{leaf.path}`" for leaf in plan.leaves_in("pinned_host"))
                    raise ValueError(
                        _HOST_OUTSIDE_REGION.format(
                            error=str(e).split("\n")[0], paths=paths or "none"
                        )
                    ) from None
            plan.check_trace(record.inside_regions, record.outside_regions, record.regions)
            out_leaves, out_treedef = jax.tree_util.tree_flatten(out)
            out_mask = tuple(map(_is_dynamic, out_leaves))
            entry_cell[:] = [
                out_treedef,
                tuple(x for x, m in zip(out_leaves, out_mask) if not m),
                out_mask,
            ]
            return [x for x, m in zip(out_leaves, out_mask) if m]

        return flat

    def _compile(self, args, kwargs, leaves, treedef, mask, dynamic) -> Compilation:
        plan = Plan(_labels(self.fn, args, kwargs), self.strategy, self.mesh)
        for leaf, leaf_plan in zip(dynamic, plan.leaves):
            if isinstance(leaf, jax.Array) and not type_matches(leaf):
                raise ValueError(
                    _MISTYPED.format(
                        path=leaf_plan.path,
                        kind=leaf.sharding.memory_kind,
                        type=jax.typeof(leaf).str_short(),
                    )
                )
        plan.check_strategy()
        statics = tuple(leaf for leaf, m in zip(leaves, mask) if not m)
        # Every argument gets an explicit sharding, unmanaged ones their current one: JAX
        # pairs donated inputs with outputs by memory kind only when all memory kinds
        # are known; otherwise it may alias a device buffer to a host output (or the
        # reverse), and the runtime aborts the process.
        in_shardings = tuple(
            plan.sharding(leaf_plan, getattr(leaf, "sharding", None))
            for leaf, leaf_plan in zip(dynamic, plan.leaves)
        )
        cell: list = []
        flat = self._make_flat(plan, treedef, mask, statics, cell)
        entry = Compilation(
            jitted=None,
            flat=flat,
            plan=plan,
            in_shardings=in_shardings,
            out_avals=(),
            out_shardings=(),
            donate_argnums=(),
            out_cell=cell,
        )
        # Trace on abstract values typed by the *planned* memory, whatever memory the
        # arguments are in now (they are moved before the first call).
        try:
            traced = jax.jit(flat).trace(*entry.abstract(dynamic))
        except ValueError as error:
            if not str(error).startswith("A host-resident array was used outside"):
                raise
            # Name the leaf itself: retrace with one host-resident leaf at a time
            # (costly, but only on this error path).
            from ._audit import _locate_host_use

            raise _locate_host_use(self, args, kwargs, error, "ox.filter_jit") from None
        entry.out_avals = tuple(traced.jaxpr.out_avals)
        device = _device_of(dynamic)
        if plan.mesh is None:
            entry.out_shardings = tuple(
                _out_sharding(aval, device, None) for aval in entry.out_avals
            )
        else:  # outputs shaped like an argument keep its shardings (see _mesh)
            entry.out_shardings = output_shardings(
                plan.mesh, (args, kwargs), in_shardings, _is_dynamic, cell, entry.out_avals
            )
        entry.donate_argnums = self._donated(plan, args, dynamic, entry.out_avals)
        entry.jitted = jax.jit(
            flat,
            in_shardings=in_shardings,
            out_shardings=list(entry.out_shardings),
            donate_argnums=entry.donate_argnums,
        )
        return entry

    def _entry_for(self, args, kwargs) -> tuple[Compilation, list]:
        leaves, treedef = jax.tree_util.tree_flatten((args, kwargs))
        mask = tuple(map(_is_dynamic, leaves))
        statics = tuple(leaf for leaf, m in zip(leaves, mask) if not m)
        dynamic = [leaf for leaf, m in zip(leaves, mask) if m]
        key = (treedef, mask, statics)
        entry = self._cache.get(key)
        if entry is None:
            entry = self._compile(args, kwargs, leaves, treedef, mask, dynamic)
            self._cache[key] = entry
        return entry, dynamic

    def trace(self, *args: Any, **kwargs: Any) -> jax.stages.Traced:
        """Trace for these arguments (arrays or `jax.ShapeDtypeStruct`s), like `jax.jit`."""
        entry, dynamic = self._entry_for(args, kwargs)
        return entry.jitted.trace(*entry.abstract(dynamic))

    def compilation(self, *args: Any, **kwargs: Any) -> tuple[Compilation, list]:
        """The cache entry for these arguments and their array leaves (for reports and
        the audit: `entry.flat`, `entry.plan`, `entry.abstract(leaves)`)."""
        return self._entry_for(args, kwargs)

    def lower(self, *args: Any, **kwargs: Any) -> jax.stages.Lowered:
        """Lower for these arguments (arrays or `jax.ShapeDtypeStruct`s), like `jax.jit`."""
        return self.trace(*args, **kwargs).lower()


def _raise_misplaced(entry: Compilation, dynamic: list) -> None:
    from ._guard import ImplicitTransferError

    misplaced = [
        f"`{leaf_plan.path}` is in {x.sharding.memory_kind!r}, planned {s.memory_kind!r}"
        for x, s, leaf_plan in zip(dynamic, entry.in_shardings, entry.plan.leaves)
        if s is not None and isinstance(x, jax.Array) and x.sharding.memory_kind != s.memory_kind
    ]
    if misplaced:
        raise ImplicitTransferError(
            "Arguments of a compiled step are not in their planned memory: "
            + "; ".join(misplaced)
            + ". They would be copied on every call. Pass the step's own outputs back in, "
            "or place the arguments once before the loop: `ox.place(tree, strategy)`."
        )


def _move(dynamic: list, shardings: tuple) -> list:
    """Explicitly move the arguments whose memory kind (or, over a mesh, whose sharding)
    differs from the plan's."""
    return [
        put(x, s)
        if s is not None and isinstance(x, jax.Array) and not same_place(x.sharding, s, x.ndim)
        else x
        for x, s in zip(dynamic, shardings)
    ]


@functools.cache
def _single_device_mesh(device: Any) -> jax.sharding.Mesh:
    return jax.sharding.Mesh(np.array([device]), ("_device",))


def _typed(sharding):
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


def _is_host_aval(aval) -> bool:
    return getattr(aval, "memory_space", None) == jax.memory.Space.Host


def _out_sharding(aval, device, mesh):
    memory = "pinned_host" if _is_host_aval(aval) else "device"
    if mesh is not None:
        # Outputs keep their shardings (an FSDP parameter stays sharded); see _mesh.
        return output_sharding(aval, mesh, memory)
    return jax.sharding.SingleDeviceSharding(device, memory_kind=memory)


def filter_jit(
    fn: Callable | None = None,
    *,
    strategy: "str | Strategy | None" = None,
    donate: str = "none",
    mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh | None = None,
    audit: bool = False,
) -> Any:
    """`eqx.filter_jit` that compiles the placement plan of its arguments.

    **Arguments:**

    - `fn`: the function. Array leaves of its arguments are traced, everything else is
        static, as in `eqx.filter_jit`. Both `@ox.filter_jit` and `@ox.filter_jit(...)`.
    - `strategy`: `"annotated"` (default: the model's own annotations), `"baseline"`,
        `"remat"`, `"offload_activations"`, `"offload_params"`, `"offload_optimizer"`,
        `"hybrid"`, or an `ox.Strategy`.
    - `donate`: `"all"`, `"all-except-first"` or `"none"`, decided per array leaf.
    - `mesh`: the mesh for leaves declared with a partition spec.
    - `audit`: run every call under `ox.no_implicit_transfers()`: an argument that would
        be copied implicitly (a numpy array, a Python scalar, an array on another device)
        is an error naming its leaf path.

    Arguments are compiled with explicit input shardings from the plan; outputs get the
    memory kind of their traced type, so a host-resident parameter updated with
    `ox.apply_updates` comes back in `pinned_host`. Arguments that are not yet where the
    plan puts them are moved there once, explicitly, on the call.
    """
    strategy = resolve_strategy(strategy)
    check_mesh(mesh, where="ox.filter_jit(mesh=...)")
    if donate not in _DONATE:
        raise ValueError(
            f"ox.filter_jit(donate={donate!r}): expected one of "
            + ", ".join(repr(d) for d in _DONATE)
            + "."
        )
    if fn is None:
        return functools.partial(
            filter_jit, strategy=strategy, donate=donate, mesh=mesh, audit=audit
        )
    return _JitWrapper(fn, strategy, donate, mesh, audit)
