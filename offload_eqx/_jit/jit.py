"""`ox.filter_jit`: `eqx.filter_jit` that compiles a plan into shardings and donation.

The wrapper is an `eqx.Module`, and the function is partitioned with its arguments as in
`eqx.filter_jit`: a module (or a bound method of one) as the function has its arrays
traced, planned (`fn.layers[1].weight`), placed and donated like any argument. Per call
it flattens once, looks the static part (structure, static leaves, shapes and dtypes) up
in a cache, and calls a `jax.jit` whose arguments are the array leaves themselves.
"""

import inspect
import warnings
from typing import Any, Literal

import equinox as eqx
import jax

from .._base.errors import ImplicitTransferError
from .._base.jax_private import DynamicJaxprTrace, current_trace
from .._declare.strategy import Strategy, resolve_strategy
from .._plan.plan import Plan
from .._plan.walk import ARRAY_TYPES, format_keys
from .._sharding.mesh import check_mesh, resolve_mesh
from .._trace.state import current, tracing
from .aot import Lowered, refuse_ahead_of_time
from .cache import Cache, cache_of
from .compile import (
    Compilation,
    compile_entry,
    compile_transformed,
    transformed_types,
)
from .dispatch import Method, as_pytree, bind, call, describe, root_of, split
from .retrace import types_of

Donate = Literal["all", "all-except-first", "warn", "warn-except-first", "none"]
_DONATE = ("all", "all-except-first", "warn", "warn-except-first", "none")
# A wrapper warns once its cache holds this many compilations (see `_compile_new`).
CACHE_WARNING = 32

_STATIC_RECOMPILE = (
    "ox.filter_jit({name}, audit=True): {leaves} changed since the last call; non-array "
    "leaves are static, so every new value compiles the step again. Pass arrays for "
    "values that change (`jnp.asarray(...)`)."
)
_CACHE_GROWS = (
    "ox.filter_jit({name}) has compiled {count} versions of the step, and keeps each "
    "program in memory. {why} `step.compilations` counts them; `ox.clear_caches()` "
    "frees them."
)
_STATICS_DIFFER = (
    "The static (non-array) leaves that differ between them include {leaves}: every new "
    "static value compiles again, so pass arrays for values that change."
)
_SHAPES_DIFFER = (
    "{count} of them differ only in the shapes or dtypes of their arrays (a batch size or "
    "sequence length per call compiles once per size): pad or bucket them to a few sizes."
)


def _cache_grows(name: str, keys: list, changed: str) -> str:
    """Why a wrapper keeps compiling: the statics that changed, or the shapes (keys that
    repeat: the same static part compiled for other shapes)."""
    reshaped = len(keys) - len(set(keys))
    why = []
    if changed:
        why.append(_STATICS_DIFFER.format(leaves=changed))
    if reshaped:
        why.append(_SHAPES_DIFFER.format(count=reshaped + 1))
    if not why:
        why.append("Their arguments differ in structure (other trees or options).")
    return _CACHE_GROWS.format(name=name, count=len(keys), why=" ".join(why))


def _signature(fn: Any) -> inspect.Signature | None:
    try:
        return inspect.signature(fn)
    except (TypeError, ValueError):
        return None


