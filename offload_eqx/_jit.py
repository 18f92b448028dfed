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
from jax._src.array import ArrayImpl  # the concrete jax.Array; no public name
from jax.core import Tracer

from ._compile import Compilation, NewArgumentTypes, compile_entry
from ._errors import ImplicitTransferError, is_placement_mismatch
from ._guard import explain, no_implicit_transfers
from ._mesh import check_mesh, put, same_place
from ._plan import Plan
from ._plan_walk import ARRAY_TYPES, format_keys
from ._strategy import Strategy, resolve_strategy
from ._trace_state import current, tracing

Donate = Literal["all", "all-except-first", "none"]
_DONATE = ("all", "all-except-first", "none")
# A wrapper warns once its cache holds this many compilations (see `_compile_new`).
CACHE_WARNING = 32

_SAME_BUFFER = (
    "ox.filter_jit({name}): the same array is passed as `{first}` and `{second}`, and "
    "donation would hand its buffer to the program twice. Pass a copy for one of them "
    "(`jnp.copy(x)`), or donate less (`donate='none'` or `'all-except-first'`)."
)
_STATIC_RECOMPILE = (
    "ox.filter_jit({name}, audit=True): {leaves} changed since the last call; non-array "
    "leaves are static, so every new value compiles the step again. Pass arrays for "
    "values that change (`jnp.asarray(...)`)."
)
_CACHE_GROWS = (
    "ox.filter_jit({name}) has compiled {count} versions of the step; the static "
    "(non-array) leaves that differ between them include {leaves}. Every new static value "
    "compiles again and keeps its program in memory: pass arrays for values that change."
)


def _describe(fn: Any) -> str:
    name = getattr(fn, "__name__", None)
    return name if isinstance(name, str) else type(fn).__name__


class _Cache:
    """The compilations of one wrapper (identity-hashed, so it can be a static field)."""

    def __init__(self):
        # key -> its entry, or, once several shapes were seen, {shapes and dtypes: entry}
        self.entries: dict[Any, Any] = {}


def _signature(fn: Any) -> inspect.Signature | None:
    try:
        return inspect.signature(fn)
    except (TypeError, ValueError):
        return None


