"""Ctrl-C during a call that donates its inputs is delivered where the loop's names are valid.

A step with `donate="all"` deletes its inputs when it starts; until the loop rebinds its
names to the outputs (`model, opt_state, loss = step(model, opt_state, x)`), the outputs
are the only copy of the model and optimizer state. A `KeyboardInterrupt` raised in
between (Python raises it after the blocking call returns, at its next check) loses
them: the call's result is dropped as the exception unwinds, and the loop's names are
left on deleted buffers. So each donating call made from the main thread chains a
SIGINT handler in front of the one in place (unless it is there already). While a
donating call runs it only notes the signal; the call returns its outputs normally, the
loop rebinds its names, and the interrupt is delivered

- at the start of the next donating call, before anything is donated (a training loop
  calls its step again at once), or
- after `GRACE` seconds, from a timer, if no donating call comes first (the loop ended,
  or does something else: an evaluation, a checkpoint).

Either way the loop's names hold the last step's outputs when `KeyboardInterrupt` is
raised. A Ctrl-C that arrives within `GRACE` seconds after a donating call returned (the
outputs on their way to the loop's names) is held the same way. At any other time the
handler hands the signal straight to the previous one.
Each donating call checks that the handler is still in front (a handler the program
installs later is chained behind it again) and sets a counter: about 6,500 instructions,
with the release after the call.
"""

import _signal  # type: ignore[import-not-found]  # CPython's C module under `signal`: no stub
import _thread
import math
import signal
import threading
import time
from typing import Any

_INTERRUPTED = (
    "Ctrl-C arrived while (or just after) {caller} ran a step that donates its inputs: "
    "the step was let finish and returned its outputs, so the names your loop bound to "
    "them hold the state (and `step.last_outputs` keeps them too); it is delivered now, "
    "before anything more was donated."
)
_MAIN = threading.main_thread().ident
GRACE = 0.5  # seconds a held Ctrl-C waits for the next donating call


class _Hold:
    """The chained handler's state: how many donating calls run, the signal held, and
    the interrupt waiting for delivery."""

    running = 0
    held: Any = None  # the frame the held signal arrived in
    pending: str | None = None  # the caller whose held Ctrl-C awaits delivery
    timer: threading.Timer | None = None
    previous: Any = None
    released_at = -math.inf  # when the latest donating call returned (time.monotonic)
    released_by = ""  # and its caller
    fired = False  # the timer sent the signal now on its way to the main thread


def _handler(signum: int, frame: Any) -> None:
    fired, _Hold.fired = _Hold.fired, False
    if fired and _Hold.pending is None:
        # The timer's signal for an interrupt a donating call delivered meanwhile (it
        # raised at its start): already raised once, not again wherever Python is now.
        return
    if _Hold.running:
        _Hold.held = frame
    elif _Hold.pending is not None:
        _deliver(signum, frame, _take_pending())
    elif time.monotonic() - _Hold.released_at < GRACE:
        # Just after a donating call returned: its outputs may not be bound to the
        # loop's names yet. Held like one that arrived during the call.
        _pend(_Hold.released_by)
    else:
        _Hold.previous(signum, frame)


def _chain() -> None:
    """Put `_handler` in front of the SIGINT handler in place, unless it is there already
    or the one in place is not Python's (SIG_IGN / SIG_DFL: nothing to defer)."""
    # `signal.getsignal` is `_signal.getsignal` wrapped to turn SIG_DFL and SIG_IGN into
    # enum members, which it tries on every handler and, for a function, fails with a
    # `ValueError` caught inside: about 20,000 instructions, where the raw read takes a few
    # hundred (it was most of a donating call's interrupt handling). The raw handler is
    # what is compared here.
    current = _signal.getsignal(signal.SIGINT)
    if current is not _handler and callable(current):
        _Hold.previous = current
        signal.signal(signal.SIGINT, _handler)


def _deliver(signum: int, frame: Any, caller: str | None) -> None:
    if _Hold.previous is signal.default_int_handler:
        raise KeyboardInterrupt(_INTERRUPTED.format(caller=caller or "a step"))
    _Hold.previous(signum, frame)


def _take_pending() -> str | None:
    """The pending interrupt's caller (None: none), no longer pending."""
    caller, _Hold.pending = _Hold.pending, None
    if _Hold.timer is not None:
        _Hold.timer.cancel()
        _Hold.timer = None
    return caller


def _timer_fired() -> None:
    if _Hold.pending is not None and not _Hold.running:
        _Hold.fired = True
        _thread.interrupt_main(signal.SIGINT)  # runs `_handler`, which delivers it


def deliver_pending() -> None:
    """Raise the Ctrl-C held during an earlier donating call, if one waits: called at
    the start of a donating call, before anything is donated."""
    if _Hold.pending is not None and threading.get_ident() == _MAIN:
        caller = _take_pending()
        _deliver(signal.SIGINT, None, caller)


def hold() -> bool:
    """Start holding Ctrl-C back (main thread only, where Python runs signal handlers);
    returns whether it does. Pair with `release`."""
    if threading.get_ident() != _MAIN:
        return False
    if not _Hold.running:
        _chain()  # again each time: the program may have set a handler since
    _Hold.running += 1
    return True


def release(caller: str) -> None:
    """Stop holding; a Ctrl-C that arrived meanwhile waits for the next donating call
    (or `GRACE` seconds), so that the outputs this call returns reach the loop's names."""
    _Hold.running -= 1
    if _Hold.running:
        return  # an enclosing donating call delivers it
    _Hold.released_at, _Hold.released_by = time.monotonic(), caller
    if _Hold.held is None:
        return
    _Hold.held = None
    _pend(caller)


def interrupt_waiting() -> bool:
    """Whether a Ctrl-C held during a donating call waits for delivery."""
    return _Hold.pending is not None


def _pend(caller: str) -> None:
    """Deliver the held Ctrl-C at the next donating call, or after `GRACE` seconds."""
    _Hold.pending = caller
    if _Hold.timer is None:
        _Hold.timer = threading.Timer(GRACE, _timer_fired)
        _Hold.timer.daemon = True
        _Hold.timer.start()


_IN_CALLBACK = (
    "Ctrl-C arrived while {caller} ran a host callback inside the step (`jax.debug."
    "callback`, `jax.pure_callback`, `io_callback`, `jax.debug.print`): the step stopped "
    "there and returned nothing. {fate}"
)
_KEPT = (
    "It had donated nothing (a step that calls back into Python keeps its inputs), so the "
    "arguments you passed still hold the state before this step: resume from them."
)
_LOST = (
    "Its donated inputs are deleted: {paths}. Resume from a checkpoint, or keep a "
    "step's inputs by not donating them (`donate='none'`)."
)


def is_callback_interrupt(error: Exception) -> bool:
    """Whether `error` is XLA's for a host callback whose Python code Ctrl-C interrupted
    (XLA wraps what the callback raised in `INTERNAL: CpuCallback error`, which `except
    KeyboardInterrupt` does not catch)."""
    text = str(error)
    return "CpuCallback error" in text and "\nKeyboardInterrupt" in text


def interrupted_callback(caller: str, deleted: list[str]) -> KeyboardInterrupt:
    """The `KeyboardInterrupt` for a Ctrl-C in a host callback, saying what became of the
    state (`deleted`: paths of the arguments the step consumed)."""
    shown = ", ".join(f"`{p}`" for p in deleted[:3]) + (", ..." if len(deleted) > 3 else "")
    fate = _LOST.format(paths=shown) if deleted else _KEPT
    return KeyboardInterrupt(_IN_CALLBACK.format(caller=caller, fate=fate))
