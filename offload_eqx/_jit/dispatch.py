"""The per-call path of `ox.filter_jit`: flatten, look the compiled entry up, call it.

Per call the wrapper flattens its function and arguments once, classifies each leaf by
type, looks the static part up in its cache and calls a `jax.jit` whose arguments are the
array leaves themselves. A structure called before, with equal static leaves and
concrete arrays, skips the classification and the key (the fast path: for programs
that cannot raise at run time; a donating one still holds Ctrl-C and keeps its
outputs). When the call fails, the arguments are examined for the cause (moved to
their planned memory, a transfer guard, a donated buffer, several devices) and the error
names leaf paths. A call that donates its inputs keeps its outputs reachable until they
are returned, even through Ctrl-C.
"""

import contextlib
import warnings
from collections.abc import Iterator
from operator import itemgetter
from typing import Any

import equinox as eqx
import jax
from jax.core import Tracer

from .._base.errors import ImplicitTransferError, UnhashableStaticError, is_placement_mismatch
from .._base.jax_private import ArrayImpl
from .._plan.walk import ARRAY_TYPES, format_keys
from .call_errors import abstract_problem, call_problem
from .guard import explain, no_implicit_transfers
from .interrupts import (
    deliver_pending,
    hold,
    interrupt_waiting,
    interrupted_callback,
    is_callback_interrupt,
    release,
)
from .retrace import Misplaced, NewArgumentTypes, types_of
from .runtime_errors import equinox_error, quiet_callback_failures


def describe(fn: Any) -> str:
    if isinstance(fn, Method):
        fn = fn.function
    name = getattr(fn, "__name__", None)
    return name if isinstance(name, str) else type(fn).__name__


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


# JAX's flatten without `jax.tree_util.tree_flatten`'s Python frame.
_flatten = jax.tree_util.default_registry.flatten


