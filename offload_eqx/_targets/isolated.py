"""`ox.fit`'s compiles for a target without its hardware, in a child process.

XLA ends the process on some programs instead of raising: a `CHECK` failure in one of
its passes aborts (SIGABRT), which Python cannot catch. A step the user wrote and ran
was compiled by JAX already; a plan `ox.fit` makes up is a program nobody compiled
before, and one such abort would end the user's whole search (and their session). So
while `ox.fit` searches (`isolating`), each program that is not in this process's memo
(`compile_memo`) is compiled by a child process (`isolated_child`), and a plan whose
compile kills the child is that plan's answer: `CompileAborted`, with XLA's last words.

How: the program is traced and lowered here as always, and `lowered.compile()` runs
until JAX hands the XLA client the module and its compile options
(`jax_private.compile_calls_replaced`); those go to the child (the module as MLIR
bytecode, the options serialized, the devices by id), which builds the same
compile-only devices and makes the same client call. It answers with what the reports
read: the memory analysis's fields and the compiled HLO text, which `Compiled` hands
out as JAX's `Compiled` does. Nothing is compiled twice: the child's compile is the
only one. One child serves the process: started when `ox.fit` starts (its start, the
import of JAX and offload_eqx, overlaps the first traces), kept for the next search,
replaced when it dies.

Not isolated: a target whose chip is attached (compiled for the hardware it runs on, by
the client that runs it), the CPU target, a program with host callbacks (compiled out of
a deviceless GPU program; a TPU program's are not sent), and the compile that only asks
which output shardings XLA chooses (`deviceless.compile_for`, on a mesh).
"""

import atexit
import contextlib
import dataclasses
import os
import pickle
import re
import subprocess
import sys
import tempfile
import threading
import types
from collections.abc import Iterator
from typing import Any

import jax
from jax.interpreters import mlir

from .._base.jax_private import compile_calls_replaced
from .._host.kernels import load
from .devices import _config_text, attached_devices
from .targets import Target

_CHILD = f"{__package__}.isolated_child"
# A line of XLA's C++ log that ends the process ("F1207 21:03:11.123 123 file.cc:42] ...").
_FATAL = re.compile(r"^F\d{4} ")
_ABORTED = "XLA aborted compiling this plan: {why}"
_NOT_STARTED = (
    "The child process that compiles ox.fit's plans (`{command}`) ended before it "
    "answered: {why}. It runs this Python with JAX imported; check that `{python} -c "
    "'import jax'` works."
)


class CompileAborted(RuntimeError):
    """XLA ended the process compiling a plan (a `CHECK` failure): the child that
    compiled it died. The message holds XLA's last lines."""


@dataclasses.dataclass(frozen=True)
class Compiled:
    """A program compiled in the child: what `jax.stages.Compiled` tells of it that the
    memory reports and the simulation read."""

    stats: dict[str, int]
    text: str

    def memory_analysis(self) -> Any:
        return types.SimpleNamespace(**self.stats)

    def as_text(self) -> str:
        return self.text


_state = threading.local()


@contextlib.contextmanager
def isolating(target: Target) -> Iterator[None]:
    """Inside, this thread's compiles for `target` (when `isolates(target)`) run in the
    child, which starts now."""
    previous = getattr(_state, "target", None)
    _state.target = target
    if isolates(target):
        _worker()
    try:
        yield
    finally:
        _state.target = previous


def isolates(target: Target) -> bool:
    """Whether a compile for `target` goes to the child here and now."""
    return (
        getattr(_state, "target", None) == target
        and target.deviceless
        and attached_devices(target) is None
    )


def in_child(lowered: Any, target: Target) -> Any:
    """`lowered` (a `jax.stages.Lowered`), or where `isolates(target)` one whose
    `compile(...)` runs in the child (`compile_lowered`)."""
    return _InChild(lowered, target) if isolates(target) else lowered


class _InChild:
    """A lowered program compiled in the child: what `compile_memo` and
    `compiler_faults` ask of a `jax.stages.Lowered`."""

    def __init__(self, lowered: Any, target: Target) -> None:
        self.lowered, self.target = lowered, target

    def as_text(self, *args: Any, **kwargs: Any) -> str:
        return self.lowered.as_text(*args, **kwargs)

    def compile(self, **options: Any) -> Any:
        return compile_lowered(self.lowered, self.target, **options)


def compile_lowered(lowered: Any, target: Target, **options: Any) -> Any:
    """`lowered.compile(**options)` in the child: a `Compiled`, or `CompileAborted` when
    XLA aborts. The child's log lines are written to this process's standard error
    (the caller's `compiler_log` sorts them)."""
    handed = _handed(lowered, options)
    if not isinstance(handed, _Handed):
        return handed  # compiled here: it had host callbacks, or JAX had it compiled
    request = {
        "module": handed.module,
        "options": handed.options,
        "devices": handed.devices,
        "topology": _topology(target),
        "kernels": _kernels_called(handed.module, target),
    }
    with _asking:
        answer, log = _worker().ask(request)
    if log:
        os.write(2, log.encode())
    if "error" in answer:
        raise jax.errors.JaxRuntimeError(answer["message"])
    return Compiled(answer["stats"], answer["text"])


