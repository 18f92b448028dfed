"""The planners' options, checked before any trace or compile.

`ox.fit`, `ox.max_batch` and `ox.estimate` share option names, and a name means one thing
everywhere (`OPTIONS`): a budget is an int of bytes, a count an int, a flag True or False.
`@checks_options` checks a function's options when it is called, before its body (and
before the type checker the tests wrap around it) runs: a budget of -1 would otherwise run
a whole search to report that no plan fits. Budgets and counts of any integer type
(`np.int64(80 * 2**30)`) go on as Python ints.
"""

import dataclasses
import functools
import inspect
import math
import numbers
import re
from collections.abc import Callable
from fractions import Fraction
from typing import Any, ParamSpec, TypeVar

import numpy as np

from .table import format_bytes

P = ParamSpec("P")
R = TypeVar("R")

_TOO_FEW_BYTES = (
    "{where}({name}={value}): expected {expected}; {why}. Pass {what}, e.g. "
    "`{name}={example}` for {size}{or_none}."
)
_NOT_BYTES = "{where}({name}={value!r}): expected an int number of bytes, got {kind}{advice}"
_PASS_BYTES = ". Pass {what} as an int, e.g. `{name}={example}` for {size}{or_none}."
_READ_STRING = (
    "; strings are not parsed. {value!r} reads as {reading}{count} bytes{size}: pass "
    "`{name}={expression}`{alternative}."
)
_TOO_FEW = (
    "{where}({name}={value}): expected a positive int (1 or more); {why}. Pass e.g. "
    "`{name}={example}`{or_none}."
)
_NOT_COUNT = "{where}({name}={value!r}): expected a positive int, got {kind}. {advice}"
_PASS_COUNT = "Pass an int, e.g. `{name}={example}`{or_none}."
_NOT_FLAG = (
    "{where}({name}={value!r}): expected True or False, got {kind}, which would be read as "
    "its truth value. Pass `{name}=False` to {false}, or `{name}=True` to {true}."
)


@dataclasses.dataclass(frozen=True)
class Option:
    """What an option must be. `kind`: "bytes", "count" or "flag"; `what` the value in
    words; `expected` and `least` the smallest allowed; `none` what None means (allowed
    where the function's default is None); `example` a good value; `why` why less than
    `least` is refused; `false`/`true` what a flag does."""

    kind: str
    what: str = ""
    least: int = 1
    expected: str = "a positive number of bytes (1 or more)"
    none: str = ""
    example: tuple[str, str] = ("80 * 2**30", "80 GiB")
    why: str = ""
    false: str = ""
    true: str = ""


OPTIONS = {
    "device_budget": Option(
        "bytes", "the bytes one device may use", none="the target's device memory"
    ),
    "host_budget": Option(
        "bytes",
        "the bytes of host memory one device may use",
        least=0,
        expected="0 or more bytes (0: nothing in host memory)",
        none="the host memory per device (`Speeds.host_memory`)",
        example=("64 * 2**30", "64 GiB"),
    ),
    "max_compiles": Option(
        "count", none="no limit", example=("12", ""), why="the search compiles at least once"
    ),
    "start": Option("count", none="batch 1", example=("16", ""), why="batches start at 1"),
    "compile": Option(
        "flag",
        false="predict the time from the trace alone (no memory figures)",
        true="compile for the target and report its memory",
    ),
}

# Units a budget string may name: decimal (10**3n) and binary (2**10n).
_UNITS = {
    "b": ("B", 1, 0),
    "kb": ("KB", 10, 3),
    "mb": ("MB", 10, 6),
    "gb": ("GB", 10, 9),
    "tb": ("TB", 10, 12),
    "kib": ("KiB", 2, 10),
    "mib": ("MiB", 2, 20),
    "gib": ("GiB", 2, 30),
    "tib": ("TiB", 2, 40),
}


def checks_options(fn: Callable[P, R]) -> Callable[P, R]:
    """Check `fn`'s parameters named in `OPTIONS` on every call, before `fn` runs; pass
    them on as `check_option` returns them. Errors name the function as `ox.<name>`."""
    signature = inspect.signature(fn)
    where = f"ox.{fn.__name__}"
    optional = {
        name: parameter.default is None
        for name, parameter in signature.parameters.items()
        if name in OPTIONS
    }

    @functools.wraps(fn)
    def checked(*args: Any, **kwargs: Any) -> Any:
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError:
            return fn(*args, **kwargs)  # Python's own message for a wrong call
        for name, may_be_none in optional.items():
            if name in bound.arguments:
                value = bound.arguments[name]
                bound.arguments[name] = check_option(where, name, value, optional=may_be_none)
        return fn(*bound.args, **bound.kwargs)

    return checked


