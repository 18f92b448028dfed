"""The writers of a save, each awaited before its error reaches the caller.

Orbax writes a checkpoint from threads of its own (one per batch of arrays, one for the
metadata, one for the commit), and TensorStore from its own. A save interrupted in the
calling thread (Ctrl-C, `sys.exit` from a SIGTERM handler) stopped Orbax half-way while
those threads went on, and Orbax's `wait_until_finished` raises at the first failure
(too many open files, a full disk) while the others still write: the save's clean-up ran,
and `_sharding`, data files and `commit_success.txt` appeared in its temporary directory
afterwards. So every write of a save (its directory, Orbax, the checksums, the rename)
runs in a thread of its own (`write_to_the_end`), which no signal interrupts; the caller
waits for it. Interrupted, the caller tells it to stop at the next step it can stop at,
and still waits; a failed Orbax save is followed by waiting for every writer thread it
started (`orbax_write`). Only then is the temporary directory removed and the error
raised: a full disk and too many open files as an `OSError` naming the checkpoint and
what to do, an array a step donated meanwhile as the `ValueError` naming its leaf.
With `wait=False` (`in_background`) the arrays are copied into host memory first, and
saved from a thread of its own: a step may donate them as soon as the save returns.
"""

import _thread
import contextlib
import errno
import gc
import os
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import equinox as eqx
import jax
import numpy as np
from jax.core import Tracer

from .._plan.walk import format_path
from .checks import has_elements

_DELETED_WHILE_SAVING = (
    "{caller}: `{path}` was deleted while this save of the checkpoint `{checkpoint}` was "
    "writing it: a step donated it (`donate=`), most likely from another thread, and "
    "nothing of this save is left (no `{checkpoint}`, no temporary directory). A "
    "save reads every array until it returns. To checkpoint while training goes on, "
    "call `ox.save_checkpoint(path, tree, wait=False)` from the training loop, between "
    "steps: it copies the arrays into host memory before it returns, and writes the "
    "copy in the background."
)
_NO_SPACE = (
    "{caller}: {what} while writing the checkpoint `{path}` (the arrays hold {size}, "
    "before compression), and nothing of this save is left: its temporary directory was "
    "removed once every writer had stopped. Free space on the file system of `{parent}` "
    "(`df -h {parent}`), or save to another one, then save again. The error, chained: "
    "{original}"
)
_TOO_MANY_FILES = (
    "{caller}: Too many open files while writing the checkpoint `{path}` (Orbax and "
    "TensorStore open files and threads for its {arrays} arrays), and "
    "nothing of this save is left: its temporary directory was removed once every writer "
    "had stopped. Raise this process's limit of open files (`ulimit -n 65536` before "
    "starting it, or `resource.setrlimit(resource.RLIMIT_NOFILE, ...)`; the limit now: "
    "{limit}), then save again. The error, chained: {original}"
)
_NO_SPACE_CODES = {errno.ENOSPC: "No space left on device", errno.EDQUOT: "Disk quota exceeded"}
_FILE_LIMIT_CODES = {errno.EMFILE: "Too many open files", errno.ENFILE: "Too many open files"}
_SEVERAL_PROCESSES = (
    "{caller}: `wait=False` saves in a thread of its own, and in a run of several processes "
    "(this one has {count}) the processes would write and rename the checkpoint in an "
    "order of their own, while the training loop runs steps across all of them; nothing "
    "was written. Save with `wait=True` (the default) from the training loop, or use "
    "Orbax's `CheckpointManager` for asynchronous checkpoints across processes."
)
_THREAD_NAME = "offload_eqx save_checkpoint"
_POLL_SECONDS = 0.05  # how often a waiting caller checks for Ctrl-C
_TENSORSTORE_WAIT_SECONDS = 60.0  # a data file TensorStore still writes
_EXECUTOR_WAIT_SECONDS = 10.0  # a file operation an event loop left under way
_ORIGINAL_CHARACTERS = 300  # of the error a message is raised from
_WAIT_ATTEMPTS = 100  # Orbax's waits raise one failed write at a time


class _Writes:
    """One save's writes, in a thread of its own that writes nothing before its caller
    waits for it (`begin`), and stops where it can once `abandoned` is set."""

    def __init__(self, write: Callable[[threading.Event], None]):
        self.write = write
        self.abandoned, self.begin, self.done = (threading.Event() for _ in range(3))
        self.failures: list[BaseException] = []
        # Not a daemon, as the threads Orbax starts from it inherit it (and are awaited).
        self.thread = threading.Thread(target=self._run, name=_THREAD_NAME, daemon=False)

    def _run(self) -> None:
        try:
            self.begin.wait()
            if not self.abandoned.is_set():
                self.write(self.abandoned)
        except BaseException as error:  # raised in the caller's thread
            self.failures.append(error)
        finally:
            self.done.set()

    def launch(self) -> None:
        """Start the thread; called from `_thread`'s own thread, as `Thread.start` waits
        for the thread to run, and an interrupt there would leave it unknown."""
        try:
            self.thread.start()
        except BaseException as error:  # no thread to be had: nothing written
            self.failures.append(error)
            self.done.set()

    def stop(self) -> None:
        self.abandoned.set()
        self.begin.set()


