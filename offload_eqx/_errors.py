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
    """One breach of the placement contract."""

    rule: str
    path: str
    message: str


class ContractError(ValueError):
    """The program breaks the placement contract; `.violations` lists each breach and
    `.report` is the full `TransferReport` when the program could be traced."""

    def __init__(self, message: str, violations: Sequence[Violation] = (), report: Any = None):
        super().__init__(message)
        self.violations = tuple(violations)
        self.report = report


class HostUseError(ContractError):
    """Host-resident leaves reached an operation that mixes memory spaces: used outside
    any region, or their host-typed gradients met device values. `.paths` names them."""

    def __init__(self, message: str, paths: Sequence[str]):
        violations = [Violation("host leaf outside region", p, message) for p in paths]
        super().__init__(message, violations)
        self.paths = tuple(paths)


class ImplicitTransferError(RuntimeError):
    """An implicit transfer under `ox.no_implicit_transfers()` (or `filter_jit(audit=True)`)."""


# JAX's words for a primitive whose operands are in different memory spaces
# (`ValueError: memory_space of all inputs passed to dot_general must be the same`).
_MIXED_MEMORY_SPACES = "memory_space of all inputs passed to"


def mixes_memory_spaces(error: BaseException) -> bool:
    """Whether `error` is JAX's trace-time error for operands in different memory spaces."""
    return isinstance(error, ValueError) and _MIXED_MEMORY_SPACES in str(error)


def mixed_memory_spaces_summary(error: BaseException) -> str:
    """The first sentence of JAX's mixed-memory-spaces message, for our own messages."""
    text = str(error)
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
