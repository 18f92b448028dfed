"""What a checkpoint holds, checked: complete, undamaged, the leaves `like` expects.

Orbax writes a checkpoint into a temporary directory renamed once complete, and keeps no
checksum. Here: whether a path is a complete checkpoint (else which ones beside it are),
the checksums `ox.save_checkpoint` writes beside Orbax's files and `ox.restore_checkpoint`
verifies, and the messages that name the first leaf a stored tree and `like` disagree on.
"""

import json
import os
import re
import zlib
from typing import Any

import jax
import numpy as np

from .._plan.walk import format_path

DIFFERENT_LEAF = (
    "{caller}: `{path}` is {stored} in the checkpoint but {wanted} in `like`, the first "
    "leaf that differs: the checkpoint was written from another model (or this one at "
    "another size or dtype). Pass as `like` the tree the checkpoint was saved from (its "
    "structure, shapes and dtypes; `eqx.filter_eval_shape` builds one without memory)."
)
MISSING_LEAF = (
    "{caller}: `{path}` is not in the checkpoint{hint}: the checkpoint was "
    "written from another tree. Pass as `like` the tree the checkpoint was saved from."
)
EXTRA_LEAVES = (
    "{caller}: the checkpoint holds {what} that `like` has no place for: it was written "
    "from a larger tree. Pass as `like` the tree the checkpoint was saved from."
)
# An Orbax checkpoint: its save writes into `<name>.orbax-checkpoint-tmp-<time>`, renamed
# to `<name>` once complete; `_METADATA` (each leaf's shape and dtype) follows the arrays.
_UNFINISHED = ".orbax-checkpoint-tmp"
_TREE_METADATA = "_METADATA"
READ_FAILED = "Encountered error while reading array index"  # Orbax's words
CHECKSUMS = "offload_eqx_checksums.json"
_NOT_THERE = "{caller}: `{path}` does not exist{why}. {complete}"
_INTERRUPTED = (
    "; only `{unfinished}` does, which Orbax leaves when a save is interrupted (the "
    "process was killed, or the save failed) before the checkpoint is complete: it cannot "
    "be restored (delete it when no save is running)"
)
_INCOMPLETE = "{caller}: `{path}` is not a complete Orbax checkpoint: {reason}. {complete}"
_NO_TREE_METADATA = (
    "it has no `_METADATA` (each leaf's shape and dtype, which Orbax writes after the arrays)"
)
_HOLDS = (
    "; it holds the checkpoints of a `CheckpointManager` step's items, {items}: pass "
    "e.g. `{example}`"
)
METADATA_DAMAGED = (
    "{caller}: `{path}` is damaged: Orbax could not read its metadata (`_METADATA`, "
    "`_sharding`, `manifest.ocdbt`, `d/`){cause}. {complete}"
)
DATA_DAMAGED = (
    "{caller}: `{path}` is damaged: reading {leaf} from it failed ({cause}). A data file "
    "is shorter than Orbax wrote it, missing or changed (a full disk, a copy cut short). "
    "{complete}"
)
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
_COMPLETE = "Complete checkpoints in `{parent}`: {names}; pass the path of one, e.g. `{example}`."
_NONE_COMPLETE = "Complete checkpoints in `{parent}`: none."


def describe(shape: Any, dtype: Any) -> str:
    if np.dtype(dtype).type is np.void:  # what NumPy reads back for bfloat16 and its kin
        return (
            f"{dtype}{list(shape)} ({np.dtype(dtype).itemsize} nameless bytes an element, as "
            "NumPy stores bfloat16 and the other ml_dtypes types)"
        )
    return f"{dtype}{list(shape)}"  # float32[3, 16, 32]


def key_of(entry: Any) -> str:
    """A key of a pytree path as Orbax writes it in its metadata (`layers`, `0`)."""
    for name in ("name", "key", "idx"):
        if hasattr(entry, name):
            return str(getattr(entry, name))
    return str(entry)


def _natural(name: str) -> list[Any]:
    """`step_9` before `step_10`."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def _listed(directory: str) -> list[str]:
    try:
        return sorted(os.listdir(directory), key=_natural)
    except OSError:
        return []


def _is_complete(directory: str) -> bool:
    """Whether Orbax finished a checkpoint here: renamed from its temporary name, with the
    tree's metadata written (after the arrays)."""
    return _UNFINISHED not in os.path.basename(directory) and os.path.isfile(
        os.path.join(directory, _TREE_METADATA)
    )