class FilterJit(eqx.Module):
    """What `ox.filter_jit` returns. Call it like the function; `.plan`, `.trace`,
    `.lower` and `.compilation` take the same arguments."""

    fn: Any
    strategy: Strategy = eqx.field(static=True)
    donate: str = eqx.field(static=True)
    mesh: Any = eqx.field(static=True)
    audit: bool = eqx.field(static=True)
    fn_has_arrays: bool = eqx.field(static=True)
    signature: Any = eqx.field(static=True, repr=False)
    cache: _Cache = eqx.field(static=True, repr=False)

    @property
    def __wrapped__(self):
        return self.fn

    def __get__(self, instance, owner=None):
        if instance is None:
            return self
        return jax.tree_util.Partial(self, instance)

    # -- the per-call path: `_call`, a module-level function (see there) ----------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return _call(self, args, kwargs)

    def _inline(self, args: tuple, kwargs: dict) -> Any:
        """Called inside another trace: run inline, like a nested `jax.jit`, under this
        wrapper's own plan, and check its names; they count for the outer trace too."""
        plan = self.plan(*args, **kwargs)
        leaves = [
            x
            for x in jax.tree_util.tree_leaves(self._tree(args, kwargs))
            if isinstance(x, ARRAY_TYPES)
        ]
        outer = current()
        with tracing(plan, leaves) as state:
            out = self.fn(*args, **kwargs)
        plan.check_names(state.inside_regions, state.outside_regions, state.regions)
        if outer is not None:
            outer.inside_regions |= state.inside_regions
            outer.outside_regions |= state.outside_regions
            outer.regions += state.regions
        return out

    def _tree(self, args: tuple, kwargs: dict) -> tuple:
        return (self.fn, args, kwargs) if self.fn_has_arrays else (args, kwargs)

    # -- compiling an entry ------------------------------------------------------------

    def arguments(self, *args: Any, **kwargs: Any) -> list[tuple[str, Any]]:
        """Each argument with its label (the function's parameter names), in the order
        of the array leaves of the call: `[("model", model), ("x", x)]`."""
        args, kwargs = _bind(self.signature, args, kwargs)
        parameters = [] if self.signature is None else list(self.signature.parameters.values())
        positional = [
            p.name
            for p in parameters
            if p.kind
            in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        ]
        roots = [("fn", self.fn)] if self.fn_has_arrays else []
        for i, arg in enumerate(args):
            roots.append((positional[i] if i < len(positional) else f"args[{i}]", arg))
        roots.extend((key, kwargs[key]) for key in sorted(kwargs))
        return roots

    def plan(self, *args: Any, **kwargs: Any) -> Plan:
        """The plan this function applies to these arguments (nothing is compiled)."""
        return Plan(self.arguments(*args, **kwargs), self.strategy, self.mesh)

    def _compile_new(self, key, args, kwargs, tree, leaves, treedef, mask, dynamic) -> Compilation:
        name = _describe(self.fn)
        similar = [k for k in self.cache.entries if k[0] == key[0] and k[1] == key[1] and k != key]
        if similar:
            roots = self.arguments(*args, **kwargs)
            changed = _changed_statics(roots, similar[-1][2], key[2])
            if self.audit and changed:
                raise ImplicitTransferError(_STATIC_RECOMPILE.format(name=name, leaves=changed))
            if len(self.cache.entries) + 1 == CACHE_WARNING:
                warnings.warn(
                    _CACHE_GROWS.format(name=name, count=CACHE_WARNING, leaves=changed or "none"),
                    stacklevel=4,
                )
        plan = self.plan(*args, **kwargs)
        plan.check_strategy()
        keep_root = None
        if self.donate == "all-except-first" and args:
            keep_root = 1 if self.fn_has_arrays else 0
        fn = self.fn
        call = (
            (lambda t: t[0](*t[1], **t[2])) if self.fn_has_arrays else (lambda t: fn(*t[0], **t[1]))
        )
        statics = tuple(leaf for leaf, m in zip(leaves, mask) if not m)
        entry = compile_entry(
            call,
            plan,
            treedef,
            mask,
            statics,
            dynamic,
            self.donate,
            keep_root,
            f"ox.filter_jit({name})",
        )
        entries = self.cache.entries
        held = entries.get(key)
        if held is None:
            entries[key] = entry
        else:  # another shape under the same key: hold every entry by its types
            by_types = held if type(held) is dict else {held.types: held}
            by_types[entry.types] = entry
            entries[key] = by_types
        return entry

    @property
    def compilations(self) -> int:
        """How many programs this wrapper has compiled (one per static part and shapes)."""
        entries = self.cache.entries.values()
        return sum(len(e) if type(e) is dict else 1 for e in entries)

    def _check_distinct(self, entry: Compilation, dynamic: list) -> None:
        seen: dict[int, int] = {}
        donated = set(entry.donate_argnums)
        for i, x in enumerate(dynamic):
            j = seen.setdefault(id(x), i)
            if j != i and (i in donated or j in donated):
                raise ValueError(
                    _SAME_BUFFER.format(
                        name=_describe(self.fn),
                        first=entry.plan.leaves[j].path,
                        second=entry.plan.leaves[i].path,
                    )
                )

    def _entry_for(self, args: tuple, kwargs: dict) -> tuple[Compilation, list]:
        args, kwargs = _bind(self.signature, args, kwargs)
        tree = self._tree(args, kwargs)
        leaves, treedef = jax.tree_util.tree_flatten(tree)
        mask = tuple(isinstance(x, ARRAY_TYPES) for x in leaves)
        dynamic = [x for x, m in zip(leaves, mask) if m]
        statics = tuple(x for x, m in zip(leaves, mask) if not m)
        key = (treedef, mask, statics)
        entry = self.cache.entries.get(key)
        if type(entry) is dict:
            entry = entry.get(_types(dynamic))
        elif entry is not None and entry.types != _types(dynamic):
            entry = None
        if entry is None:
            entry = self._compile_new(key, args, kwargs, tree, leaves, treedef, mask, dynamic)
        return entry, dynamic

    def compilation(self, *args: Any, **kwargs: Any) -> tuple[Compilation, list]:
        """The cache entry for these arguments and their array leaves (for reports and
        the audit: `entry.flat`, `entry.plan`, `entry.abstract(leaves)`)."""
        return self._entry_for(args, kwargs)

    def trace(self, *args: Any, **kwargs: Any) -> jax.stages.Traced:
        """Trace for these arguments (arrays or `jax.ShapeDtypeStruct`s), like `jax.jit`."""
        entry, dynamic = self._entry_for(args, kwargs)
        return entry.jitted.trace(*entry.abstract(dynamic))

    def lower(self, *args: Any, **kwargs: Any) -> jax.stages.Lowered:
        """Lower for these arguments (arrays or `jax.ShapeDtypeStruct`s), like `jax.jit`."""
        return self.trace(*args, **kwargs).lower()


