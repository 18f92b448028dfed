"""Where a save writes: a private temporary directory, renamed into place once complete.

Orbax writes every save for `<name>` into the one temporary directory
`<name>.orbax-checkpoint-tmp`: two saves for one path wrote into it together and left a
checkpoint mixed of both, or nothing. Each `ox.save_checkpoint` makes a directory of
its own beside the checkpoint (`<name>.offload_eqx-tmp-<random>`, the name cut to fit
a file name's 255 bytes; made by `tempfile.mkdtemp`, on the same file system), writes the
checkpoint there as `checkpoint`, then renames it to `<name>` in one step: a checkpoint
is complete or absent. Of two saves racing for one path
the first to finish wins; the other finds `<name>` taken, discards its own and raises. A
save that fails for any reason, or whose caller is interrupted, removes its directory
(once every writer has stopped: `writers`). A path Orbax cannot read back (one
with `[` or `]`, which it globs, or `\\`, which TensorStore reads as a separator) is
refused before anything is written, and so is a path that is not UTF-8 text (Orbax and
TensorStore take no other).
"""

import contextlib
import errno
import gc
import os
import shutil
import tempfile
import threading
import time
import warnings
from collections.abc import Iterator

import jax
import numpy as np

from .checks import private_prefix

_LOST_RACE = (
    "{caller}: `{path}` appeared while this save was writing: another save given the "
    "same path finished first. Its checkpoint is kept as it is; this save's arrays were "
    "discarded, and nothing of it is left. Give each save its own path (`step_<n>`), or "
    "save from one thread or process only."
)
_UNDER_A_FILE = (
    "{caller}: `{path}` cannot be made: `{parent}` is a file, not a directory, and nothing "
    "was written. Save under a directory (or remove the file)."
)
_ELSEWHERE = (
    "{caller}: the first process could not rename the finished checkpoint to `{path}` "
    "(its error says why); nothing of this save is left."
)
_NOT_REMOVED = (
    "offload_eqx: the unfinished checkpoint `{directory}` could not be removed after the "
    "save stopped (its writers' files still open, or no permission); it is not a "
    "checkpoint (no restore reads a name ending in `.offload_eqx-tmp-...`). Remove it by "
    "hand: `rm -r '{directory}'`."
)
_INSIDE = "checkpoint"  # the checkpoint's name inside a save's temporary directory
_REMOVE_ATTEMPTS = 40  # about 22 s of waiting in all (a busy machine: 4.5 s did not do)
_REMOVAL_FILES = 64  # files `shutil.rmtree` may open at once: a few more than levels
_NAME_BYTES = 1024  # room for a directory's name broadcast to the other processes


def _broadcast_name(name: str) -> str:
    """`name` as the first process has it, in every process."""
    from jax.experimental import multihost_utils

    encoded = np.zeros(_NAME_BYTES, np.uint8)
    raw = name.encode()
    encoded[: len(raw)] = np.frombuffer(raw, np.uint8)
    shared = np.asarray(multihost_utils.broadcast_one_to_all(encoded))
    return bytes(shared).rstrip(b"\0").decode()


def _private(parent: str, name: str) -> str:
    """A new directory of this save's own beside the checkpoint; one for all processes
    (the first makes it), as Orbax writes one checkpoint from all of them."""
    first = jax.process_index() == 0
    made = tempfile.mkdtemp(prefix=private_prefix(name), dir=parent) if first else ""
    if jax.process_count() == 1:
        return made
    return os.path.join(parent, _broadcast_name(os.path.basename(made)))


def _publish(caller: str, written: str, path: str) -> None:
    """Rename the finished checkpoint to `path`, in one step."""
    try:
        os.rename(written, path)  # atomic; fails when `path` is a directory with files
    except OSError as error:
        taken = error.errno in (errno.EEXIST, errno.ENOTEMPTY, errno.ENOTDIR)
        if taken or os.path.lexists(path):
            raise FileExistsError(_LOST_RACE.format(caller=caller, path=path)) from None
        raise


def _published_everywhere(caller: str, written: str, path: str) -> None:
    """`_publish` by the first process once every process has written its part; the
    others raise when it failed, and none returns before it is done."""
    if jax.process_count() == 1:
        _publish(caller, written, path)
        return
    from jax.experimental import multihost_utils

    multihost_utils.sync_global_devices(f"{caller}: {path}")
    failure: OSError | None = None
    if jax.process_index() == 0:
        try:
            _publish(caller, written, path)
        except OSError as error:
            failure = error
    lost = isinstance(failure, FileExistsError)
    outcome = int(multihost_utils.broadcast_one_to_all(np.int32(2 * lost + (failure is not None))))
    if failure is not None:
        raise failure
    if outcome == 3:
        raise FileExistsError(_LOST_RACE.format(caller=caller, path=path))
    if outcome:
        raise OSError(_ELSEWHERE.format(caller=caller, path=path))