def check_option(where: str, name: str, value: Any, *, optional: bool) -> Any:
    """`value` as option `name` of `where` (`"ox.fit"`) takes it: an int for bytes and
    counts, a bool for flags, None if `optional` and None. Raises `TypeError` for a value
    of the wrong type, `ValueError` for one below the least allowed."""
    option = OPTIONS[name]
    if value is None and optional:
        return None
    if option.kind == "flag":
        if not isinstance(value, bool):
            raise TypeError(
                _NOT_FLAG.format(
                    where=where, name=name, value=value, kind=_kind(value),
                    false=option.false, true=option.true,
                )
            )  # fmt: skip
        return value
    or_none = f", or None for {option.none}" if optional else ""
    example, size = option.example
    number = None
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        number = int(value)
    if option.kind == "count" and number is None:
        advice = _PASS_COUNT.format(name=name, example=example, or_none=or_none)
        if isinstance(value, (float, np.floating)) and float(value).is_integer() and value >= 1:
            advice = f"Pass `{name}={int(value)}`."
        raise TypeError(
            _NOT_COUNT.format(where=where, name=name, value=value, kind=_kind(value), advice=advice)
        )
    if number is None:
        advice = _bytes_advice(name, value, option)
        if advice is None:
            advice = ("; strings are not parsed" if isinstance(value, str) else "") + (
                _PASS_BYTES.format(
                    what=option.what, name=name, example=example, size=size, or_none=or_none
                )
            )
        raise TypeError(
            _NOT_BYTES.format(where=where, name=name, value=value, kind=_kind(value), advice=advice)
        )
    if number >= option.least:
        return number
    if option.kind == "count":
        raise ValueError(
            _TOO_FEW.format(
                where=where, name=name, value=number, why=option.why, example=example,
                or_none=or_none,
            )
        )  # fmt: skip
    why = (
        "a negative number of bytes is not a size"
        if number < 0
        else f"a budget of {number} bytes leaves room for nothing"
    )
    raise ValueError(
        _TOO_FEW_BYTES.format(
            where=where, name=name, value=number, expected=option.expected, why=why,
            what=option.what, example=example, size=size, or_none=or_none,
        )
    )  # fmt: skip


def _bytes_advice(name: str, value: Any, option: Option) -> str | None:
    """How to pass a float or a string as an int of bytes, where it reads as one."""
    if isinstance(value, str):
        return _read_string(name, value, option)
    if not isinstance(value, (float, np.floating)) or not math.isfinite(value) or value <= 0:
        return None
    value = float(value)
    whole = value.is_integer()
    if whole or value >= 2**20:
        about = "" if whole else "about "
        count = _grouped(round(value))
        parts = [f"As bytes it is {about}{format_bytes(round(value))}: pass `{name}={count}`"]
    else:
        parts = [f"{value!r} is not a whole number of bytes"]
    if value < 2**20:  # so few bytes: more likely meant in GiB
        shown = f"{int(value)}" if whole else f"{value!r}"
        gib = f"{shown} * 2**30" if whole else f"int({shown} * 2**30)"
        parts.append(f"for {shown} GiB, pass `{name}={gib}`")
    return ". " + "; ".join(parts) + "."


def _read_string(name: str, value: str, option: Option) -> str | None:
    """What a string such as `'80GB'` reads as, and the int to pass; None if it does not
    read as bytes."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*", value)
    unit = "" if match is None else match.group(2).lower() or "b"
    if match is None or unit not in _UNITS:
        return None
    label, base, power = _UNITS[unit]
    amount = Fraction(match.group(1))
    count = amount * base**power
    if count.denominator != 1 or count < option.least:
        return None
    total, whole = int(count), amount.denominator == 1
    shown = str(amount.numerator) if whole else match.group(1)
    expression = f"{shown} * {base}**{power}" if whole and unit != "b" else _grouped(total)
    alternative = ""
    if base == 10 and whole:
        binary_label, _, binary_power = _UNITS[unit[0] + "ib"]
        alternative = f", or `{name}={shown} * 2**{binary_power}` for {shown} {binary_label}"
    return _READ_STRING.format(
        value=value,
        reading="" if unit == "b" else f"{shown} {label}, ",
        count=_grouped(total),
        size="" if base == 2 else f" ({format_bytes(total)})",
        name=name,
        expression=expression,
        alternative=alternative,
    )


def _grouped(count: int) -> str:
    """`80_000_000_000`, but `1024`: digits grouped where there are many."""
    return f"{count:_}" if count >= 10**5 else str(count)


def _kind(value: Any) -> str:
    if value is None:
        return "None"
    name = type(value).__name__
    if type(value).__module__ == "numpy":
        name = f"numpy.{name}"  # `numpy.bool`, not a `bool`
    return f"{'an' if name[0] in 'aeiou' else 'a'} {name}"