class _Handed(Exception):
    """What JAX handed the XLA client: the module's bytecode, the serialized compile
    options, the devices' ids."""

    def __init__(self, module: bytes, options: bytes, devices: list[int]) -> None:
        super().__init__("taken to compile in a child process")
        self.module, self.options, self.devices = module, options, devices


def _handed(lowered: Any, options: dict[str, Any]) -> Any:
    """What JAX hands the XLA client to compile `lowered` (a `_Handed`), taken there
    instead of compiled; or the compiled program where JAX compiles it without the
    client (a program it compiled before) or it has host callbacks."""
    thread = threading.get_ident()

    def replace(original: Any) -> Any:
        def take(backend, module, executable_devices, options, host_callbacks):
            if host_callbacks or threading.get_ident() != thread:
                return original(backend, module, executable_devices, options, host_callbacks)
            raise _Handed(
                mlir.module_to_bytecode(module),
                options.SerializeAsString(),
                [device.id for device in executable_devices],
            )

        return take

    try:
        with compile_calls_replaced(replace):
            return lowered.compile(**options)
    except _Handed as handed:
        return handed


def _kernels_called(module: bytes, target: Target) -> list[str]:
    """offload_eqx's host kernels a GPU program calls (their custom-call targets are
    strings of its bytecode): the child registers them as this process did."""
    if target.platform != "cuda":
        return []
    return [name for name in load.host_kernels() if load.target_name(name).encode() in module]


def _topology(target: Target) -> dict[str, Any]:
    """The arguments of `get_topology_desc` that make `target`'s devices
    (`devices._devices` makes them so here)."""
    if target.platform == "cuda":
        return {
            "platform": "cuda",
            "topology": target.topology,
            "target_config": _config_text(target),
        }
    arguments: dict[str, Any] = {"platform": "tpu", "topology_name": target.topology}
    if target.chips_per_host is not None:
        arguments["chips_per_host_bounds"] = list(target.chips_per_host)
    return arguments


class _Child:
    """One child process: requests in on its standard input, answers out on its
    standard output, its standard error in a file read after each answer."""

    def __init__(self) -> None:
        self.log = tempfile.TemporaryFile()
        # libtpu takes a machine-wide lock unless told that several processes may load it.
        env = {**os.environ, "JAX_PLATFORMS": "cpu", "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}
        self.command = [sys.executable, "-P", "-m", _CHILD]
        self.process = subprocess.Popen(
            self.command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, env=env
        )
        self.ready = False
        self.read_to = 0

    def ask(self, request: dict[str, Any]) -> tuple[dict[str, Any], str]:
        """The child's answer to `request` and what it wrote to standard error meanwhile;
        `CompileAborted` if it died compiling."""
        assert self.process.stdin is not None and self.process.stdout is not None
        try:
            if not self.ready:
                pickle.load(self.process.stdout)
                self.ready = True
            pickle.dump(request, self.process.stdin)
            self.process.stdin.flush()
            answer = pickle.load(self.process.stdout)
        except (EOFError, OSError, pickle.UnpicklingError):
            self.process.wait()
            why = _last_words(self._new_log(), self.process.returncode)
            if not self.ready:
                raise RuntimeError(
                    _NOT_STARTED.format(
                        command=" ".join(self.command), why=why, python=sys.executable
                    )
                ) from None
            raise CompileAborted(_ABORTED.format(why=why)) from None
        except BaseException:  # Ctrl-C while it compiles: its answer would reach the next
            self.process.kill()  # request, so the next one goes to a new child
            raise
        return answer, self._new_log()

    def _new_log(self) -> str:
        self.log.seek(self.read_to)
        written = self.log.read()
        self.read_to += len(written)
        return written.decode(errors="replace")

    def alive(self) -> bool:
        return self.process.poll() is None

    def close(self) -> None:
        if self.process.stdin is not None:
            self.process.stdin.close()  # the child ends at the end of its input
        self.process.wait()
        self.log.close()


_lock = threading.Lock()  # starting the child
_asking = threading.Lock()  # one request at a time
_child: _Child | None = None


def _worker() -> _Child:
    """The process's child, started if there is none or the last one died."""
    global _child
    with _lock:
        if _child is None or not _child.alive():
            if _child is not None:
                _child.close()
            _child = _Child()
        return _child


@atexit.register
def close_child() -> None:
    """End the child (at exit; a test that changes the child's environment calls it,
    and the next compile starts a child that reads the environment anew)."""
    global _child
    with _lock:
        if _child is not None:
            _child.close()
        _child = None


def _last_words(log: str, returncode: int | None) -> str:
    """XLA's fatal log line (a `CHECK` failure's message), else the last lines the
    child wrote, and how it ended."""
    lines = [line.strip() for line in log.splitlines() if line.strip()]
    fatal = [line for line in lines if _FATAL.match(line)]
    shown = fatal[:1] or lines[-3:]
    ended = f"signal {-returncode}" if returncode is not None and returncode < 0 else None
    ended = ended or f"exit status {returncode}"
    text = " | ".join(shown)[:400] or "nothing written"
    return f"{text} (the compiling process ended with {ended})"
