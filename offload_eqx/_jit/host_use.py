"""Which host-resident leaves made a trace fail, and where the user's code used them.

JAX reports only the primitive (`memory_space of all inputs passed to dot_general must
be the same`), or, for a value computed on host memory and differentiated, only the
types (`Expected cotangent type float32<host>[] but got float32[]`), or, for a loop that
carries such a value, the loop's carry (`while_loop body function carry input and carry
output must have equal types`: diffrax's `BacksolveAdjoint` carries the vector field's
parameters, and their gradient comes out host-typed). To name the leaves,
the function is traced again with every host-resident argument but one typed as device
memory: the ones that still fail are at fault, and the traceback of each failure holds
the line of the user's code that used it. This runs only on that error path.
"""

import os
import re
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import equinox as eqx
import jax
import optax

from .._base.errors import (
    ComplexSavedError,
    HostUseError,
    is_host_use_error,
    mixed_memory_spaces_summary,
)
from .._plan.plan import Plan

_HOST_USE = (
    "{caller}: {paths} {are} host-resident (pinned_host) and {is_} used outside any "
    "`ox.scan`/`ox.checkpoint` region{where}, where JAX cannot compute on {it} or "
    "differentiate {it} (`{error}`): {cause} Fixes: {fixes}"
)
_GENERAL_CAUSE = (
    "the code there uses {it} directly (in the loss, or in a module called outside a "
    "region), or {its} gradient, host-typed (the transpose of the fetch sends it back to "
    "host memory), meets device values (gradient clipping, the optimizer)."
)
_GENERAL_FIXES = (
    "fetch {it} where {it_is} used, `ox.fetch(...)` (once, there; the gradient of that "
    "use is added to the rest in host memory); call the module that uses {it} through "
    "`ox.scan(...)`/`ox.checkpoint(...)`{annotate}; for an L2 penalty, chain "
    "`optax.add_decayed_weights(2 * weight)` before the optimizer instead (the same "
    "update, nothing fetched); wrap the optimizer with `ox.offload_optimizer(...)` (which "
    "fetches gradients explicitly); or keep {it} on the device (`ox.field(memory="
    "'device')`, or a strategy that keeps parameters there)."
)
_ANNOTATE = (
    " (or annotate it with `ox.annotate(..., memory=...)`: its `__call__` and public "
    "methods then bring their own region)"
)
# Library functions that add updates to parameters on the device, and what replaces them.
_APPLY_UPDATES = {
    ("equinox", "apply_updates"): "eqx.apply_updates",
    ("optax", "apply_updates"): "optax.apply_updates",
}
_APPLY_CAUSE = (
    "`{function}` adds the updates to {it} on the device, and the updates of host-resident "
    "parameters are device-typed."
)
_APPLY_FIXES = (
    "replace `{function}(model, updates)` with `ox.apply_updates(model, updates)`, which "
    "adds each update where its parameter lives (on the host for host-resident ones), or "
    "compute and apply the update in one call with `ox.update_and_apply(opt, grads, "
    "opt_state, model)`."
)

# JAX's words when a loop's carry (or a branch's result) goes in device-typed and comes
# out host-typed (`TypeError: while_loop body function carry input and carry output must
# have equal types ... has type float32[2,2] but the corresponding output carry component
# has type float32<host>[2,2]`), and the pair of types it names.
_TYPE_CHANGED = ("carry output must have equal types", "must have identical types")
_CARRY_TYPES = re.compile(
    r"has type (\S+) but the corresponding output carry component has type ([^\s;]+)"
)
_LOOP_CAUSE = (
    "a loop carries {it} (a `while_loop` or `scan` in the code there: diffrax's "
    "`BacksolveAdjoint` carries the vector field's parameters), and {its} gradient, "
    "host-typed (the transpose of the fetch sends it back to host memory), comes out of "
    "the loop's body where a device-typed value went in."
)


def changes_loop_type(error: BaseException) -> bool:
    """Whether `error` is JAX's refusal of a loop whose carry (or of a `cond` whose
    branch result) is host-typed where it went in device-typed."""
    text = str(error)
    return (
        isinstance(error, TypeError) and "<host>" in text and any(t in text for t in _TYPE_CHANGED)
    )


def is_host_use(error: BaseException) -> bool:
    """Whether `error` is one of JAX's errors for a host-typed value used where device
    values are: an operation mixing memory spaces, a cotangent in the wrong memory, a
    loop carry that changes memory."""
    return is_host_use_error(error) or changes_loop_type(error)