def complete_beside(path: str) -> str:
    """The checkpoints beside `path` that Orbax completed: what to restore instead."""
    parent, name = os.path.split(path)
    if not os.path.isdir(parent):
        return f"Its directory `{parent}` does not exist either: check the path."
    complete = [
        other
        for other in _listed(parent)
        if other != name and _is_complete(os.path.join(parent, other))
    ]
    if not complete:
        return _NONE_COMPLETE.format(parent=parent)
    names = ", ".join(f"`{other}`" for other in complete[-5:])
    if len(complete) > 5:
        names = f"{len(complete)}, the last {names}"
    example = os.path.join(parent, complete[-1])
    return _COMPLETE.format(parent=parent, names=names, example=example)


def check_complete(caller: str, path: str) -> None:
    """`path` is a checkpoint that Orbax finished; else an error saying what is missing
    and which checkpoints beside it are complete (Orbax itself reads no metadata from it
    and fails later with `'NoneType' object has no attribute 'tree'`)."""
    if not os.path.exists(path):
        parent, name = os.path.split(path)
        unfinished = [other for other in _listed(parent) if other.startswith(name + _UNFINISHED)]
        why = _INTERRUPTED.format(unfinished=unfinished[-1]) if unfinished else ""
        raise FileNotFoundError(
            _NOT_THERE.format(caller=caller, path=path, why=why, complete=complete_beside(path))
        )
    if _UNFINISHED in os.path.basename(path):
        reason = "it is the temporary directory of a save that was interrupted"
    elif not os.path.isdir(path):
        reason = "it is a file, not a checkpoint's directory"
    elif not os.path.isfile(os.path.join(path, _TREE_METADATA)):
        reason = _NO_TREE_METADATA
        items = [item for item in _listed(path) if _is_complete(os.path.join(path, item))]
        if items:  # a `CheckpointManager` step holds its items' checkpoints
            example = os.path.join(path, items[0])
            reason += _HOLDS.format(items=", ".join(f"`{item}`" for item in items), example=example)
    else:
        return
    raise ValueError(
        _INCOMPLETE.format(caller=caller, path=path, reason=reason, complete=complete_beside(path))
    )


def _crc32(value: np.ndarray) -> int:
    return zlib.crc32(np.ascontiguousarray(value).reshape(-1).view(np.uint8).data)


def _hashable(leaf: Any) -> bool:
    """Whether this process holds all of the array (not so for one spread over the
    devices of several processes)."""
    return not isinstance(leaf, jax.Array) or leaf.is_fully_addressable


def write_checksums(path: str, arrays: Any) -> None:
    """Beside Orbax's files, once it has finished: each array's shape, dtype and CRC32
    of its bytes (C order), by leaf path. Written to a temporary name and renamed, so a
    checksum file is whole or absent."""
    leaves = {}
    for keys, leaf in jax.tree_util.tree_flatten_with_path(arrays)[0]:
        if not _hashable(leaf):
            continue
        value = np.asarray(leaf)  # a copy in host memory; nothing moves to the device
        leaves[jax.tree_util.keystr(keys)] = {
            "keys": [key_of(k) for k in keys],
            "shape": list(value.shape),
            "dtype": str(value.dtype),
            "crc32": _crc32(value),
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
    if not os.path.exists(file):
        return None
    try:
        with open(file) as opened:
            leaves = json.load(opened)["leaves"].values()
        return {tuple(leaf["keys"]): leaf for leaf in leaves}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        raise ValueError(
            _CHECKSUMS_DAMAGED.format(
                caller=caller, file=CHECKSUMS, path=path, cause=f"{type(error).__name__}: {error}"
            )
        ) from error


def verify_checksums(caller: str, path: str, restored: Any, checksums: dict) -> None:
    """Each restored array that this process holds whole has the bytes it was saved with;
    else a `ValueError` naming the first that differs."""
    for keys, leaf in jax.tree_util.tree_flatten_with_path(restored)[0]:
        saved = checksums.get(tuple(key_of(k) for k in keys))
        if saved is None or not _hashable(leaf):
            continue
        value = np.asarray(leaf)  # host memory stays in host memory
        crc32 = _crc32(value)
        got = (list(value.shape), str(value.dtype), crc32)
        if got != (saved["shape"], saved["dtype"], saved["crc32"]):
            raise ValueError(
                _CHECKSUM_DIFFERS.format(
                    caller=caller,
                    leaf=format_path("like", keys),
                    path=path,
                    got=f"{describe(value.shape, value.dtype)} with CRC32 {crc32:#010x}",
                    file=CHECKSUMS,
                    saved=f"{saved['dtype']}{saved['shape']} with CRC32 {saved['crc32']:#010x}",
                )
            )
