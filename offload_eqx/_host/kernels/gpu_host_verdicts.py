"""The GPU-host proofs' verdicts, kept between processes in one file of this user's cache.

A verdict says whether a compile may call our kernel (`gpu_host`): it is read only from a
regular file that no one else can write, in a folder that no one else can write, and
never opened before that is known (a pipe at its path would block the open: a FIFO put
there would hang the first h100 compile). A file too large, damaged or nested too deeply
to parse is no verdict: the proof is made again and the file replaced. It is written as
a temporary file of its own in the same folder (a unique name per process and write),
removed on every failure (a full disk, a folder in the way), and renamed over the old
one only once whole. Where it cannot be kept, `write` says why, and `ox.host_kernels()`
reports it: each process then proves the kernel again (a few seconds).
"""

import json
import os
import stat
import tempfile
from pathlib import Path

NAME = "gpu_host_kernels.json"
SIZE_LIMIT = 1 << 20  # a verdict is a few hundred bytes; a larger file is not ours


def verdict_file() -> Path | None:
    """`$XDG_CACHE_HOME/offload_eqx/gpu_host_kernels.json`, else `~/.cache/offload_eqx/...`;
    None where neither is an absolute path. A relative `XDG_CACHE_HOME` is ignored, as
    the XDG Base Directory specification says (it would write into the working
    directory)."""
    root = os.environ.get("XDG_CACHE_HOME", "")
    if not os.path.isabs(root):
        root = os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "offload_eqx" / NAME if os.path.isabs(root) else None


def _private(info: os.stat_result) -> bool:
    return info.st_uid == os.getuid() and not info.st_mode & (stat.S_IWGRP | stat.S_IWOTH)


def _private_folder(folder: Path) -> bool:
    info = os.stat(folder)
    return stat.S_ISDIR(info.st_mode) and _private(info)


def _readable(info: os.stat_result) -> bool:
    """A regular file of this user's alone, of a verdict file's size."""
    return stat.S_ISREG(info.st_mode) and _private(info) and info.st_size <= SIZE_LIMIT


def read() -> dict:
    """The kept verdicts: {} where the file is missing, is not a regular file (a link, a
    pipe, a folder: never opened), others may write it or its folder, or it is too large
    or does not parse as one JSON record (a damaged file, replaced by the next `write`)."""
    path = verdict_file()
    try:
        if path is None or not _private_folder(path.parent) or not _readable(os.lstat(path)):
            return {}
        # Checked again on the open file: the path may have been swapped since the lstat.
        descriptor = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        with os.fdopen(descriptor, "rb") as file:
            if not _readable(os.fstat(file.fileno())):
                return {}
            text = file.read(SIZE_LIMIT + 1)
        found = json.loads(text) if len(text) <= SIZE_LIMIT else None
    except (OSError, ValueError, RecursionError):  # RecursionError: nested too deeply
        return {}
    return found if isinstance(found, dict) else {}


def _in_the_way(path: Path) -> str | None:
    """Why `path` is not to be replaced: anything but a regular file (or nothing) there
    was put there by someone, and is left for them."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return None
    if stat.S_ISREG(info.st_mode):
        return None
    kind = "a folder" if stat.S_ISDIR(info.st_mode) else "a link, a pipe or a device"
    return f"{path} is {kind}, not a file: remove it to keep verdicts between processes"


def _write_whole(descriptor: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(descriptor, view) :]


def _replace(path: Path, data: bytes) -> None:
    """Write `data` to a new temporary file beside `path` and rename it over `path`; the
    temporary file is removed if anything fails."""
    descriptor, temporary = tempfile.mkstemp(
        prefix=f".{path.name}.", suffix=".tmp", dir=path.parent
    )
    try:
        try:
            _write_whole(descriptor, data)
        finally:
            os.close(descriptor)
        os.replace(temporary, path)
    except BaseException:
        try:
            os.unlink(temporary)
        except OSError:
            pass
        raise


def write(key: str, verdict: dict) -> str | None:
    """Keep `verdict` under `key` beside the verdicts already kept: None once kept, else
    why it could not be (the next process proves the kernel again)."""
    path = verdict_file()
    if path is None:
        return "no cache folder: XDG_CACHE_HOME is not an absolute path and HOME is not set"
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        if not _private_folder(path.parent):
            return f"{path.parent} may be written by others than you (make it yours, 0700)"
        in_the_way = _in_the_way(path)
        if in_the_way is not None:
            return in_the_way
        found = read()
        found[key] = verdict
        _replace(path, json.dumps(found, indent=1).encode())
    except OSError as error:
        return f"{path} could not be written ({error.strerror or error})"
    return None
