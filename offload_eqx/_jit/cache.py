"""The compile cache of `ox.filter_jit`, keyed as `eqx.filter_jit` keys it.

A cache belongs to the function, not to the wrapper object: `ox.filter_jit(f)` made
twice, `ox.filter_jit(eqx.filter_grad(f))` made afresh in a loop, a bound method taken
afresh (`ox.filter_jit(model.method)`), all find the programs the first one compiled.
Caches are held per user function (the one found by unwrapping `functools.partial`,
`__wrapped__` and bound methods) in a weak dictionary, so a function that is no longer
referenced takes its programs with it; within it, one cache per set of options (the
strategy, donation, mesh and audit) and, for a wrapper of the function that holds no
arrays, per wrapper value (`eqx.filter_grad(f)` and `eqx.filter_value_and_grad(f)`
differ). `eqx.clear_caches()` and `ox.clear_caches()` empty them all.
"""

import functools
import types
import weakref
from collections.abc import Sequence
from typing import Any

import jax

from .._base.equinox_private import cache_clears as _EQUINOX_CLEARS


class Cache:
    """The compilations of one function under one set of options.

    A copy of a wrapper (`copy.deepcopy(step)`) shares its cache, as it shares the
    function's: compiled programs hold devices, which cannot be copied. A pickled wrapper
    comes back with an empty cache (programs are not pickled) and compiles again."""

    def __init__(self, audit: bool = False, fn_has_arrays: bool = False):
        # What every wrapper sharing this cache was made with, read here by the per-call
        # path (`dispatch.call`): one read of the wrapper, the cache, is all it makes.
        self.audit = audit  # the audit wrappers' calls never take the fast path
        self.fn_has_arrays = fn_has_arrays  # the fast path flattens `(fn, args)`
        # key -> its entry, or, once several types were seen, {types: entry}
        self.entries: dict[Any, Any] = {}
        # The per-call fast path (`dispatch.call`): for a structure (the treedef of
        # the positional arguments, with the function where it holds arrays) called
        # before, how to pick its array leaves and its static leaves (those of that
        # call), its program, how to rebuild the outputs and, for a donating program,
        # its entry: a call whose leaves match runs it without building the key. Only
        # for entries that cannot raise at run time.
        self.fast: dict[Any, tuple] = {}
        # The outputs of the latest call that donated its inputs (see `last_outputs`):
        # the tree, or `_Weakly` held.
        self._last_outputs: Any = None
        # The keys each live wrapper (by id) compiled, for `audit=True`'s changed-static
        # check; see `keys_of`.
        self.compiled_by: dict[int, list] = {}

    def keep_outputs(
        self, outputs: Any, flat: Sequence[Any] = (), rebuild: Any = None, strongly: bool = False
    ) -> None:
        """Remember a donating call's outputs: `strongly` (kept alive here), or weakly
        (while anything else, the loop's names, keeps their arrays alive), by their flat
        arrays `flat` and the function that makes the tree of them (`rebuild`)."""
        weak = not strongly and outputs is not None
        self._last_outputs = _Weakly(flat, rebuild) if weak else outputs

    @property
    def last_outputs(self) -> Any:
        held = self._last_outputs
        return held.get() if isinstance(held, _Weakly) else held

    def keys_of(self, wrapper: Any) -> list:
        """The keys `wrapper` compiled. A wrapper's entry goes with it: a wrapper made
        afresh (`ox.filter_jit(f)` in a loop) may get a collected one's `id`, and its
        first program is not a recompilation of that one's."""
        key = id(wrapper)
        if key not in self.compiled_by:
            self.compiled_by[key] = []
            weakref.finalize(wrapper, self.compiled_by.pop, key, None)
        return self.compiled_by[key]

    def __copy__(self) -> "Cache":
        return self

    def __deepcopy__(self, memo: dict) -> "Cache":
        return self

    def __getstate__(self) -> dict:
        return {"audit": self.audit, "fn_has_arrays": self.fn_has_arrays}

    def __setstate__(self, state: dict) -> None:
        self.__init__(**state)
        _ALL.add(self)  # emptied by `clear_caches` like every other


class _Weakly:
    """A call's outputs by weak references to its flat arrays: `get()` rebuilds the tree
    with each array dropped since (by every other holder) as None, or gives None when
    every array was. (Flattening the tree again would cost each call a few hundred
    microseconds for a model of 150 leaves; the flat outputs are at hand.)"""

    def __init__(self, flat: Sequence[Any], rebuild: Any):
        self.rebuild = rebuild
        try:  # a program's outputs are arrays: all of them can be held weakly
            self.leaves = list(map(weakref.ref, flat))
        except TypeError:  # pragma: no cover - something else among them: kept as is
            self.leaves = [weakref.ref(x) if isinstance(x, jax.Array) else x for x in flat]

    def get(self) -> Any:
        refs = [x for x in self.leaves if isinstance(x, weakref.ref)]
        if refs and all(ref() is None for ref in refs):
            return None
        return self.rebuild([x() if isinstance(x, weakref.ref) else x for x in self.leaves])


_BY_FUNCTION: "weakref.WeakKeyDictionary[Any, dict]" = weakref.WeakKeyDictionary()
_OTHERS: dict[Any, Cache] = {}  # functions that are not Python functions (callable objects)
_ALL: "weakref.WeakSet[Cache]" = weakref.WeakSet()  # every cache, for `clear_caches`


def user_function(fn: Any) -> Any:
    """The Python function under wrappers: `functools.partial`, anything with
    `__wrapped__` (`eqx.filter_grad`, `functools.wraps`), a bound method's function."""
    for _ in range(32):  # a wrapper chain longer than this is not unwrapped further
        inner = fn.func if isinstance(fn, functools.partial) else None
        if inner is None:
            inner = getattr(fn, "__func__", None) or getattr(fn, "__wrapped__", None)
        if inner is None or inner is fn:
            return fn
        fn = inner
    return fn


def cache_of(fn: Any, fn_has_arrays: bool, options: tuple, audit: bool) -> Cache:
    """The cache shared by every wrapper of `fn` (or of a function equal to it) made with
    `options` (`audit` among them). A wrapper of an unhashable function gets a cache of
    its own."""
    root = user_function(fn)
    weak = type(root) is types.FunctionType
    # Where `fn` has arrays, they are arguments: its static part is in every entry's key.
    # Where `fn` is the weakly held function itself, the table is its own.
    own = None
    if not fn_has_arrays and not (weak and fn is root):
        # By value, leaf by leaf, as `eqx.filter_jit` keys it: `eqx.filter_grad(f)` made
        # again is the same function (a module holding a dict is not hashable itself).
        leaves, treedef = jax.tree_util.tree_flatten(fn)
        own = (treedef, tuple(leaves))
    try:
        table = _BY_FUNCTION.setdefault(root, {}) if weak else _OTHERS
        cache = table.get((options, own, fn_has_arrays))
        if cache is None:
            cache = table[options, own, fn_has_arrays] = Cache(audit, fn_has_arrays)
    except TypeError:  # an unhashable function or option: nothing to share
        cache = Cache(audit, fn_has_arrays)
    _ALL.add(cache)
    return cache


def clear_caches() -> None:
    """Forget every program `ox.filter_jit` has compiled, as `eqx.clear_caches()` does
    for `eqx.filter_jit` (and now for these too): every step compiles again on its next
    call."""
    for cache in list(_ALL):
        cache.entries.clear()
        cache.fast.clear()
        cache.compiled_by.clear()
        cache.keep_outputs(None)
    _BY_FUNCTION.clear()
    _OTHERS.clear()


_EQUINOX_CLEARS.append(clear_caches)