def bind(signature: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    if kwargs and signature is not None:
        bound = signature.bind(*args, **kwargs)
        return bound.args, bound.kwargs
    return args, kwargs


def call(self: Any, *args: Any, **kwargs: Any) -> Any:
    """`FilterJit.__call__` itself (one Python frame a call)."""
    try:
        # The wrapper is read once (each read of an `eqx.Module`'s field costs as much
        # as a dictionary lookup of the structure): its cache holds the options the
        # per-call path branches on.
        cache = _get(self, "cache")
        if kwargs or cache.audit:
            return _dispatch_whole(self, args, kwargs)
        # The fast path: a structure called before, with the static leaves of that call
        # (or equal ones, which the whole path's key would find too) and concrete
        # arrays, runs its program (`Cache.fast`). Every test runs in C (`itemgetter`,
        # tuple equality, `map`) and nothing else is called: the wrapper's own cost is
        # these lines. Anything it cannot take goes the whole path before the program
        # runs, with this flatten.
        fn_has_arrays = cache.fn_has_arrays
        leaves, treedef = _flatten((_get(self, "fn"), args) if fn_has_arrays else args)
        hit = cache.fast.get(treedef)
        if hit is not None:
            pick_arrays, pick_statics, statics, jitted, rebuild, donating = hit
            if pick_statics(leaves) == statics:
                dynamic = pick_arrays(leaves)
                if _CONCRETE.issuperset(map(type, dynamic)):
                    if donating is not None:
                        out = _donate_fast(self, cache, donating, dynamic, args)
                        if out is not _REFUSED:
                            return out
                        return _dispatch(
                            self, args, kwargs, (leaves, _whole_treedef(treedef, fn_has_arrays))
                        )
                    try:
                        return rebuild(jitted(*dynamic))
                    except (NewArgumentTypes, Misplaced, ValueError):
                        pass  # refused before it ran: the whole path moves or compiles
                    except jax.errors.JaxRuntimeError as error:  # as `_execute` says it
                        _explain_transfer(error, self.arguments(*args))
                        raise
        return _dispatch(self, args, kwargs, (leaves, _whole_treedef(treedef, fn_has_arrays)))
    except (ValueError, RuntimeError, TypeError, Misplaced) as error:
        if isinstance(error, eqx.EquinoxRuntimeError):
            error.__traceback__ = None  # its message holds the stack inside the step
            raise
        # JAX names arguments by index; say which leaves, when they are the cause.
        caller = f"ox.filter_jit({describe(_get(self, 'fn'))})"
        if is_callback_interrupt(error):
            raise interrupted_callback(caller, _deleted(self, args, kwargs)) from None
        problem = call_problem(error, self.arguments(*args, **kwargs), caller, _get(self, "donate"))
        if problem is None:
            raise
        raise problem from None


def _dispatch_whole(self: Any, args: tuple, kwargs: dict) -> Any:
    """A call with keyword arguments or under `audit=True`: never the fast path."""
    if _get(self, "audit"):
        with no_implicit_transfers(self.arguments(*args, **kwargs)):
            return _dispatch(self, args, kwargs)
    return _dispatch(self, args, kwargs)


def _explain_transfer(error: Exception, arguments: Any) -> None:
    """Raise `ImplicitTransferError` naming the leaves when a transfer guard refused
    the call's arguments; else return, and the caller re-raises `error`."""
    message = explain(error, arguments)
    if message is not None:
        raise ImplicitTransferError(message) from None


# The fast path flattens `args` (or `(fn, args)`) without the empty keyword dictionary;
# the whole path's tree is `(args, kwargs)` (or `(fn, args, kwargs)`): their structures,
# one from the other.
_NO_KWARGS = jax.tree_util.tree_structure({})
_CONCRETE = frozenset({ArrayImpl})


def _whole_treedef(treedef: Any, fn_has_arrays: bool) -> Any:
    parts = treedef.children() if fn_has_arrays else [treedef]
    return jax.tree_util.treedef_tuple((*parts, _NO_KWARGS))


def _fast_treedef(whole: Any, fn_has_arrays: bool) -> Any:
    parts = whole.children()[:-1]  # less the keyword dictionary
    return jax.tree_util.treedef_tuple(parts) if fn_has_arrays else parts[0]


def _picker(indices: tuple[int, ...]) -> Any:
    """A function of a list giving the tuple of its items at `indices`."""
    if len(indices) == 1:
        (index,) = indices
        return lambda leaves: (leaves[index],)
    return itemgetter(*indices) if indices else lambda leaves: ()


def _remember_fast(self: Any, key: tuple, entry: Any) -> None:
    """Let the next call of this structure take the fast path (see `Cache.fast`); a
    donating entry's calls go through `_donate_fast`."""
    if entry.checks:
        return
    treedef, mask, statics = key
    arrays = tuple(i for i, is_array in enumerate(mask) if is_array)
    positions = tuple(i for i, is_array in enumerate(mask) if not is_array)
    out_treedef, out_static, _ = entry.out_cell
    one_array = not out_static and out_treedef.num_nodes == out_treedef.num_leaves == 1
    rebuild = itemgetter(0) if one_array else entry.rebuild
    donating = entry if entry.donate_argnums else None
    hit = (_picker(arrays), _picker(positions), statics, entry.jitted, rebuild, donating)
    _get(self, "cache").fast[_fast_treedef(treedef, _get(self, "fn_has_arrays"))] = hit


def _deleted(self: Any, args: tuple, kwargs: dict) -> list[str]:
    """The paths of the arguments whose buffers are deleted (donated to a step)."""
    return [
        label + format_keys(keys)
        for label, value in self.arguments(*args, **kwargs)
        for keys, x in jax.tree_util.tree_flatten_with_path(value)[0]
        if isinstance(x, ArrayImpl) and x.is_deleted()
    ]


def split(self: Any, args: tuple, kwargs: dict, flat: Any = None) -> tuple[tuple, list, bool]:
    """The cache key of a call (structure, which leaves are arrays, the static leaves),
    its array leaves (arrays, `jax.ShapeDtypeStruct`s or tracers), and whether a leaf is
    a tracer (a call inside a trace or a transformation). `flat`: the call's flattened
    `(args, kwargs)` when `call` made it already."""
    if flat is None:
        args, kwargs = bind(_get(self, "signature"), args, kwargs)
        tree = (_get(self, "fn"), args, kwargs) if _get(self, "fn_has_arrays") else (args, kwargs)
        flat = _flatten(tree)
    leaves, treedef = flat
    dynamic, statics, mask = [], [], []
    traced = False
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
            traced = True
            dynamic.append(leaf)
            mask.append(True)
    return (treedef, tuple(mask), tuple(statics)), dynamic, traced


def _dispatch(self: Any, args: tuple, kwargs: dict, flat: Any = None) -> Any:
    key, dynamic, traced = split(self, args, kwargs, flat)
    if traced:
        return self._inline(args, kwargs, key, dynamic)
    # The key leaves out shapes and dtypes (reading them costs more than the lookup):
    # a call with new ones makes the entry's program retrace, which refuses them
    # (`NewArgumentTypes`), or jit refuses them; then an entry is compiled for them and
    # the key holds its entries by shapes and dtypes.
    entries = _get(self, "cache").entries
    try:
        entry = entries.get(key)
    except TypeError as e:
        raise UnhashableStaticError(
            f"ox.filter_jit({describe(_get(self, 'fn'))}): a non-array argument is not "
            f"hashable ({e}). Non-array leaves are static (part of the compile cache key), so "
            "they must be hashable: pass arrays for values that change, or make the object "
            "hashable."
        ) from None
    if type(entry) is dict:  # several types seen under this key
        entry = entry.get(types_of(dynamic))
    if entry is None:
        if any(type(x) is jax.ShapeDtypeStruct for x in dynamic):  # before compiling
            _refuse_abstract(self, args, kwargs)
        entry = self._compile_new(key, args, kwargs, dynamic)
        dynamic = entry.moved(dynamic)
    if not entry.donate_argnums:
        entry, flat = _execute(self, entry, key, args, kwargs, dynamic)
        if not kwargs:
            _remember_fast(self, key, entry)
        return entry.rebuild(flat)
    deliver_pending()  # a Ctrl-C held during the previous call: now, before donating
    if len(set(map(id, dynamic))) < len(dynamic):
        dynamic = self._distinct(entry, dynamic)
    # The inputs are donated from here on: the outputs are the only copy of the state.
    cache = _get(self, "cache")
    cache.keep_outputs(None)
    holding = hold()
    try:
        entry, flat = _execute(self, entry, key, args, kwargs, dynamic)
    finally:
        if holding:
            release(f"ox.filter_jit({describe(_get(self, 'fn'))})")
    if not kwargs:
        _remember_fast(self, key, entry)
    outputs = entry.rebuild(flat)
    # Held for good only if a Ctrl-C waits: otherwise the loop's names hold them, and a
    # reference here would keep a finished run's state in device memory.
    cache.keep_outputs(outputs, flat, entry.rebuild, strongly=interrupt_waiting())
    return outputs


_REFUSED = object()  # `_donate_fast` could not take the call: the whole path takes it


def _donate_fast(self: Any, cache: Any, entry: Any, dynamic: tuple, args: tuple) -> Any:
    """A donating call on the fast path: as the whole path's (a held Ctrl-C delivered
    first, Ctrl-C held while it runs, the outputs kept) without the key. Repeated
    arrays, and arguments the program refuses before it runs (other types, another
    memory), go the whole path (`_REFUSED`)."""
    deliver_pending()
    if len(set(map(id, dynamic))) < len(dynamic):
        return _REFUSED
    cache.keep_outputs(None)
    holding = hold()
    try:
        flat = entry.jitted(*dynamic)  # read each call: tests replace it
    except (NewArgumentTypes, Misplaced, ValueError):
        return _REFUSED  # nothing donated: it was refused before it ran
    except jax.errors.JaxRuntimeError as error:
        _explain_transfer(error, self.arguments(*args))
        raise
    finally:
        if holding:
            release(f"ox.filter_jit({describe(_get(self, 'fn'))})")
    outputs = entry.rebuild(flat)
    cache.keep_outputs(outputs, flat, entry.rebuild, strongly=interrupt_waiting())
    return outputs


def _refuse_abstract(self: Any, args: tuple, kwargs: dict) -> None:
    caller = f"ox.filter_jit({describe(_get(self, 'fn'))})"
    problem = abstract_problem(self.arguments(*args, **kwargs), caller)
    if problem is not None:
        raise problem


def _execute(self, entry, key, args, kwargs, dynamic) -> tuple[Any, list]:
    """Call the entry's program (moving misplaced arguments, compiling again for new
    types): the entry that ran and its flat outputs (`entry.rebuild` makes the tree)."""
    try:
        out = _run(entry, dynamic)
    except NewArgumentTypes:  # traced again for other types: an entry of its own
        entry = self._compile_new(key, args, kwargs, dynamic)
        out = _run(entry, entry.moved(dynamic))
    except Misplaced:  # an array in another memory than planned, left to jit to place
        if _get(self, "audit"):
            _raise_misplaced(entry, dynamic)
        out = _run(entry, entry.moved(dynamic))
    except jax.errors.JaxRuntimeError as error:
        # A transfer guard (`ox.no_implicit_transfers()`, `jax.transfer_guard`) refused an
        # argument's upload: say which leaf, which only this call knows.
        message = explain(error, self.arguments(*args, **kwargs))
        if message is None:
            raise
        raise ImplicitTransferError(message) from None
    except ValueError as e:
        if entry.types != types_of(dynamic):  # refused by jit before any retrace
            entry = self._compile_new(key, args, kwargs, dynamic)
            return entry, _run(entry, entry.moved(dynamic))
        if not is_placement_mismatch(e):
            raise
        if self.mesh_changed(entry, args, kwargs):  # planned again for their mesh
            entry = self._compile_new(key, args, kwargs, dynamic)
            return entry, _run(entry, entry.moved(dynamic))
        # Arguments not yet where the plan puts them (a new strategy on a model placed for
        # another): move them once, explicitly; the outputs come back in planned memory,
        # so the next call moves nothing. Under audit, a cached step that keeps receiving
        # misplaced arguments is an error: it would copy them on every call.
        if _get(self, "audit"):
            _raise_misplaced(entry, dynamic)
        out = _run(entry, entry.moved(dynamic))
    return entry, out


def _run(entry: Any, dynamic: list) -> list:
    """Call the program; one that can raise at run time (`eqx.error_if`) is waited for,
    so that its error is raised here, as an `eqx.EquinoxRuntimeError`."""
    if entry.first_call:
        entry.first_call = False
        with _compile_warnings(entry.donate):
            return _run(entry, dynamic)
    if not entry.checks:
        return entry.jitted(*dynamic)
    with quiet_callback_failures():
        try:
            return jax.block_until_ready(entry.jitted(*dynamic))
        except (jax.errors.JaxRuntimeError, ValueError) as error:
            raised = equinox_error(error)
            if raised is None:
                raise
            raise raised from None


@contextlib.contextmanager
def _compile_warnings(donate: str) -> Iterator[None]:
    """The first call compiles, which is when JAX warns about donated buffers the
    program could not reuse: `donate="all"` and `"all-except-first"` keep it quiet, as
    in `eqx.filter_jit`; `"warn"` and `"warn-except-first"` let it through."""
    if donate.startswith("warn"):
        yield
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
        yield


def _raise_misplaced(entry: Any, dynamic: list) -> None:
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


class Method(eqx.Module):
    """A bound method of a module, as a pytree of the module's arrays."""

    module: eqx.Module
    function: Any = eqx.field(static=True)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.function(self.module, *args, **kwargs)

    @property
    def __wrapped__(self) -> Any:
        return self.function

    @property
    def bound(self) -> Any:
        """The method as the user passed it (its name, docstring and signature)."""
        return self.function.__get__(self.module, type(self.module))


def as_pytree(fn: Any) -> Any:
    """A bound method of a module as a pytree whose leaves are the module's. Equinox makes
    most bound methods pytrees, but not `__call__` and the other dunder methods:
    `model.__call__` is a plain method, a static leaf whose arrays would be baked into
    the program as constants (and neither planned nor donated)."""
    module = getattr(fn, "__self__", None)
    function = getattr(fn, "__func__", None)
    if isinstance(module, eqx.Module) and callable(function):
        return Method(module, function)
    return fn


def root_of(fn: Any) -> Any:
    """The tree a function's arrays are planned under (`fn.layers[0].weight`): a bound
    method's module, whose leaves are the method's, in the same order."""
    return fn.module if isinstance(fn, Method) else fn