class FilterJit(eqx.Module):
    """What `ox.filter_jit` returns: an `eqx.Module` wrapping the function.

    Call it like the function. `.plan(*args)`, `.trace(*args)`, `.lower(*args)` and
    `.compilation(*args)` take the same arguments (arrays or `jax.ShapeDtypeStruct`s).
    `.fn` is the wrapped function; `.strategy`, `.donate` and `.mesh` are the options it
    was made with. `.last_outputs` holds the outputs of the latest donating call and
    `.compilations` counts the programs compiled so far.
    """

    fn: Any
    strategy: Strategy = eqx.field(static=True)
    donate: str = eqx.field(static=True)
    mesh: Any = eqx.field(static=True)
    audit: bool = eqx.field(static=True)
    donate_on_error: bool = eqx.field(static=True)
    fn_has_arrays: bool = eqx.field(static=True)
    signature: Any = eqx.field(static=True, repr=False)
    cache: Cache = eqx.field(static=True, repr=False)

    @property
    def __wrapped__(self):
        return self.fn.bound if isinstance(self.fn, Method) else self.fn

    def __get__(self, instance, owner=None):
        if instance is None:
            return self
        return jax.tree_util.Partial(self, instance)

    # -- the per-call path: `_call`, a module-level function (see there) ----------------

    __call__ = call  # the per-call path, a module-level function (see there)

    def _inline(self, args: tuple, kwargs: dict, key: tuple, dynamic: list) -> Any:
        """Called with tracers. Under a transformation outside any jit (`jax.grad(step)`,
        `jax.vmap(step)`), the function is traced once and its program cached, as a
        nested `eqx.filter_jit` is. Inside another jit, it runs inline under this
        wrapper's own plan, and its names count for the outer trace too."""
        if not _inside_jit():
            return self._transformed(args, kwargs, key, dynamic)
        plan = self.plan(*args, **kwargs)
        outer = current()
        with tracing(plan, dynamic) as state:
            out = self.fn(*args, **kwargs)
        plan.check_names(state.inside_regions, state.outside_regions, state.regions)
        if outer is not None:
            outer.inside_regions |= state.inside_regions
            outer.outside_regions |= state.outside_regions
            outer.regions += state.regions
        return out

    def _transformed(self, args: tuple, kwargs: dict, key: tuple, dynamic: list) -> Any:
        held = ("transformed", *key, transformed_types(dynamic))
        entry = self.cache.entries.get(held)
        if entry is None:
            name = describe(self.fn)
            treedef, mask, statics = key
            entry = compile_transformed(
                self._caller(),
                self.plan(*args, **kwargs),
                treedef,
                mask,
                statics,
                dynamic,
                f"ox.filter_jit({name})",
                name,
            )
            self.cache.entries[held] = entry
        return entry.rebuild(entry.jitted(*dynamic))

    def _caller(self) -> Any:
        """The call of the function on the rebuilt tree of its arguments."""
        fn = self.fn
        if self.fn_has_arrays:
            return lambda t: t[0](*t[1], **t[2])
        return lambda t: fn(*t[0], **t[1])

    def _tree(self, args: tuple, kwargs: dict) -> tuple:
        return (self.fn, args, kwargs) if self.fn_has_arrays else (args, kwargs)

    # -- compiling an entry ------------------------------------------------------------

    def arguments(self, *args: Any, **kwargs: Any) -> list[tuple[str, Any]]:
        """Each argument with its label (the function's parameter names), in the order
        of the array leaves of the call: `[("model", model), ("x", x)]`."""
        args, kwargs = bind(self.signature, args, kwargs)
        parameters = [] if self.signature is None else list(self.signature.parameters.values())
        positional = [
            p.name
            for p in parameters
            if p.kind
            in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        ]
        roots = [("fn", root_of(self.fn))] if self.fn_has_arrays else []
        for i, arg in enumerate(args):
            roots.append((positional[i] if i < len(positional) else f"args[{i}]", arg))
        roots.extend((key, kwargs[key]) for key in sorted(kwargs))
        return roots

    def plan(self, *args: Any, **kwargs: Any) -> Plan:
        """The plan this function applies to these arguments (nothing is compiled)."""
        return Plan(self.arguments(*args, **kwargs), self.strategy, self.mesh)

    def _compile_new(self, key: tuple, args: tuple, kwargs: dict, dynamic: list) -> Compilation:
        args, kwargs = bind(self.signature, args, kwargs)
        name = describe(self.fn)
        entries = self.cache.entries
        # What this wrapper compiled before (the cache is shared by every wrapper of the
        # function: another wrapper's configuration is not a change of this one's).
        mine = self.cache.keys_of(self)
        similar = [k for k in mine if k[:2] == key[:2] and k != key]
        mine.append(key)
        changed = ""
        if similar:
            roots = self.arguments(*args, **kwargs)
            changed = _changed_statics(roots, similar[-1][2], key[2])
            if self.audit and changed:
                raise ImplicitTransferError(_STATIC_RECOMPILE.format(name=name, leaves=changed))
        # Counted in programs, whatever made them differ: new static values, new shapes
        # (a batch size per call) or new structures.
        if len(mine) == CACHE_WARNING:
            warnings.warn(_cache_grows(name, mine, changed), stacklevel=4)
        plan = self.plan(*args, **kwargs)
        keep_root = None
        if self.donate.endswith("except-first") and args:
            keep_root = 1 if self.fn_has_arrays else 0
        treedef, mask, statics = key
        entry = compile_entry(
            self._caller(),
            plan,
            treedef,
            mask,
            statics,
            dynamic,
            self.donate,
            keep_root,
            f"ox.filter_jit({name})",
            name,
            self.donate_on_error,
        )
        entry.key = key
        held = entries.get(key)
        if held is None:
            entries[key] = entry
        else:  # another shape under the same key: hold every entry by its types
            by_types = held if type(held) is dict else {held.types: held}
            by_types[entry.types] = entry
            entries[key] = by_types
        return entry

    @property
    def last_outputs(self) -> Any:
        """The outputs of the latest call that donated its inputs, until the next call.

        A Ctrl-C in a training loop can arrive after a step has donated (deleted) its
        inputs and before the loop has rebound its names to the outputs; the wrapper
        holds it until the loop has them (it is raised by the next donating call, before
        that call donates), and then keeps the outputs here as well. Otherwise they are
        held weakly: given here while the loop's names (or anything else) keep them (an
        array dropped since, such as a loss the loop did not keep, is None), and None
        once all are dropped, so a finished run's state does not stay in device memory.
        (A wrapper that donates nothing keeps nothing.)"""
        return self.cache.last_outputs

    @property
    def compilations(self) -> int:
        """How many programs this wrapper has compiled (one per static part and shapes)."""
        entries = self.cache.entries.values()
        return sum(len(e) if type(e) is dict else 1 for e in entries)

    def _distinct(self, entry: Compilation, dynamic: list) -> list:
        """The arguments with every repeated array that is donated where it occurs again
        replaced by a copy: XLA takes each donated buffer once, and the same array can
        sit in two arguments (`eqx.nn.State(model)` shares the model's initial state
        arrays; `step(model, model)`)."""
        seen: dict[int, int] = {}
        donated = set(entry.donate_argnums)
        distinct = list(dynamic)
        for i, x in enumerate(dynamic):
            j = seen.setdefault(id(x), i)
            if j != i and (i in donated or j in donated) and isinstance(x, jax.Array):
                distinct[i] = jax.device_put(x, x.sharding, may_alias=False)
        return distinct

    def _entry_for(self, args: tuple, kwargs: dict) -> tuple[Compilation, list]:
        key, dynamic, _ = split(self, args, kwargs)
        entry = self.cache.entries.get(key)
        if type(entry) is dict:
            entry = entry.get(types_of(dynamic))
        elif entry is not None and entry.types != types_of(dynamic):
            entry = None
        if entry is None or self.mesh_changed(entry, args, kwargs):
            entry = self._compile_new(key, args, kwargs, dynamic)
        return entry, dynamic

    def mesh_changed(self, entry: Compilation, args: tuple, kwargs: dict) -> bool:
        """Whether these arguments are on another mesh than the one `entry` was planned
        for (the cache key holds no mesh: the same step compared on two targets, or
        moved to another mesh, is planned again)."""
        return resolve_mesh(self.arguments(*args, **kwargs), self.mesh) != entry.plan.mesh

    def compilation(self, *args: Any, **kwargs: Any) -> tuple[Compilation, list]:
        """The cache entry for these arguments and their array leaves (for reports and
        the audit: `entry.flat`, `entry.plan`, `entry.abstract(leaves)`)."""
        return self._entry_for(args, kwargs)

    def trace(self, *args: Any, **kwargs: Any) -> jax.stages.Traced:
        """Trace for these arguments (arrays or `jax.ShapeDtypeStruct`s), like `jax.jit`."""
        entry, dynamic = self._entry_for(args, kwargs)
        return entry.jitted.trace(*entry.abstract(dynamic))

    def lower(self, *args: Any, **kwargs: Any) -> Lowered:
        """Lower for these arguments (arrays or `jax.ShapeDtypeStruct`s), like
        `eqx.filter_jit`: `.compile()` gives a program called like this step
        (`step.lower(model, x).compile()(model, x)`)."""
        entry, _ = self._entry_for(args, kwargs)
        caller = f"ox.filter_jit({describe(self.fn)})"

        def split_call(args: tuple, kwargs: dict) -> tuple:
            key, dynamic, _ = split(self, args, kwargs)
            return key, types_of(dynamic), dynamic

        return Lowered(self.trace(*args, **kwargs).lower(), entry, split_call, caller, self)