# The per-call path reads the wrapper's fields with `object.__getattribute__` and calls
# module-level functions: an `eqx.Module` builds a bound-method module for every method
# looked up on an instance and checks every attribute read in Python, which would cost
# more than the rest of the call.
_get = object.__getattribute__
# What each type of leaf is, found once per type: `isinstance` against the `jax.Array`
# ABC costs more per leaf than the rest of the loop.
_ARRAY, _STATIC, _TRACER = "array", "static", "tracer"
_KINDS: dict[type, str] = {ArrayImpl: _ARRAY}


def _kind(leaf: Any) -> str:
    if isinstance(leaf, Tracer):
        return _TRACER
    return _ARRAY if isinstance(leaf, ARRAY_TYPES) else _STATIC


def _bind(signature: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    if kwargs and signature is not None:
        bound = signature.bind(*args, **kwargs)
        return bound.args, bound.kwargs
    return args, kwargs


def _call(self: FilterJit, args: tuple, kwargs: dict) -> Any:
    if _get(self, "audit"):
        with no_implicit_transfers(self.arguments(*args, **kwargs)):
            return _dispatch(self, args, kwargs)
    return _dispatch(self, args, kwargs)


def _dispatch(self: FilterJit, args: tuple, kwargs: dict) -> Any:
    args, kwargs = _bind(_get(self, "signature"), args, kwargs)
    tree = (_get(self, "fn"), args, kwargs) if _get(self, "fn_has_arrays") else (args, kwargs)
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    dynamic, statics, mask = [], [], []
    for leaf in leaves:
        kind = _KINDS.get(type(leaf))
        if kind is None:
            kind = _KINDS.setdefault(type(leaf), _kind(leaf))
        if kind is _ARRAY:
            dynamic.append(leaf)
            mask.append(True)
        elif kind is _STATIC:
            statics.append(leaf)
            mask.append(False)
        else:
            return self._inline(args, kwargs)
    # The key leaves out shapes and dtypes (reading them costs more than the lookup):
    # a call with new ones makes the entry's program retrace, which refuses them
    # (`NewArgumentTypes`), or jit refuses them; then an entry is compiled for them and
    # the key holds its entries by shapes and dtypes.
    key = (treedef, tuple(mask), tuple(statics))
    entries = _get(self, "cache").entries
    try:
        entry = entries.get(key)
    except TypeError as e:
        raise TypeError(
            f"ox.filter_jit({_describe(_get(self, 'fn'))}): a non-array argument is not "
            f"hashable ({e}). Non-array leaves are static (part of the compile cache key), so "
            "they must be hashable: pass arrays for values that change, or make the object "
            "hashable."
        ) from None
    if type(entry) is dict:  # several shapes seen under this key
        entry = entry.get(_types(dynamic))
    if entry is None:
        entry = self._compile_new(key, args, kwargs, tree, leaves, treedef, mask, dynamic)
        dynamic = _move(dynamic, entry.in_shardings)
    if entry.donate_argnums and len(set(map(id, dynamic))) < len(dynamic):
        self._check_distinct(entry, dynamic)
    try:
        out = entry.jitted(*dynamic)
    except NewArgumentTypes:
        entry = self._compile_new(key, args, kwargs, tree, leaves, treedef, mask, dynamic)
        out = entry.jitted(*_move(dynamic, entry.in_shardings))
    except jax.errors.JaxRuntimeError as error:
        # A transfer guard (`ox.no_implicit_transfers()`, `jax.transfer_guard`) refused an
        # argument's upload: say which leaf, which only this call knows.
        message = explain(error, self.arguments(*args, **kwargs))
        if message is None:
            raise
        raise ImplicitTransferError(message) from None
    except ValueError as e:
        if entry.types != _types(dynamic):  # refused by jit before any retrace
            entry = self._compile_new(key, args, kwargs, tree, leaves, treedef, mask, dynamic)
            return entry.rebuild(entry.jitted(*_move(dynamic, entry.in_shardings)))
        if not is_placement_mismatch(e):
            raise
        # Arguments not yet where the plan puts them (a new strategy on a model placed for
        # another): move them once, explicitly; the outputs come back in planned memory,
        # so the next call moves nothing. Under audit, a cached step that keeps receiving
        # misplaced arguments is an error: it would copy them on every call.
        if _get(self, "audit"):
            _raise_misplaced(entry, dynamic)
        out = entry.jitted(*_move(dynamic, entry.in_shardings))
    return entry.rebuild(out)


def _types(dynamic: list) -> tuple:
    return tuple((tuple(x.shape), x.dtype) for x in dynamic)


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


def _raise_misplaced(entry: Compilation, dynamic: list) -> None:
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


def filter_jit(
    fn: Any = None,
    *,
    strategy: "str | Strategy | Plan | None" = None,
    donate: str = "none",
    mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh | None = None,
    audit: Any = False,  # checked below, with a message that says what was meant
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
    - `donate`: `"all"`, `"all-except-first"` or `"none"`, decided per array leaf; the
        first argument is the first one of the function's signature, however passed.
    - `mesh`: the mesh for leaves declared with a partition spec.
    - `audit`: run every call under `ox.no_implicit_transfers()`: an argument that would
        be copied implicitly (a numpy array, a Python scalar, an array on another device)
        is an error naming its leaf path, and so is a static leaf whose new value would
        compile the step again.

    Arguments are compiled with explicit input shardings from the plan; outputs get the
    memory kind of their traced type, so a host-resident parameter updated with
    `ox.apply_updates` comes back in `pinned_host`. Arguments that are not yet where the
    plan puts them are moved there once, explicitly, on the call.
    """
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
        return lambda fn: filter_jit(fn, strategy=strategy, donate=donate, mesh=mesh, audit=audit)
    if not callable(fn):
        raise TypeError(
            f"ox.filter_jit was given {fn!r} (a {type(fn).__name__}), which is not callable. "
            "Pass the function (or module) to compile."
        )
    has_arrays = any(isinstance(x, ARRAY_TYPES) for x in jax.tree_util.tree_leaves(fn))
    wrapper = FilterJit(
        fn=fn,
        strategy=strategy,
        donate=donate,
        mesh=mesh,
        audit=audit,
        fn_has_arrays=has_arrays,
        signature=_signature(fn),
        cache=_Cache(),
    )
    return eqx.module_update_wrapper(wrapper)
