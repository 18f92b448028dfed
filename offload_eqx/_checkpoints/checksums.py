"""The record `ox.save_checkpoint` writes beside Orbax's files, and
`ox.restore_checkpoint` verifies: each array's shape, dtype and CRC32.

Orbax keeps no checksum: a changed byte of a data file restores as other numbers. The
record is read only from a regular file (or a link to one) of bounded size, checked
before a byte of it is read, and every entry is validated: a damaged record names the
checkpoint, the file and the leaf.
"""

import json
import os
import stat
import zlib
from typing import Any

import jax
import numpy as np

from .._plan.walk import format_path
from .checks import describe, has_elements, is_key, key_of, load_json

CHECKSUMS = "offload_eqx_checksums.json"
_CHECKSUM_DIFFERS = (
    "{caller}: `{leaf}` as read from `{path}` differs from what `ox.save_checkpoint` "
    "wrote: it is {got}, where `{file}` records {saved}. The checkpoint is damaged (a data "
    "file changed after it was written; Orbax keeps no checksum). Restore an earlier "
    "checkpoint, or pass `verify=False` to restore these values anyway."
)
_CHECKSUMS_DAMAGED = (
    "{caller}: `{file}` in `{path}` cannot be read ({cause}): the checkpoint is damaged. "
    "Pass `verify=False` to restore it without checking its arrays."
)
_CHECKSUMS_UNREAD = (
    "{caller}: `{file}` in `{path}` is {what}, not a checksum file `ox.save_checkpoint` "
    "writes: the checkpoint is damaged or not one of ours, and it was not read. Pass "
    "`verify=False` to restore it without checking its arrays."
)
_CHECKSUM_ENTRY = (
    "{caller}: `{file}` in `{path}` is damaged: its entry for `{leaf}` has {field} "
    "{value!r}; expected {expected}. Pass `verify=False` to restore it without checking "
    "its arrays."
)
# The largest checksum file read: about 200 bytes a leaf, so a million leaves.
CHECKSUMS_LIMIT = 256 * 2**20


def _crc32(value: np.ndarray) -> int:
    return zlib.crc32(np.ascontiguousarray(value).reshape(-1).view(np.uint8).data)


def _hashable(leaf: Any) -> bool:
    """Whether this process holds all of the array (not so for one spread over the
    devices of several processes); an array without elements has nothing to hold."""
    if not has_elements(leaf):
        return True
    return not isinstance(leaf, jax.Array) or leaf.is_fully_addressable


def _checksum(leaf: Any) -> int:
    """The CRC32 of an array's bytes (a key array's key data); read into host memory
    (a copy there: nothing moves to the device), one array at a time."""
    if not has_elements(leaf):
        return 0  # what `zlib.crc32(b"")` gives, without reading anything
    if is_key(leaf.dtype):
        leaf = jax.random.key_data(leaf)
    return _crc32(np.asarray(leaf))


def write_checksums(path: str, arrays: Any) -> None:
    """Beside Orbax's files, once it has finished: each array's shape, dtype and CRC32
    of its bytes (C order), by leaf path; an array without elements, which Orbax does
    not store, is recorded here only. Written to a temporary name and renamed, so a
    checksum file is whole or absent."""
    leaves = {}
    for keys, leaf in jax.tree_util.tree_flatten_with_path(arrays)[0]:
        if not _hashable(leaf):
            continue
        leaves[jax.tree_util.keystr(keys)] = {
            "keys": [key_of(k) for k in keys],
            "shape": list(np.shape(leaf)),
            "dtype": str(leaf.dtype),
            "crc32": _checksum(leaf),
        }
    document = {"format": 1, "checksum": "crc32 of the array's bytes in C order", "leaves": leaves}
    written = os.path.join(path, CHECKSUMS + ".tmp")
    with open(written, "w") as file:
        json.dump(document, file, indent=1)
    os.replace(written, os.path.join(path, CHECKSUMS))