def _inside_jit() -> bool:
    """Whether a jaxpr trace (a `jax.jit`, a scan body, ...) encloses the current call,
    under any transformations of it; False under `jax.grad`/`jax.vmap` run eagerly."""
    trace = current_trace()
    while trace is not None:
        if isinstance(trace, DynamicJaxprTrace):
            return True
        trace = getattr(trace, "parent_trace", None)
    return False


def _changed_statics(roots: list[tuple[str, Any]], old: tuple, new: tuple) -> str:
    """The paths and values of the static leaves that differ between two cache keys."""
    paths = [
        label + format_keys(p)
        for label, tree in roots
        for p, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]
        if not isinstance(leaf, ARRAY_TYPES)
    ]
    changed = [
        f"`{path}` ({a!r} -> {b!r})" for path, a, b in zip(paths, old, new) if a is not b and a != b
    ]
    return ", ".join(changed[:3])


def step_of(fn: Any, where: str) -> FilterJit:
    """What the planners and reports (`where`: `"ox.estimate"`) trace: `fn` itself if an
    `ox.filter_jit` step, else `fn` wrapped in one; a program compiled ahead of time is
    refused, saying to pass the step."""
    refuse_ahead_of_time(fn, where)
    return fn if isinstance(fn, FilterJit) else filter_jit(fn)


