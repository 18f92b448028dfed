"""Errors at the call of a compiled step, said in leaf paths instead of JAX's argument
indices.

JAX refuses a call of a jitted function with its own words: a donated (deleted) buffer
is "Invalid buffer passed to Execute() as argument 0 to replica 0", arrays on several
devices are "argument dynamic[0] of make_flat.<locals>.flat". `ox.filter_jit` knows each
argument's path, so when a call fails it looks at the arguments for these causes (and
for `jax.ShapeDtypeStruct`s, which a call cannot run on, and an argument whose type
names another memory than its sharding), and says which leaves and what to do.
"""

from collections.abc import Sequence
from typing import Any

import jax
from jax.core import Tracer

from .._base.errors import DonatedInputError
from .._plan.leaf import is_key
from .._plan.walk import ARRAY_TYPES, format_path
from .guard import device_offenders
from .retrace import Misplaced

_DONATED = (
    "{caller}: {paths} {was} donated to an earlier call (donate={donate!r}), which "
    "deleted {its} buffer{s}: a donated input may not be used again. Pass the step's "
    "outputs, not the donated inputs: `model, opt_state, loss = step(model, opt_state, "
    "batch)` rebinds the names to the new values. To keep an input, pass a copy "
    "(`jax.tree.map(jnp.copy, tree)`) or donate less (`donate='none'` or "
    "`'all-except-first'`)."
)
_DEVICES = (
    "{caller}: the arguments are on different devices ({offenders}, while the others are "
    "on {majority}), and one program runs on one set of devices. Put {them} where the rest "
    "is once, before the call: `jax.device_put(x, {majority_device})` (or `ox.place(tree, "
    "mesh=mesh)` for a mesh)."
)
_ABSTRACT = (
    "{caller}: {paths} {are} `jax.ShapeDtypeStruct`{s} (a shape and dtype, no data), and "
    "a call runs the step on arrays. Pass arrays (`jnp.zeros(shape, dtype)`, or a model "
    "made for real); for shapes only, ask without running: `step.lower(*args)`, "
    "`ox.memory_report(step, *args)`, `ox.audit(step, *args)` or `ox.estimate(step, *args)`."
)
_MISTYPED = (
    "{caller}: `{path}` is {what} in {memory!r} memory that JAX types as `{got}`, and the "
    "step was compiled for `{expected}`; moving it where the plan puts it did not change "
    "its type. {fix}"
)
_KEY_FIX = (
    "A PRNG key's type carries no memory space, so a key lives on the device: put it there "
    "(`jax.device_put(key, jax.memory.Space.Device)`)."
)
_ARRAY_FIX = (
    "Pass it as an array whose type names its memory: placed by `ox.place(tree, strategy)`, "
    "or `jax.device_put(x, jax.memory.Space.Host)` (`Space.Device` for the device)."
)
# JAX's words for a jitted call whose arguments are committed to different devices, and
# for an argument whose buffer was deleted (donated, or `.delete()`d) before the call.
_INCOMPATIBLE_DEVICES = "incompatible devices for jitted computation"
_DELETED = ("Buffer has been deleted or donated", "Array has been deleted")


def is_deleted_buffer(error: BaseException) -> bool:
    """Whether `error` is JAX's refusal of an argument whose buffer is gone."""
    return any(text in str(error) for text in _DELETED)


def is_incompatible_devices(error: BaseException) -> bool:
    """Whether `error` is JAX's refusal of arguments committed to different devices."""
    return isinstance(error, ValueError) and _INCOMPATIBLE_DEVICES in str(error)


def _leaves(arguments: Sequence[tuple[str, Any]]) -> list[tuple[str, Any]]:
    return [
        (format_path(root, path), leaf)
        for root, tree in arguments
        for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]
    ]


def _shown(paths: Sequence[str]) -> str:
    """The first three paths, and how many more."""
    shown = ", ".join(f"`{p}`" for p in paths[:3])
    if len(paths) > 3:
        shown += f" and {len(paths) - 3} more leaves"
    return shown


def abstract_problem(arguments: Sequence[tuple[str, Any]], caller: str) -> TypeError | None:
    """The error for a call given `jax.ShapeDtypeStruct`s (None: it was given none)."""
    paths = [p for p, leaf in _leaves(arguments) if isinstance(leaf, jax.ShapeDtypeStruct)]
    if not paths:
        return None
    are, s = ("is a", "") if len(paths) == 1 else ("are", "s")
    return TypeError(_ABSTRACT.format(caller=caller, paths=_shown(paths), are=are, s=s))


def _mistyped(error: Misplaced, arguments: Sequence[tuple[str, Any]], caller: str) -> ValueError:
    """The error for an argument whose type names another memory than planned, still so
    once moved (the program's argument `error.index` is the call's array leaf of that
    index)."""
    arrays = [(p, x) for p, x in _leaves(arguments) if isinstance(x, ARRAY_TYPES)]
    path, leaf = arrays[error.index] if error.index < len(arrays) else ("?", None)
    key = is_key(error.got.dtype)
    return ValueError(
        _MISTYPED.format(
            caller=caller,
            path=path,
            what="a PRNG key array" if key else f"an array ({type(leaf).__name__})",
            memory=getattr(getattr(leaf, "sharding", None), "memory_kind", None),
            got=error.got.str_short(),
            expected=error.expected.str_short(),
            fix=_KEY_FIX if key else _ARRAY_FIX,
        )
    )


def donated_problem(
    arguments: Sequence[tuple[str, Any]], caller: str, donate: str
) -> DonatedInputError | None:
    """The error for a call given arrays whose buffers were donated (deleted) before it,
    naming them (None: every argument is alive)."""
    deleted = [
        path
        for path, leaf in _leaves(arguments)
        if isinstance(leaf, jax.Array) and not isinstance(leaf, Tracer) and leaf.is_deleted()
    ]
    if not deleted:
        return None
    shown = _shown(deleted)
    one = len(deleted) == 1
    return DonatedInputError(
        _DONATED.format(
            caller=caller,
            paths=shown,
            was="was" if one else "were",
            its="its" if one else "their",
            s="" if one else "s",
            donate=donate,
        )
    )


def call_problem(
    error: BaseException, arguments: Sequence[tuple[str, Any]], caller: str, donate: str
) -> Exception | None:
    """An error naming the argument leaves that made a call fail, or None when the
    arguments are not the cause. A `Misplaced` always gets one."""
    abstract = abstract_problem(arguments, caller)
    if abstract is not None:
        return abstract
    if isinstance(error, Misplaced):
        return _mistyped(error, arguments, caller)
    deleted = is_deleted_buffer(error) and donated_problem(arguments, caller, donate)
    if deleted:
        return deleted
    if is_incompatible_devices(error):
        offenders, majority = device_offenders(arguments)
        if offenders and majority is not None:
            return ValueError(
                _DEVICES.format(
                    caller=caller,
                    offenders=", ".join(
                        f"`{p}` is on {', '.join(map(str, x.sharding.device_set))}"
                        for p, x in offenders
                    ),
                    majority=", ".join(map(str, majority)),
                    them="it" if len(offenders) == 1 else "them",
                    majority_device=f"jax.devices()[{majority[0].id}]",
                )
            )
    return None
