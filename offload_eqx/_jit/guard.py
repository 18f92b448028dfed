"""`ox.no_implicit_transfers`: JAX's transfer guard, with errors that name the argument.

`jax.transfer_guard("disallow")` blocks implicit host-to-device uploads at dispatch (a numpy
array or a Python scalar passed to a jitted function, `x + 1` on a `jax.Array`) and lets
explicit ones (`jax.device_put`) through, but its error names only a type. This guard runs
the same guard and, when it fires, finds the offending leaves among the call's arguments
by leaf path. Before the call it also checks what the guard cannot see: arguments spread
over several devices (jit would copy them silently, or fail without naming the leaf) and
arrays whose memory kind disagrees with their type.
"""

import contextlib
import dataclasses
import os
import re
import traceback
from collections.abc import Iterator, Sequence
from typing import Any, Literal

import jax
import numpy as np
from jax.core import Tracer

from .._base.errors import ImplicitTransferError as ImplicitTransferError
from .._plan.walk import format_path
from .._sharding.memory_space import type_matches

# JAX's transfer-guard error, e.g. `INVALID_ARGUMENT: Disallowed host-to-device transfer:
# aval=ShapedArray(float32[4]), dst_sharding=...`: the only place its words are read.
_GUARD_MESSAGE = re.compile(
    r"Disallowed (?P<direction>host-to-device|device-to-host|device-to-device) transfer"
    r"(?:: aval=(?P<aval>.*?\)),)?"
)


@dataclasses.dataclass(frozen=True)
class GuardedTransfer:
    """What JAX's transfer guard blocked: the direction and the value's type."""

    direction: Literal["host-to-device", "device-to-host", "device-to-device"]
    aval: str  # `ShapedArray(float32[4])`, or "a value" when JAX does not say


def blocked_transfer(error: BaseException) -> GuardedTransfer | None:
    """The transfer a `jax.transfer_guard` error blocked, or None for any other error."""
    if not isinstance(error, jax.errors.JaxRuntimeError):
        return None
    match = _GUARD_MESSAGE.search(str(error))
    if match is None:
        return None
    direction: Any = match.group("direction")
    return GuardedTransfer(direction, match.group("aval") or "a value")


_UPLOAD = (
    "Implicit host-to-device transfer: {offenders}. Each call uploads {them} to the device "
    "again, and on an accelerator that is a synchronous copy inside the training loop. "
    "Move {them} to the device once, outside the step ({fix}), and pass the `jax.Array`."
)
_EAGER = (
    "Implicit host-to-device transfer of `{aval}` at {where}: an eager operation on a "
    "`jax.Array` with a Python or NumPy operand (such as `step + 1`, `x * 0.5` or `x[i]` "
    "outside any jit) uploads the operand on every call. Move the computation inside the "
    "jitted step, or create the operand once with `jax.device_put(...)` before the loop."
)
_DEVICES = (
    "Implicit device-to-device transfer: {offenders}, while the other arguments are on "
    "{majority}. jit would copy {them} on every call (or refuse to run). Put {them} on the "
    "same device as the rest once, outside the step: `jax.device_put(x, {majority_device})`."
)
_MISTYPED = (
    "Argument `{path}` is in {kind!r} memory but its type is `{type}`: jit would treat it "
    "as {typed} memory. It was probably returned by a `jax.jit` whose `out_shardings` put "
    "a device-typed result in host memory. Re-place it once, outside the step: "
    "`ox.place(...)`, or `jax.device_put(x, jax.memory.Space.Host)`."
)
_NO_ARGUMENT = (
    "Implicit {direction} transfer ({detail}), but no argument of the call is a NumPy "
    "array, a Python scalar or an array on another device, so it comes from inside the "
    "call: an eager operation with a Python or NumPy operand. Move it inside the jitted "
    "step or create the operand once with `jax.device_put(...)`."
)