def filter_jit(
    fn: Any = None,
    *,
    strategy: "str | Strategy | Plan | None" = None,
    donate: str = "none",
    mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh | None = None,
    audit: Any = False,  # checked below, with a message that says what was meant
    donate_on_error: bool = False,
    **jit_options: Any,  # refused below, with what is accepted
) -> Any:
    """`eqx.filter_jit` that compiles the placement plan of its arguments.

    **Arguments:**

    - `fn`: the function, or a module (or a bound method of one) whose arrays are then
        traced, planned and donated like an argument's (paths `fn.layers[0].weight`).
        Array leaves of its arguments are traced, everything else is static, as in
        `eqx.filter_jit`. Both `@ox.filter_jit` and `@ox.filter_jit(...)`.
    - `strategy`: `"annotated"` (default: the model's own annotations), `"baseline"`,
        `"remat"`, `"offload_activations"`, `"offload_params"`, `"offload_optimizer"`,
        `"hybrid"`, an `ox.Strategy`, or an `ox.Plan` (its strategy and mesh).
    - `donate`: `"all"`, `"all-except-first"`, `"warn"`, `"warn-except-first"` or
        `"none"`, as in `eqx.filter_jit`, decided per array leaf: a leaf is donated when
        the step returns its new value in the same memory (see the docs' "The compiled
        step"). The first argument is the first one of the function's signature, however
        passed. `"warn"` variants donate the same and let JAX's warning about donated
        buffers the program could not reuse through. A program that can raise while it
        runs (an `eqx.error_if` check, a `jax.debug.callback`, any host callback) donates
        nothing, with a warning, unless `donate_on_error=True`: a run-time error would
        otherwise delete the model and optimizer state passed in, leaving nothing to
        resume from.
    - `mesh`: the mesh for leaves declared with a partition spec.
    - `audit`: run every call under `ox.no_implicit_transfers()`: an argument that would
        be copied implicitly (a numpy array, a Python scalar, an array on another device)
        is an error naming its leaf path, and so is a static leaf whose new value would
        compile the step again.
    - `donate_on_error`: donate as `donate` says even in a program that can raise while
        it runs (its donated inputs are lost if it does: keep a checkpoint); the device
        then holds one copy of the state instead of two during the step.
    - `**jit_options`: other `jax.jit` options are refused (the plan decides shardings
        and donation).

    Host-resident arguments are compiled with explicit shardings from the plan (on a mesh,
    every argument); a device argument off a mesh is placed by jit as `jax.jit` places
    it. Outputs get the memory kind of their traced type, so a host-resident parameter
    updated with `ox.apply_updates` comes back in `pinned_host`. Arguments that are not
    yet where the plan puts them are moved there once, explicitly, on the call. The
    compile cache is the function's, as in `eqx.filter_jit` (see `ox.clear_caches`), and
    the function is traced once per compilation; a program that contains an
    `eqx.error_if` raises its `eqx.EquinoxRuntimeError` from the call.

    **Returns:** an `ox.FilterJit`, called like `fn`; with only options
    (`@ox.filter_jit(donate="all")`), a decorator that returns one.
    """
    if jit_options:
        raise TypeError(
            f"ox.filter_jit was given {', '.join(map(repr, jit_options))}, which it does "
            "not take: it accepts `strategy`, `donate`, `mesh`, `audit` and "
            "`donate_on_error`. The plan decides "
            "shardings and donation (`in_shardings`, `out_shardings`, `donate_argnums` "
            "have no place here); for other `jax.jit` options use `jax.jit` on a function "
            "of arrays."
        )
    if isinstance(strategy, Plan):
        mesh = strategy.mesh if mesh is None else mesh
        strategy = strategy.strategy
    strategy = resolve_strategy(strategy)
    check_mesh(mesh, where="ox.filter_jit(mesh=...)")
    if donate not in _DONATE:
        raise ValueError(
            f"ox.filter_jit(donate={donate!r}): expected one of "
            + ", ".join(repr(d) for d in _DONATE)
            + "."
        )
    if not isinstance(audit, bool):
        raise TypeError(
            f"ox.filter_jit(audit={audit!r}): expected True or False (a {type(audit).__name__} "
            "would be read as its truth value)."
        )
    if fn is None:
        return lambda fn: filter_jit(
            fn,
            strategy=strategy,
            donate=donate,
            mesh=mesh,
            audit=audit,
            donate_on_error=donate_on_error,
        )
    refuse_ahead_of_time(fn, "ox.filter_jit", "`ox.filter_jit(f)`, `f` the function lowered")
    if not callable(fn):
        raise TypeError(
            f"ox.filter_jit was given {fn!r} (a {type(fn).__name__}), which is not callable. "
            "Pass the function (or module) to compile."
        )
    signature = _signature(fn)
    fn = as_pytree(fn)
    has_arrays = any(isinstance(x, ARRAY_TYPES) for x in jax.tree_util.tree_leaves(fn))
    wrapper = FilterJit(
        fn=fn,
        strategy=strategy,
        donate=donate,
        mesh=mesh,
        audit=audit,
        donate_on_error=bool(donate_on_error),
        fn_has_arrays=has_arrays,
        signature=signature,
        cache=cache_of(
            fn, has_arrays, (strategy, donate, mesh, audit, bool(donate_on_error)), audit
        ),
    )
    return eqx.module_update_wrapper(wrapper)