def _summary(error: BaseException) -> str:
    """JAX's words for the fault, short: the first sentence, and for a loop carry the
    first pair of types that differ."""
    if not changes_loop_type(error):
        return mixed_memory_spaces_summary(error)
    text = str(error)
    first = text.split("\n")[0].split(", but")[0]
    types = _CARRY_TYPES.search(text)
    return f"{first}: {types[1]} in, {types[2].rstrip('.')} out" if types else first


# Frames of these packages are not where the user's code used a leaf.
_LIBRARIES = tuple(
    os.path.dirname(module.__file__ or "") + os.sep for module in (jax, eqx, optax)
) + (os.path.dirname(os.path.dirname(__file__)) + os.sep,)  # the package's root


# JAX's words when a checkpoint's saved value is complex (`_insert_reduce_precision`
# rounds every saved value to its dtype's precision, and `reduce_precision` takes only
# real floating dtypes).
_COMPLEX_SAVED_WORDS = "reduce_precision does not accept dtype complex"
_COMPLEX_SAVED = (
    "{caller}: JAX cannot save a complex value for the backward pass in a region{where}, "
    "which strategy {strategy!r} asks for: its checkpoint rounds every value it saves with "
    "`reduce_precision`, which refuses complex dtypes (`{error}`; a plain `jax.checkpoint` "
    "that saves a complex value fails the same way). A module whose parameters live in "
    "host memory runs in such a region, which saves what the strategy saves (under "
    "activations='save', every value but the fetched parameters). Fixes: recompute the "
    "complex values (a strategy with activations='remat', e.g. `ox.Strategy('custom', "
    "params='pinned_host', optimizer='device', activations='remat')`, or the complex "
    "value named with `ox.name` and declared 'remat'), or keep the parameters on the "
    "device (params='device', or `ox.field(memory='device')` on the fields this module "
    "uses), so that it runs outside any region."
)


def saves_complex(error: BaseException) -> bool:
    """Whether `error` is JAX refusing to save a complex value in a checkpoint."""
    return isinstance(error, TypeError) and _COMPLEX_SAVED_WORDS in str(error)


def complex_saved_error(error: BaseException, plan: Plan, caller: str) -> ComplexSavedError:
    """`error` (see `saves_complex`) said with the strategy, the user's line and the fixes."""
    site = use_site(error)
    strategy = getattr(plan.strategy, "name", plan.strategy)
    return ComplexSavedError(
        _COMPLEX_SAVED.format(
            caller=caller,
            strategy=strategy,
            where=f" called at {site}" if site else "",
            error=str(error).split("\n")[0],
        )
    )


def _as_device(a: jax.ShapeDtypeStruct) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding.with_memory_kind("device"))


def use_site(error: BaseException) -> str | None:
    """`file.py:12 (`code`)`: the innermost frame of the user's code in the traceback of
    the operation that failed (for a backward-pass failure, JAX keeps the forward
    operation's traceback as the error's cause)."""
    frames = []
    for exception in (error.__cause__, error):
        if exception is not None and exception.__traceback__ is not None:
            frames = traceback.extract_tb(exception.__traceback__)
            if any(not f.filename.startswith(_LIBRARIES) for f in frames):
                break
    user = [f for f in frames if not f.filename.startswith(_LIBRARIES)]
    if not user:
        return None
    frame = user[-1]
    code = f" (`{frame.line.strip()}`)" if frame.line else ""
    return f"{os.path.basename(frame.filename)}:{frame.lineno}{code}"


# Traces and seconds the search may spend once it has found a leaf, and how many leaves a
# message lists by path.
_TRACE_BUDGET = 40
_SECONDS = 1.5
_SHOWN = 5