def write_to_the_end(write: Callable[[threading.Event], None]) -> None:
    """Run `write` (every write of one save) in a thread of its own and wait for it to
    end. A `KeyboardInterrupt` or `SystemExit` (or what a signal handler raises) in this
    thread meanwhile sets the event `write` is given (it stops at the next step it can
    stop at, and cleans up), and is raised once `write` has ended; else `write`'s own
    error is. An interrupt that comes before the thread is started is raised at once:
    the thread, if it began, ends without writing."""
    writes = _Writes(write)
    started, interrupt = False, None
    while not writes.done.is_set():
        try:
            if not started:
                _thread.start_new_thread(writes.launch, ())  # returns at once
                started = True
            writes.begin.set()
            writes.done.wait(_POLL_SECONDS)
        except BaseException as error:  # Ctrl-C, or SystemExit from a signal handler
            writes.stop()
            if not started:
                raise
            interrupt = interrupt or error
    if interrupt is not None:
        raise interrupt
    if writes.failures:
        raise writes.failures[0]


def _is_orbax_thread(thread: threading.Thread) -> bool:
    """A thread Orbax started (a commit future, its commit thread)."""
    target = getattr(thread, "_target", None)
    modules = (type(thread).__module__, getattr(target, "__module__", None) or "")
    return any(module.startswith("orbax.") for module in modules)


def _is_loop_executor(thread: threading.Thread) -> bool:
    """A thread of an event loop's default executor (`asyncio.to_thread`): Orbax's file
    operations (`_METADATA`, `commit_success.txt`) run there."""
    return thread.name.startswith("asyncio_")


def _join_started_since(before: set, belongs: Callable[[threading.Thread], bool], limit: float):
    """Wait for every thread started since `before` that `belongs`, for `limit` seconds
    at most in all. `Thread.join` itself: Orbax's threads (`_SignalingThread`) override
    it to raise the thread's error (or a cancellation, or a timeout), which stopped this
    wait at the first failed thread, before those after it and TensorStore's writes
    (98 under way) had ended: they made the removed directory again (a save failed for
    too many open files left `step_6.offload_eqx-tmp-*`, in 3 runs of 40 of 8 saves).
    Threads started meanwhile by those joined are waited for too."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:  # a thread joined may have started another
        left = [
            thread
            for thread in threading.enumerate()
            if thread not in before
            and not thread.daemon
            and thread is not threading.current_thread()
            and belongs(thread)
        ]
        if not left:
            return
        for thread in left:
            threading.Thread.join(thread, max(0.0, deadline - time.monotonic()))


def _await_tensorstore(limit: float) -> None:
    """Wait, `limit` seconds at most in all, for every TensorStore operation still under
    way in this process. A failed save's coroutines were dropped with the futures they
    awaited, and TensorStore's threads go on writing (the data files of an array whose
    opening had begun): those futures are found among Python's objects."""
    tensorstore = sys.modules.get("tensorstore")
    if tensorstore is None:
        return
    deadline = time.monotonic() + limit
    for found in gc.get_objects():
        if isinstance(found, tensorstore.WriteFutures):
            found = found.commit
        if isinstance(found, tensorstore.Future) and not found.done():
            with contextlib.suppress(Exception):  # its error is the save's, or none of ours
                found.result(timeout=max(0.0, deadline - time.monotonic()))


def _settle(checkpointer: Any, before: set, close: bool) -> None:
    """After a failed save, every writer it started has stopped: Orbax's commit thread,
    each commit future (Orbax raised at the first that failed), the file operations their
    event loops left under way, and TensorStore's; our own checkpointer is closed
    meanwhile (which waits for its metadata writes)."""
    for _ in range(_WAIT_ATTEMPTS):  # each call raises the next failure of those left
        try:
            checkpointer.wait_until_finished()
            break
        except Exception:  # the error being raised says more
            continue
    timeout = float(getattr(getattr(checkpointer, "_async_manager", None), "_timeout_secs", 600))
    _join_started_since(before, _is_orbax_thread, timeout)
    if close:
        with contextlib.suppress(Exception):
            checkpointer.close()
    _join_started_since(before, _is_loop_executor, _EXECUTOR_WAIT_SECONDS)
    _await_tensorstore(_TENSORSTORE_WAIT_SECONDS)