def read_checksums(caller: str, path: str) -> dict[tuple[str, ...], Any] | None:
    """The checksums `ox.save_checkpoint` wrote, by key path; None when there are none
    (a checkpoint that Orbax wrote)."""
    file = os.path.join(path, CHECKSUMS)
    if not os.path.lexists(file):
        return None
    _check_readable(caller, path, file)
    try:
        with open(file, "rb") as opened:
            text = opened.read(CHECKSUMS_LIMIT + 1)  # bounded: it may grow after the stat
        if len(text) > CHECKSUMS_LIMIT:
            raise ValueError(f"it is larger than {CHECKSUMS_LIMIT // 2**20} MiB")
        leaves = load_json(text)["leaves"]
        entries = [_checked_entry(caller, path, name, leaf) for name, leaf in leaves.items()]
        return {tuple(leaf["keys"]): leaf for leaf in entries}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        if isinstance(error, ValueError) and str(error).startswith(caller):
            raise
        raise ValueError(
            _CHECKSUMS_DAMAGED.format(
                caller=caller, file=CHECKSUMS, path=path, cause=f"{type(error).__name__}: {error}"
            )
        ) from error


def _check_readable(caller: str, path: str, file: str) -> None:
    """The checksum file is, or links to, a regular file (deduplicating tools link a
    checkpoint's files to one copy) of at most `CHECKSUMS_LIMIT` bytes, by its `stat`
    before a byte is read: a device (`/dev/zero`) or a pipe would be read forever or
    block, and a larger file was refused only once `CHECKSUMS_LIMIT` bytes were read."""
    what = None
    link = f" (a symbolic link to `{os.readlink(file)}`)" if os.path.islink(file) else ""
    try:
        found = os.stat(file)
        if not stat.S_ISREG(found.st_mode):
            what = f"not a regular file (a device, a pipe or a directory){link}"
        elif found.st_size > CHECKSUMS_LIMIT:
            size = f"{found.st_size:,} bytes"
            what = f"{size}, larger than {CHECKSUMS_LIMIT // 2**20} MiB{link}"
    except OSError as error:
        what = f"unreadable ({error.strerror}){link}"
    if what is not None:
        message = _CHECKSUMS_UNREAD.format(caller=caller, file=CHECKSUMS, path=path, what=what)
        raise ValueError(message)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _checked_entry(caller: str, path: str, name: str, leaf: Any) -> dict:
    """One entry of the checksum file, every field of the type `write_checksums` gives it;
    else a `ValueError` naming the file, the leaf and the field."""
    fields = (
        ("keys", lambda v: isinstance(v, list) and all(isinstance(k, str) for k in v),
         "a list of keys (strings)"),
        ("shape", lambda v: isinstance(v, list) and all(_is_int(d) and d >= 0 for d in v),
         "a list of sizes (integers of 0 or more)"),
        ("dtype", lambda v: isinstance(v, str) and bool(v), "a dtype's name"),
        ("crc32", lambda v: _is_int(v) and 0 <= v < 2**32, "a CRC32 (an integer below 2**32)"),
    )  # fmt: skip
    if not isinstance(leaf, dict):
        raise ValueError(
            _CHECKSUM_ENTRY.format(
                caller=caller, file=CHECKSUMS, path=path, leaf=name, field="the value",
                value=leaf, expected="a record of keys, shape, dtype and crc32",
            )
        )  # fmt: skip
    for field, valid, expected in fields:
        value = leaf.get(field, "<missing>")
        if field not in leaf or not valid(value):
            raise ValueError(
                _CHECKSUM_ENTRY.format(
                    caller=caller, file=CHECKSUMS, path=path, leaf=name, field=f"`{field}`",
                    value=value, expected=expected,
                )
            )  # fmt: skip
    return leaf


def verify_checksums(caller: str, path: str, restored: Any, checksums: dict) -> None:
    """Each restored array that this process holds whole has the bytes it was saved with;
    else a `ValueError` naming the first that differs."""
    for keys, leaf in jax.tree_util.tree_flatten_with_path(restored)[0]:
        saved = checksums.get(tuple(key_of(k) for k in keys))
        if saved is None or not _hashable(leaf):
            continue
        crc32 = _checksum(leaf)  # host memory stays in host memory
        got = (list(np.shape(leaf)), str(leaf.dtype), crc32)
        if got != (saved["shape"], saved["dtype"], saved["crc32"]):
            raise ValueError(
                _CHECKSUM_DIFFERS.format(
                    caller=caller,
                    leaf=format_path("like", keys),
                    path=path,
                    got=f"{describe(np.shape(leaf), leaf.dtype)} with CRC32 {crc32:#010x}",
                    file=CHECKSUMS,
                    saved=f"{saved['dtype']}{saved['shape']} with CRC32 {saved['crc32']:#010x}",
                )
            )