def locate_host_use(
    flat: Callable[..., Any],
    abstract: Sequence[jax.ShapeDtypeStruct],
    plan: Plan,
    error: BaseException,
    caller: str,
) -> HostUseError:
    """A `HostUseError` naming the host-resident leaves that made the trace fail, and the
    line of the user's code where the first of them was used."""
    host = [
        i
        for i, a in enumerate(abstract)
        if a.sharding is not None and a.sharding.memory_kind == "pinned_host"
    ]
    search = _Search(flat, abstract, host)
    search.split(host, known_to_fail=True)  # all of them host-resident: the trace that failed
    offenders = [plan.leaves[i].path for i in search.offenders]
    one = len(offenders) <= 1 and not search.unsearched
    where = search.where or use_site(error)
    words = dict(it="it" if one else "them", it_is="it is" if one else "they are")
    function = _library_function(error)
    if function is not None:
        cause = _APPLY_CAUSE.format(function=function, **words)
        fixes = _APPLY_FIXES.format(function=function)
    else:
        general = _LOOP_CAUSE if changes_loop_type(error) else _GENERAL_CAUSE
        cause = general.format(its="its" if one else "their", **words)
        declared = {leaf.path for leaf in plan.leaves if leaf.declared is not None}
        annotated = bool(offenders) and set(offenders) <= declared
        fixes = _GENERAL_FIXES.format(annotate="" if annotated else _ANNOTATE, **words)
    message = _HOST_USE.format(
        caller=caller,
        paths=_listed(offenders, search.unsearched, len(host)),
        are="is" if one else "are",
        is_="is" if one else "are",
        where=f", at {where}" if where else "",
        error=_summary(error),
        cause=cause,
        fixes=fixes,
        **words,
    )
    return HostUseError(message, offenders)


def _library_function(error: BaseException) -> str | None:
    """`eqx.apply_updates` or `optax.apply_updates`, when the failing operation ran inside
    one of them (their frames are in the traceback of the error or of its cause)."""
    for exception in (error, error.__cause__):
        if exception is None or exception.__traceback__ is None:
            continue
        for frame in traceback.extract_tb(exception.__traceback__):
            parts = frame.filename.split(os.sep)
            for (package, name), function in _APPLY_UPDATES.items():
                if package in parts and frame.name == name:
                    return function
    return None


class _Search:
    """Which host-resident leaves fail the trace on their own, by splitting: a group of
    them is traced host-resident with the other host leaves typed as device memory, and a
    group that fails is halved, so that k offenders among n leaves cost about
    2k log2(n / k) traces, not n. Past `_TRACE_BUDGET` traces or `_SECONDS`, once one
    offender is known, the groups left are counted, not searched (400 host leaves took
    50 s, one trace each)."""

    def __init__(self, flat: Callable[..., Any], abstract: Sequence[Any], host: list[int]):
        self.flat, self.abstract, self.host = flat, abstract, set(host)
        self.traces = 0
        self.start = time.monotonic()
        self.offenders: list[int] = []
        self.unsearched = 0  # leaves in groups that fail but were not told apart
        self.where: str | None = None
        self.alone = False  # `where` is a single leaf's

    def fails(self, group: list[int]) -> bool:
        """Whether the trace fails with only `group` host-resident."""
        self.traces += 1
        keep = set(group)
        trial = [
            _as_device(a) if j in self.host and j not in keep else a
            for j, a in enumerate(self.abstract)
        ]
        try:
            jax.make_jaxpr(self.flat)(*trial)
        except (ValueError, TypeError) as e:
            if is_host_use(e):
                # The use site of the first leaf told apart, else of the first group.
                if self.where is None or (len(group) == 1 and not self.alone):
                    self.where = use_site(e) or self.where
                    self.alone = len(group) == 1
                return True
        except Exception:  # another error with only this group on the host: not this one
            pass
        return False

    def split(self, group: list[int], known_to_fail: bool = False) -> None:
        """Find the offenders in `group`, depth first (the first leaves first)."""
        if not group:
            return
        spent = self.traces >= _TRACE_BUDGET or time.monotonic() - self.start > _SECONDS
        if spent and self.offenders:
            self.unsearched += len(group)
            return
        if not known_to_fail and not self.fails(group):
            return
        if len(group) == 1:
            self.offenders.append(group[0])
            return
        half = len(group) // 2
        first, rest = group[:half], group[half:]
        found = len(self.offenders)
        self.split(first)
        # A failing group whose first half passes fails in its second half: not traced.
        self.split(rest, known_to_fail=len(self.offenders) == found and not self.unsearched)


def _listed(offenders: list[str], unsearched: int, host: int) -> str:
    """`a`, `b` and 3 more: the first few offending paths, then a count (and the leaves
    that were not told apart)."""
    if not offenders:
        return "some host-resident leaves"
    shown = ", ".join(f"`{p}`" for p in offenders[:_SHOWN])
    more = len(offenders) - _SHOWN
    text = shown + (f" and {more} more" if more > 0 else "")
    if unsearched:
        text += (
            f" (and perhaps some of {unsearched} more of the step's {host} host-resident "
            "leaves, not checked one by one)"
        )
    return text