def orbax_write(ocp: Any, written: str, arrays: Any, given: Any) -> None:
    """Orbax writes `arrays` into `written` (Orbax refuses arrays without elements,
    recorded in the checksums only), with `given` or a `StandardCheckpointer` of our own,
    closed when it ends. Ours creates the directory before starting its threads: created
    in the background (Orbax's default), a directory that cannot be made leaves threads
    waiting for it for 20 minutes, and the process does not exit. When the save fails,
    every writer it started has stopped before the error is raised."""
    before = set(threading.enumerate())
    checkpointer = given
    if checkpointer is None:
        options = ocp.options.AsyncOptions(create_directories_asynchronously=False)
        checkpointer = ocp.StandardCheckpointer(async_options=options)
    try:
        checkpointer.save(written, eqx.filter(arrays, has_elements))
        checkpointer.wait_until_finished()
    except BaseException:
        _settle(checkpointer, before, close=given is None)
        raise
    if given is None:
        checkpointer.close()


def _deleted_leaf(tree: Any) -> str | None:
    for keys, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if isinstance(leaf, jax.Array) and not isinstance(leaf, Tracer) and leaf.is_deleted():
            return format_path("tree", keys)
    return None


def _code(error: BaseException, codes: dict[int, str]) -> tuple[int, BaseException] | None:
    """The errno among `codes` that `error` (or an error it was raised from) carries, and
    the error that carries it: Python's `OSError`, or TensorStore's `ValueError`
    (`RESOURCE_EXHAUSTED: ... [os_error_code='28']`)."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno in codes:
            return current.errno, current
        text = str(current)
        for code, words in codes.items():
            if f"[os_error_code='{code}']" in text or words in text:
                return code, current
        current = current.__cause__ or current.__context__
    return None


def _original(error: BaseException) -> str:
    """The first line of the error a message is raised from, without TensorStore's spec
    of the array (a page long)."""
    line = (str(error).splitlines() or [""])[0].split(" [tensorstore_spec=")[0]
    line = line if len(line) <= _ORIGINAL_CHARACTERS else line[:_ORIGINAL_CHARACTERS] + "..."
    return f"{type(error).__name__}: {line}"


def _size(arrays: Any) -> str:
    total = sum(int(x.nbytes) for x in arrays)
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if total >= scale:
            return f"{total / scale:.1f} {unit}"
    return f"{total} bytes"


def raise_named(caller: str, path: str, tree: Any, error: BaseException) -> None:
    """Raise what `error`, which ended a save of `tree` to `path`, means to the caller,
    from it: an array donated meanwhile, a full disk, too many open files; else return."""
    leaf = _deleted_leaf(tree)
    if leaf is not None:
        message = _DELETED_WHILE_SAVING.format(caller=caller, path=leaf, checkpoint=path)
        raise ValueError(message) from error
    arrays = [x for x in jax.tree.leaves(eqx.filter(tree, eqx.is_array)) if has_elements(x)]
    found = _code(error, _NO_SPACE_CODES)
    if found is not None:
        code, carrier = found
        parent = os.path.dirname(path)
        message = _NO_SPACE.format(
            caller=caller,
            what=_NO_SPACE_CODES[code],
            path=path,
            size=_size(arrays),
            parent=parent,
            original=_original(carrier),
        )
        raise OSError(code, message, path) from error
    found = _code(error, _FILE_LIMIT_CODES)
    if found is not None:
        import resource

        code, carrier = found
        message = _TOO_MANY_FILES.format(
            caller=caller,
            path=path,
            arrays=len(arrays),
            limit=resource.getrlimit(resource.RLIMIT_NOFILE)[0],
            original=_original(carrier),
        )
        raise OSError(code, message, path) from error


def _copied(leaf: Any) -> Any:
    """A copy of one leaf that no step can donate: a JAX array copied into host memory
    (device memory is not doubled), a NumPy array copied; other leaves as they are."""
    if isinstance(leaf, np.ndarray):
        return np.array(leaf, copy=True)
    if not isinstance(leaf, jax.Array):
        return leaf
    try:
        host = leaf.sharding.with_memory_kind("pinned_host")
        return jax.device_put(leaf, host, may_alias=False)
    except (ValueError, TypeError, AttributeError):  # no host memory of its own here
        return jax.device_put(leaf, leaf.sharding, may_alias=False)


def in_background(caller: str, tree: Any, save: Callable[[Any], None]) -> "Future[None]":
    """`save` of a copy of `tree` in a thread of its own; the copy is made before this
    returns (`jax.block_until_ready`), so a step may donate `tree` at once."""
    if jax.process_count() > 1:
        raise ValueError(_SEVERAL_PROCESSES.format(caller=caller, count=jax.process_count()))
    snapshot = jax.block_until_ready(jax.tree.map(_copied, tree))
    future: Future[None] = Future()
    future.set_running_or_notify_cancel()

    def run() -> None:
        try:
            save(snapshot)
        except BaseException as error:  # the caller reads it from the future
            future.set_exception(error)
        else:
            future.set_result(None)

    threading.Thread(target=run, name="offload_eqx save_checkpoint(wait=False)").start()
    return future