def _describe_leaf(path: str, leaf: Any) -> str | None:
    """How a non-`jax.Array` leaf would be uploaded, or None if it is not uploaded."""
    if isinstance(leaf, (bool, int, float, complex)) and not isinstance(leaf, np.generic):
        return f"`{path}` is a Python {type(leaf).__name__} ({leaf!r})"
    if isinstance(leaf, np.generic):
        return f"`{path}` is a NumPy scalar ({type(leaf).__name__}, {leaf!r})"
    if isinstance(leaf, np.ndarray):
        shape = ", ".join(map(str, leaf.shape))
        return f"`{path}` is a numpy.ndarray ({leaf.dtype}[{shape}])"
    return None


def _flatten(arguments: Sequence[tuple[str, Any]]) -> list[tuple[str, Any]]:
    flat = []
    for root, tree in arguments:
        for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
            flat.append((format_path(root, path), leaf))
    return flat


def upload_offenders(arguments: Sequence[tuple[str, Any]]) -> list[str]:
    """Descriptions of the argument leaves that a jitted call would upload implicitly."""
    found = []
    for path, leaf in _flatten(arguments):
        described = _describe_leaf(path, leaf)
        if described is not None:
            found.append(described)
    return found


def _devices_of(leaf: jax.Array) -> tuple[Any, ...]:
    return tuple(sorted(leaf.sharding.device_set, key=lambda d: d.id))


def device_offenders(
    arguments: Sequence[tuple[str, Any]],
) -> tuple[list[tuple[str, jax.Array]], tuple[Any, ...] | None]:
    """Argument arrays on other devices than most of the arguments (by bytes)."""
    arrays = [
        (path, leaf)
        for path, leaf in _flatten(arguments)
        if isinstance(leaf, jax.Array) and not isinstance(leaf, Tracer)
    ]
    weight: dict[tuple, int] = {}
    for _, leaf in arrays:
        devices = _devices_of(leaf)
        weight[devices] = weight.get(devices, 0) + leaf.nbytes
    if len(weight) <= 1:
        return [], None
    majority = max(weight, key=lambda k: weight[k])
    return [(p, x) for p, x in arrays if _devices_of(x) != majority], majority


def _check_arguments(arguments: Sequence[tuple[str, Any]]) -> None:
    """What the transfer guard cannot see, checked before the call: NumPy leaves (jit
    may upload them straight into their planned memory, which the guard does not see
    as an upload), arrays on other devices, arrays whose memory disagrees with their
    type."""
    numpy_leaves = [
        described
        for path, leaf in _flatten(arguments)
        if isinstance(leaf, (np.ndarray, np.generic))
        and (described := _describe_leaf(path, leaf)) is not None
    ]
    if numpy_leaves:
        raise ImplicitTransferError(
            _UPLOAD.format(
                offenders="; ".join(numpy_leaves),
                them="it" if len(numpy_leaves) == 1 else "them",
                fix="`x = jax.device_put(x)`",
            )
        )
    offenders, majority = device_offenders(arguments)
    if offenders and majority is not None:
        described = ", ".join(
            f"`{p}` ({jax.typeof(x).str_short()}) is on "
            + ", ".join(str(d) for d in _devices_of(x))
            + (" (committed)" if getattr(x, "committed", False) else "")
            for p, x in offenders
        )
        raise ImplicitTransferError(
            _DEVICES.format(
                offenders=described,
                them="it" if len(offenders) == 1 else "them",
                majority=", ".join(str(d) for d in majority),
                majority_device=f"jax.devices()[{majority[0].id}]",
            )
        )
    for path, leaf in _flatten(arguments):
        if isinstance(leaf, jax.Array) and not isinstance(leaf, Tracer):
            if not type_matches(leaf):
                typed = (
                    "host" if jax.typeof(leaf).memory_space == jax.memory.Space.Host else "device"
                )
                raise ImplicitTransferError(
                    _MISTYPED.format(
                        path=path,
                        kind=leaf.sharding.memory_kind,
                        type=jax.typeof(leaf).str_short(),
                        typed=typed,
                    )
                )


