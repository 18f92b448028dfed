"""Ctrl-C during a call that donates its inputs is held until the call returns.

A step with `donate="all"` deletes its inputs when it starts; until the loop rebinds its
names to the outputs, the outputs are the only copy of the model and optimizer state.
A `KeyboardInterrupt` raised in between (Python raises it after the blocking call
returns, at its next check) loses them: the call's result is dropped as the exception
unwinds. So the first donating call made from the main thread chains a SIGINT handler in
front of the one in place: while a donating call runs it only notes the signal, which
is delivered (as `KeyboardInterrupt`, saying where the outputs are kept) once the call
has stored its outputs; at any other time it hands the signal straight to the previous
handler. Installing it once costs a few microseconds; each call after that sets a
counter. A handler installed later by the program replaces it, and then nothing is held.
"""

import signal
import threading
from typing import Any

_INTERRUPTED = (
    "Ctrl-C arrived while {caller} ran a step that donates its inputs: the step was let "
    "finish, and its outputs, the only copy of the state it updated, are kept: `model, "
    "opt_state, *rest = step.last_outputs` (as the step returns them)."
)
_MAIN = threading.main_thread().ident


class _Hold:
    """The chained handler's state: how many donating calls run, the signal held."""

    running = 0
    held: Any = None  # the frame the held signal arrived in
    previous: Any = None
    installed = False


def _handler(signum: int, frame: Any) -> None:
    if _Hold.running:
        _Hold.held = frame
    else:
        _Hold.previous(signum, frame)


def _install() -> None:
    _Hold.installed = True
    previous = signal.getsignal(signal.SIGINT)
    if callable(previous):  # SIG_IGN / SIG_DFL: nothing of Python's to defer
        _Hold.previous = previous
        signal.signal(signal.SIGINT, _handler)


def hold() -> bool:
    """Start holding Ctrl-C back (main thread only, where Python runs signal handlers);
    returns whether it does. Pair with `release`."""
    if threading.get_ident() != _MAIN:
        return False
    if not _Hold.installed:
        _install()
    _Hold.running += 1
    return True


def release(caller: str) -> None:
    """Stop holding; deliver a Ctrl-C that arrived meanwhile to the previous handler
    (Python's own raises `KeyboardInterrupt`, saying where the outputs are)."""
    _Hold.running -= 1
    if _Hold.running or _Hold.held is None:
        return  # an enclosing donating call delivers it
    frame, _Hold.held = _Hold.held, None
    if _Hold.previous is signal.default_int_handler:
        raise KeyboardInterrupt(_INTERRUPTED.format(caller=caller))
    _Hold.previous(signal.SIGINT, frame)