@contextlib.contextmanager
def _room_to_remove() -> Iterator[None]:
    """The soft limit of open files raised by `_REMOVAL_FILES` (within the hard limit)
    while a save's directory is removed, then put back. A save that failed for too many
    open files is removed under the same limit, and its writers' files may stay open
    until it returns (the event loops Orbax's threads could not finish making, kept by
    the error being raised): with every file the limit allows taken, `shutil.rmtree`
    (one file for each level of the directory, and one to list it) removed nothing in
    all its attempts, and the directory was left (CI: `step_1.offload_eqx-tmp-...`)."""
    try:
        import resource
    except ImportError:  # no such limit here
        yield
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    room = soft + _REMOVAL_FILES
    room = room if hard == resource.RLIM_INFINITY else min(room, hard)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (room, hard))
    except (ValueError, OSError):  # soft is the hard limit, or no soft limit to raise
        yield
        return
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def _remove(directory: str) -> None:
    """Remove `directory`, trying again while it cannot be (TensorStore still closes the
    files of the writes that ended), with room for the files removing it takes."""
    with _room_to_remove():
        for attempt in range(_REMOVE_ATTEMPTS):
            shutil.rmtree(directory, ignore_errors=True)
            if not os.path.lexists(directory):
                return
            gc.collect()  # TensorStore's handles of the failed save, released with them
            time.sleep(0.01 * 2 ** min(attempt, 6))
    warnings.warn(_NOT_REMOVED.format(directory=directory), stacklevel=2)


class SaveAbandoned(Exception):
    """The caller of a save was interrupted (Ctrl-C, `sys.exit` from a signal handler):
    the save stops before publishing, and the caller raises its interrupt instead."""


def check_not_abandoned(abandoned: threading.Event | None) -> None:
    """Stop a save whose caller was interrupted, at a step where nothing is under way.
    In a run of several processes the save goes on: every process must reach the same
    barriers, and one stopping alone would leave the others waiting."""
    if abandoned is not None and abandoned.is_set() and jax.process_count() == 1:
        raise SaveAbandoned()


@contextlib.contextmanager
def private_checkpoint(
    caller: str, path: str, abandoned: threading.Event | None = None
) -> Iterator[str]:
    """The directory to write the checkpoint for `path` into, renamed to `path` when the
    block ends normally (unless `abandoned` is set); on any error (or a lost race:
    `FileExistsError`) it is removed and nothing is left. Its parent (`path`'s) is made
    first, as Orbax makes it."""
    parent, name = os.path.split(path)
    if os.path.exists(parent) and not os.path.isdir(parent):
        raise NotADirectoryError(_UNDER_A_FILE.format(caller=caller, path=path, parent=parent))
    os.makedirs(parent, exist_ok=True)  # a `PermissionError` names the directory
    private = _private(parent, name)
    try:
        # A short name inside: Orbax writes into `<it>.orbax-checkpoint-tmp` first, which
        # a checkpoint's name of 234 bytes or more would take past a file name's 255.
        written = os.path.join(private, _INSIDE)
        yield written
        check_not_abandoned(abandoned)
        _published_everywhere(caller, written, path)
    finally:
        if jax.process_index() == 0:
            _remove(private)


_UNREADABLE = (
    "{caller}: `{path}` has {chars} in it, which Orbax cannot read back ({why}): a "
    "checkpoint there is written whole and can never be restored, so nothing was "
    "{done}. Use a path without them, e.g. `{example}`{move}."
)
_WHY = {
    "[": "it globs its paths", "]": "it globs its paths",
    "\\": "TensorStore reads a backslash as a directory separator",
}  # fmt: skip


_NOT_UTF8 = (
    "{caller}: the path {path!r} is not valid UTF-8: it holds {bad}, bytes that are not "
    "UTF-8 text (Python keeps each as a `\\udc..` escape). Orbax and TensorStore take a "
    "path only as UTF-8 text (Orbax failed with `RuntimeError: Unable to cast Python "
    "instance of type <class 'str'>` once it had made the directory), so nothing was "
    "{done}. Use a UTF-8 name, e.g. {example!r}{move}."
)


def _check_utf8(caller: str, path: str, restoring: bool) -> None:
    """`path` is UTF-8 text: a name of other bytes (`os.fsdecode(b"ckpt\\xff")`) is
    refused before anything is made on disk."""
    bad = [c for c in path if 0xD800 <= ord(c) <= 0xDFFF]
    if not bad:
        return
    raise ValueError(
        _NOT_UTF8.format(
            caller=caller,
            path=path,
            bad=_listed([repr(c) for c in dict.fromkeys(bad)]),
            done="read" if restoring else "written",
            example="".join("_" if c in bad else c for c in path),
            move=" (rename the directory, then restore it)" if restoring else "",
        )
    )


def _listed(items: list[str]) -> str:
    """`a`, `a and b`, `a, b and c`."""
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def check_readable_path(caller: str, path: str, restoring: bool = False) -> None:
    """`path` has no `[`, `]` or `\\`: Orbax globs its paths, and TensorStore reads a
    backslash as a separator, so with any of them in any part of a path a checkpoint
    saves and never restores (`run [1]`, `lr[1e-3]`, `back\\slash`; `*` and `?`
    restore); and it is UTF-8 text. A save refuses it before writing (before making its
    parent); a restore says why it cannot read it."""
    _check_utf8(caller, path, restoring)
    found = [c for c in _WHY if c in path]
    if not found:
        return
    example = path.replace("[", "-").replace("]", "").replace(" ", "_").replace("\\", "_")
    raise ValueError(
        _UNREADABLE.format(
            caller=caller,
            path=path,
            chars=_listed([f"`{c}`" for c in found]),
            why="; ".join(dict.fromkeys(_WHY[c] for c in found)),
            done="read" if restoring else "written",
            example=example,
            move=" (move the directory there, then restore it)" if restoring else "",
        )
    )
