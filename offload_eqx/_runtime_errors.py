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

try:  # where Equinox keeps the message of the check that failed, and its format
    from equinox import _jit as _equinox_jit
except ImportError:  # pragma: no cover - the pinned equinox has it
    _equinox_jit = None

_CALLBACKS = ("pure_callback", "io_callback", "debug_callback")
# The name of the exception Equinox's callback raises, as it appears in JAX's error.
_MARKER = "_EquinoxRuntimeError: "
_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep


def checks_at_run_time(closed: Any) -> bool:
    """Whether a (closed) jaxpr contains an Equinox run-time check at any depth."""
    for eqn in getattr(closed, "jaxpr", closed).eqns:
        if eqn.primitive.name in _CALLBACKS:
            function = getattr(eqn.params.get("callback"), "callback_func", None)
            if getattr(function, "__module__", "").startswith("equinox"):
                return True
        if any(checks_at_run_time(sub) for sub in jex.core.jaxprs_in_params(eqn.params)):
            return True
    return False


def raises_at_run_time(closed: Any) -> str | None:
    """What in a (closed) jaxpr can raise while the program runs, at any depth: an
    Equinox check (`eqx.error_if`) or another host callback; None if nothing can."""
    for eqn in getattr(closed, "jaxpr", closed).eqns:
        if eqn.primitive.name in _CALLBACKS:
            function = getattr(eqn.params.get("callback"), "callback_func", None)
            module = getattr(function, "__module__", "") or ""
            if module.startswith("equinox"):
                return "an Equinox check (`eqx.error_if` or its kin)"
            if module.startswith("jax."):
                continue  # JAX's own (`jax.debug.print`): formats and prints, never raises
            label = getattr(function, "__qualname__", None) or "a function"
            return f"`jax.{eqn.primitive.name.replace('_callback', '')}_callback` of {label}"
        for sub in jex.core.jaxprs_in_params(eqn.params):
            found = raises_at_run_time(sub)
            if found is not None:
                return found
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
        return not (
            record.name == "jax._src.callback" and record.getMessage() == "jax.pure_callback failed"
        )


_FILTER = _QuietCallbacks()


@contextlib.contextmanager
def quiet_callback_failures() -> Iterator[None]:
    """Keep JAX's log line for a failed callback off the terminal: the error says it."""
    logger = logging.getLogger("jax._src.callback")
    logger.addFilter(_FILTER)
    try:
        yield
    finally:
        logger.removeFilter(_FILTER)
