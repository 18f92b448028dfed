"""Errors a compiled step raises while it runs: `eqx.error_if` and its kin.

`eqx.error_if` (and `eqx.branched_error_if`, and the libraries built on them: diffrax and
optimistix report solver failures this way) compiles a host callback that raises when the
predicate holds. `eqx.filter_jit` turns the resulting `JaxRuntimeError` into an
`eqx.EquinoxRuntimeError` carrying the user's message, keeps JAX's "jax.pure_callback
failed" log line off the terminal, and waits for the program to finish so that the
error is raised by the call that failed. `ox.filter_jit` does the same for programs
that contain such a check (found in the traced program), and only for them: a step
without one keeps JAX's asynchronous dispatch.
"""

import contextlib
import logging
import os
from collections.abc import Iterator
from typing import Any

import equinox as eqx
import jax.extend as jex

from .._base.equinox_private import equinox_jit as _equinox_jit
from .._base.jax_private import CALLBACK_FAILED, CALLBACK_LOGGER

_CALLBACKS = ("pure_callback", "io_callback", "debug_callback")
# The name of the exception Equinox's callback raises, as it appears in JAX's error.
_MARKER = "_EquinoxRuntimeError: "
# The package's root folder: frames under it are ours, not the user's.
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def _callbacks(closed: Any) -> Iterator[tuple[str, Any]]:
    """Every host callback of a (closed) jaxpr at any depth, in program order: its
    primitive's name and the Python function it calls."""
    for eqn in getattr(closed, "jaxpr", closed).eqns:
        if eqn.primitive.name in _CALLBACKS:
            yield eqn.primitive.name, getattr(eqn.params.get("callback"), "callback_func", None)
        for sub in jex.core.jaxprs_in_params(eqn.params):
            yield from _callbacks(sub)


def _module_of(function: Any) -> str:
    return getattr(function, "__module__", "") or ""


def checks_at_run_time(closed: Any) -> bool:
    """Whether a (closed) jaxpr contains an Equinox run-time check at any depth."""
    return any(_module_of(f).startswith("equinox") for _, f in _callbacks(closed))


def raises_at_run_time(closed: Any) -> str | None:
    """What in a (closed) jaxpr can raise while the program runs, at any depth: an
    Equinox check (`eqx.error_if`) or another host callback; None if nothing can."""
    for primitive, function in _callbacks(closed):
        module = _module_of(function)
        if module.startswith("equinox"):
            return "an Equinox check (`eqx.error_if` or its kin)"
        if module.startswith("jax."):
            continue  # JAX's own (`jax.debug.print`): formats and prints, never raises
        label = getattr(function, "__qualname__", None) or "a function"
        return f"`jax.{primitive.replace('_callback', '')}_callback` of {label}"
    return None


def equinox_error(error: BaseException) -> Exception | None:
    """The `eqx.EquinoxRuntimeError` that `eqx.filter_jit` raises for `error`, when it
    comes from an Equinox check; None otherwise."""
    if _equinox_jit is None or _MARKER not in str(error):
        return None
    info = getattr(_equinox_jit, "last_error_info", None)
    if info is None:
        return None
    message, stack = info
    # The stack was taken where the check was traced, innermost frame first: keep the
    # frames inside the step, up to the first of offload_eqx's own (the trace's start).
    inside = []
    for piece in stack:
        if isinstance(piece, str):
            if _PACKAGE in piece:
                break
            inside.append(piece)
    frames = "".join(reversed(inside))
    template = getattr(_equinox_jit, "_on_error_msg", "{msg}")
    return eqx.EquinoxRuntimeError(template.format(msg=message, stack=frames))


class _QuietCallbacks(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.name == CALLBACK_LOGGER and record.getMessage() == CALLBACK_FAILED)


_FILTER = _QuietCallbacks()


@contextlib.contextmanager
def quiet_callback_failures() -> Iterator[None]:
    """Keep JAX's log line for a failed callback off the terminal: the error says it."""
    logger = logging.getLogger(CALLBACK_LOGGER)
    logger.addFilter(_FILTER)
    try:
        yield
    finally:
        logger.removeFilter(_FILTER)