def _user_frame(error: BaseException) -> str:
    """`file:line (code)` of the innermost frame outside jax, numpy and offload_eqx."""
    skip = (
        os.sep + "jax" + os.sep,
        os.sep + "jaxlib" + os.sep,
        os.sep + "offload_eqx" + os.sep + "_",
        os.sep + "contextlib.py",
        os.sep + "numpy" + os.sep,
    )
    frames = [
        f
        for f in traceback.extract_tb(error.__traceback__)
        if not any(s in f.filename for s in skip)
    ]
    if not frames:
        return "an unknown location"
    frame = frames[-1]
    code = f" (`{frame.line.strip()}`)" if frame.line else ""
    return f"{frame.filename}:{frame.lineno}{code}"


def explain(error: BaseException, arguments: Sequence[tuple[str, Any]] | None) -> str | None:
    """A message naming the offending argument leaves of a transfer-guard error, or None
    if `error` is not a transfer-guard error."""
    blocked = blocked_transfer(error)
    if blocked is None:
        return None
    if blocked.direction == "host-to-device":
        offenders = upload_offenders(arguments or [])
        numpy_offenders = [o for o in offenders if "NumPy" in o or "numpy" in o]
        if numpy_offenders:
            # `ox.filter_jit` keeps Python scalars static (not uploaded): blame NumPy first.
            offenders = numpy_offenders
        if offenders:
            fixes = []
            if any("numpy" in o.lower() for o in offenders):
                fixes.append("`x = jax.device_put(x)`")
            if any("Python" in o for o in offenders):
                fixes.append("`jnp.asarray(value)`, or make it static")
            return _UPLOAD.format(
                offenders="; ".join(offenders),
                them="it" if len(offenders) == 1 else "them",
                fix=" or ".join(fixes) or "`jax.device_put`",
            )
        if arguments is None:
            return _EAGER.format(aval=blocked.aval, where=_user_frame(error))
        return _NO_ARGUMENT.format(
            direction="host-to-device",
            detail=f"`{blocked.aval}` at {_user_frame(error)}",
        )
    if blocked.direction == "device-to-device":
        offenders, majority = device_offenders(arguments or [])
        if offenders and majority is not None:
            described = ", ".join(
                f"`{p}` is on {', '.join(map(str, _devices_of(x)))}" for p, x in offenders
            )
            return _DEVICES.format(
                offenders=described,
                them="it" if len(offenders) == 1 else "them",
                majority=", ".join(str(d) for d in majority),
                majority_device=f"jax.devices()[{majority[0].id}]",
            )
        return (
            f"Implicit device-to-device transfer of `{blocked.aval}` at "
            f"{_user_frame(error)}: an argument is on another device than the jitted "
            "function's input sharding. Put it there once, outside the step, with "
            "`jax.device_put(x, sharding)`."
        )
    return None


@contextlib.contextmanager
def no_implicit_transfers(
    arguments: list[tuple[str, Any]] | None = None,
) -> Iterator[None]:
    """Make every implicit transfer an error that names its cause.

    **Arguments:**

    - `arguments`: optional `[(name, value), ...]` of the call being guarded (what
        `ox.filter_jit(audit=True)` passes). With them, an error names the offending leaf
        path (`opt_state.inner[1][0].mu.layers.w1`), its type and the fix; they are also
        checked before the call for arrays spread over several devices and arrays whose
        memory kind disagrees with their type, which JAX's guard never sees.

    Runs the body under `jax.transfer_guard("disallow")`: implicit host-to-device uploads
    (NumPy arrays, Python scalars passed to jit, eager `x + 1`) and implicit copies between
    devices raise `ImplicitTransferError`; explicit ones (`jax.device_put`, `ox.place`)
    are allowed. Device-to-host transfers (`float(loss)`, `np.asarray(x)`) are not seen on
    CPU, and transfers compiled into a program never are: use `ox.audit` for those.
    """
    if arguments:
        _check_arguments(arguments)
    try:
        with jax.transfer_guard("disallow"):
            yield
    except jax.errors.JaxRuntimeError as error:
        message = explain(error, arguments)
        if message is None:
            raise
        raise ImplicitTransferError(message) from None
