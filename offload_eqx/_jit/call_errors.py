"""Errors at the call of a compiled step, said in leaf paths instead of JAX's argument
indices.

JAX refuses a call of a jitted function with its own words: a donated (deleted) buffer
is "Invalid buffer passed to Execute() as argument 0 to replica 0", arrays on several
devices are "argument dynamic[0] of make_flat.<locals>.flat". `ox.filter_jit` knows each
argument's path, so when a call fails it looks at the arguments for these two causes,
and says which leaves and what to do.
"""

from collections.abc import Sequence
from typing import Any

import jax
from jax.core import Tracer

from .._plan.walk import format_path
from .guard import device_offenders

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


def call_problem(
    error: BaseException, arguments: Sequence[tuple[str, Any]], caller: str, donate: str
) -> Exception | None:
    """An error naming the argument leaves that made a call fail, or None when the
    arguments are not the cause."""
    deleted = is_deleted_buffer(error) and [
        path
        for path, leaf in _leaves(arguments)
        if isinstance(leaf, jax.Array) and not isinstance(leaf, Tracer) and leaf.is_deleted()
    ]
    if deleted:
        shown = ", ".join(f"`{p}`" for p in deleted[:3])
        if len(deleted) > 3:
            shown += f" and {len(deleted) - 3} more leaves"
        one = len(deleted) == 1
        return ValueError(
            _DONATED.format(
                caller=caller,
                paths=shown,
                was="was" if one else "were",
                its="its" if one else "their",
                s="" if one else "s",
                donate=donate,
            )
        )
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
