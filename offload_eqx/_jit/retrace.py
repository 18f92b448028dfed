"""What a compiled entry's program, traced again by jit, tells the per-call path: that the
arguments have other types than the entry's (`NewArgumentTypes`: compile an entry for
them) or sit in another memory than planned (`Misplaced`: move them where the plan says),
and the types key both sides compare (`types_of`)."""

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from .._sharding.memory_space import is_host_aval


class NewArgumentTypes(Exception):
    """A compiled entry's program is traced again for other shapes, dtypes or weak types
    than its own: `ox.filter_jit` compiles (and validates) a new entry for them."""


class Misplaced(Exception):
    """A compiled entry's program is traced again for an argument in another memory than
    the plan's (a `pinned_host` array where the plan keeps the leaf on the device, and
    jit was left to place it): `ox.filter_jit` moves it where the plan says. Raised again
    for the moved arguments, it is reported with the leaf's path (`call_errors`); its own
    message names the argument's index and both types."""

    def __init__(self, index: int, got: Any, expected: Any):
        self.index, self.got, self.expected = index, got, expected
        super().__init__(
            f"argument {index} of the program is typed {got.str_short()}, and the program "
            f"was compiled for {expected.str_short()}"
        )


def types_of(dynamic: Sequence[Any]) -> tuple:
    """The shape, dtype and weak type of each array leaf, as `jax.jit` converts it: a
    NumPy float64 array is traced as float32 unless x64 is on, as in `eqx.filter_jit`."""
    return tuple(
        (
            tuple(np.shape(x)),
            jax.dtypes.canonicalize_dtype(x.dtype, allow_extended_dtype=True),
            bool(getattr(x, "weak_type", False)),
        )
        for x in dynamic
    )


def check_types(dynamic: Sequence[Any], in_avals: Sequence[Any]) -> None:
    """Raise `NewArgumentTypes` (or `Misplaced`) when jit traces the program again for
    arguments of other types than the jaxpr's (or in another memory)."""
    for x, aval in zip(dynamic, in_avals):
        got = jax.typeof(x)
        if (got.shape, got.dtype, got.weak_type) != (aval.shape, aval.dtype, aval.weak_type):
            raise NewArgumentTypes()
    for i, (x, aval) in enumerate(zip(dynamic, in_avals)):
        got = jax.typeof(x)
        if is_host_aval(got) != is_host_aval(aval):
            raise Misplaced(i, got, aval)
