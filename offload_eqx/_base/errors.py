"""The exception types of offload_eqx, and the one place where JAX's text is recognised.

Errors are raised and caught as types. Where JAX reports a condition only as text (a
primitive that mixes memory spaces, a transfer guard), one function here recognises it,
and a test pins it against JAX's own message.
"""

import dataclasses
from collections.abc import Sequence
from typing import Any


@dataclasses.dataclass(frozen=True)
class Violation:
    """One breach of the placement contract, as `ox.audit` found it.

    - `rule`: which rule is broken, in a few words (`"nothing to offload"`,
        `"host leaf outside region"`, ...).
    - `path`: the leaf path or activation name it concerns (`model.layers.w1`, `h`).
    - `message`: the full sentence: what was found, where, and the fix.
    """

    rule: str
    path: str
    message: str


class ContractError(ValueError):
    """The program breaks the placement contract (a `ValueError`).

    Raised by `ox.audit` (and `ox.estimate`, which audits the step): a host-resident leaf
    used outside a region, arithmetic on host-typed values outside `ox.host_compute()`,
    host-typed gradients reaching the optimizer, a declared activation that is not
    saved, offloaded or recomputed as declared, an output in another memory than its
    argument's plan. Some breaches (an offloaded name that the backward pass never
    reads) are raised as soon as `ox.filter_jit` compiles the step.

    - `.violations`: a tuple of `ox.Violation`, one per breach.
    - `.report`: the full `ox.TransferReport` when the program could be traced, else None.
    """

    def __init__(self, message: str, violations: Sequence[Violation] = (), report: Any = None):
        super().__init__(message)
        self.violations = tuple(violations)
        self.report = report


class HostUseError(ContractError):
    """Host-resident leaves reached an operation that mixes memory spaces: used outside
    any region, or their host-typed gradients met device values. `.paths` names them.

    A `ContractError`; its message names each leaf, the line of the user's code, and the
    fixes (`ox.fetch`, a region, `optax.add_decayed_weights` for an L2 penalty).
    """

    def __init__(self, message: str, paths: Sequence[str]):
        violations = [Violation("host leaf outside region", p, message) for p in paths]
        super().__init__(message, violations)
        self.paths = tuple(paths)


class ImplicitTransferError(RuntimeError):
    """An implicit transfer under `ox.no_implicit_transfers()` (or `filter_jit(audit=True)`).

    A `RuntimeError` whose message names the leaf path (with the call's arguments), what
    it is (a NumPy array, a Python scalar, an array on another device) and the fix: move
    it once, explicitly, outside the step.
    """


class DonatedInputError(ValueError, RuntimeError):
    """A call given an array whose buffer an earlier call's donation deleted, naming its
    leaf path. A `ValueError`, as jax 0.10 raises it, and a `RuntimeError`, as jax 0.12
    does (code that catches either's catches this one)."""


class ComplexSavedError(ContractError, TypeError):
    """A region (`ox.scan`, `ox.checkpoint`, a module whose parameters live on the host)
    saves a complex value for the backward pass, which JAX's checkpoint cannot do: it
    rounds each saved value with `reduce_precision`, which refuses complex dtypes. A
    `ContractError` (`ox.fit` skips such a plan and says why) and a `TypeError`, as JAX
    raises it (code that catches JAX's catches this one)."""


class UnhashableStaticError(TypeError, ValueError):
    """A non-array argument that cannot be part of the compile cache key. A `TypeError`,
    as Python calls an unhashable value, and a `ValueError`, as `jax.jit` and
    `eqx.filter_jit` raise it (code that catches theirs catches this one)."""


# JAX's words for a primitive whose operands are in different memory spaces
# (`ValueError: memory_space of all inputs passed to dot_general must be the same`).
_MIXED_MEMORY_SPACES = "memory_space of all inputs passed to"


def mixes_memory_spaces(error: BaseException) -> bool:
    """Whether `error` is JAX's trace-time error for operands in different memory spaces."""
    return isinstance(error, ValueError) and _MIXED_MEMORY_SPACES in str(error)


# JAX's words when differentiating a host-typed value that a computation outside any
# region used (`ValueError: Expected cotangent type float32<host>[] but got float32[]`): a
# scalar computed on host memory turns device-typed in the next scalar operation, and
# the backward pass then sends a device-typed cotangent to a host-typed value.
_HOST_COTANGENT = "Expected cotangent type"


def is_host_cotangent_mismatch(error: BaseException) -> bool:
    """Whether `error` is JAX's backward-pass error for a cotangent in the wrong memory."""
    text = str(error)
    return isinstance(error, ValueError) and _HOST_COTANGENT in text and "<host>" in text


def is_host_use_error(error: BaseException) -> bool:
    """Whether `error` is one of JAX's errors for a host-typed value used on the device."""
    return mixes_memory_spaces(error) or is_host_cotangent_mismatch(error)


def mixed_memory_spaces_summary(error: BaseException) -> str:
    """The first sentence of JAX's mixed-memory-spaces (or host-cotangent) message, for
    our own messages."""
    text = str(error)
    if is_host_cotangent_mismatch(error):
        return text.split("\n")[0]
    start = text.find("memory_space of all inputs")
    if start < 0:
        return text.split("\n")[0]
    end = text.find("same", start)
    return text[start : end + 4] if end >= 0 else text[start:].split("\n")[0]


# JAX's words when a jitted call gets an argument in another memory kind or sharding than
# its `in_shardings` (`ox.filter_jit` then moves the argument explicitly).
_PLACEMENT_MISMATCH = (
    "Memory kinds passed to jax.jit does not match",
    "Sharding passed to jit does not match",
)


def is_placement_mismatch(error: BaseException) -> bool:
    """Whether `error` is JAX's refusal of an argument placed otherwise than `in_shardings`."""
    return isinstance(error, ValueError) and any(t in str(error) for t in _PLACEMENT_MISMATCH)
