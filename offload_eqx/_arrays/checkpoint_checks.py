"""What a checkpoint holds, checked: complete, undamaged, the leaves `like` expects.

A save writes its checkpoint into a private temporary directory, renamed into place once
complete (`checkpoint_writes`), and Orbax keeps no checksum. Here: what can be saved
(checked before anything is written), whether a path is a complete checkpoint (else which
ones beside it are), the record `ox.save_checkpoint` writes beside Orbax's files (each
array's shape, dtype and checksum) and `ox.restore_checkpoint` verifies, and the messages
that name the first leaf a stored tree and `like` disagree on.
"""

import json
import os
import re
import stat
import zlib
from typing import Any

import jax
import numpy as np
from jax.core import Tracer

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
# An Orbax checkpoint: Orbax's own save writes into `<name>.orbax-checkpoint-tmp-<time>`,
# `ox.save_checkpoint` into `<name>.offload_eqx-tmp-<random>/checkpoint`; each is renamed to
# `<name>` once complete. `_METADATA` (each leaf's shape and dtype) follows the arrays.
PRIVATE = ".offload_eqx-tmp-"
_UNFINISHED = (".orbax-checkpoint-tmp", PRIVATE)
_ROOM = 255 - len(PRIVATE) - 8  # a file name's bytes, less ours and `mkdtemp`'s 8


def private_prefix(name: str) -> str:
    """How the name of a save's temporary directory for checkpoint `name` starts: `name`,
    cut at a character to fit a file name's 255 bytes from 231, then `PRIVATE`."""
    return name.encode()[:_ROOM].decode(errors="ignore") + PRIVATE


TREE_METADATA = "_METADATA"
READ_FAILED = "Encountered error while reading array index"  # Orbax's words
CHECKSUMS = "offload_eqx_checksums.json"
_NOT_THERE = "{caller}: `{path}` does not exist{why}. {complete}"
_INTERRUPTED = (
    "; only `{unfinished}` does, the temporary directory a save leaves when it is "
    "interrupted (the process was killed) before the checkpoint is complete: it cannot be "
    "restored (delete it when no save is running)"
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
_SAME_NAME = (
    "{caller}: `{first}` and `{second}` would be stored under one name, `{name}` (Orbax "
    "names each array by its keys joined with dots), and the second would overwrite the "
    "first; nothing was written. Rename one of them, say the key `{key}` (or save the "
    "two trees apart)."
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
_ABSTRACT_LEAF = (
    "{caller}: `{path}` is {value}, an abstract array with a shape and a dtype but no "
    "values (what `eqx.filter_eval_shape` and `jax.eval_shape` give): there is nothing to "
    "save, and nothing was written. Save the arrays themselves: build the state "
    "(`Model(key)`, `opt.init(model)`) or restore it, then save it."
)
_TRACED_LEAF = (
    "{caller}: `{path}` is a traced value ({value}): the save was called inside a "
    "transformed function (`jax.jit`, `ox.filter_jit`, `jax.grad`, ...), where arrays have "
    "no values yet, and nothing was written. Save outside it: the step's outputs, once it "
    "has returned."
)
_NOT_NUMBERS = (
    "{caller}: `{path}` is a NumPy array of {dtype} elements, and nothing was written: a "
    "checkpoint holds arrays of numbers, booleans and `jax.random.key`s (TensorStore "
    "stores no {dtype}). Keep it out of the saved tree (mark its field "
    "`eqx.field(static=True)`, or save `eqx.filter(tree, eqx.is_array)` with this leaf "
    "replaced by None), or convert it to numbers."
)
_LOCAL_ONLY = (
    "{caller}: `{path}` lives on this process's devices only ({sharding}), and nothing "
    "was written: in a run of several processes a checkpoint is written from all of "
    "them, and holds arrays over the mesh they share. Put it on the mesh first "
    "(`ox.place(tree, mesh=mesh)`, or `ox.shard(x, P(), mesh)` to replicate it)."
)
_NO_LEAVES = (
    "{caller}: `tree` is {tree!r}, which holds no leaves at all: there is nothing to save "
    "(Orbax refuses an empty tree), and nothing was written. Pass the state to save."
)
_EXISTS = (
    "{caller}: `{path}` exists already ({what}), and nothing was written: a checkpoint "
    "is written whole into a new directory, never over or into another. Save to a new "
    "path (e.g. `step_<n>` for each step), or delete `{path}` first."
)
_COMPLETE = "Complete checkpoints in `{parent}`: {names}; pass the path of one, e.g. `{example}`."
_NONE_COMPLETE = "Complete checkpoints in `{parent}`: none."


def is_key(dtype: Any) -> bool:
    """Whether `dtype` is a typed key's (`jax.random.key`), stored as its key data."""
    return jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def has_elements(leaf: Any) -> bool:
    """Whether an array holds any element: Orbax refuses to save one that does not."""
    return int(np.prod(np.shape(leaf), dtype=np.int64)) > 0


def _storable(dtype: Any) -> bool:
    """Whether TensorStore stores arrays of `dtype`: numbers, booleans, the ml_dtypes
    types (bfloat16, int4, float8) and keys (their key data)."""
    if jax.dtypes.issubdtype(dtype, jax.dtypes.extended):
        return is_key(dtype)
    dtype = np.dtype(dtype)
    return dtype.kind in "biufc" or dtype.type.__module__ == "ml_dtypes"


def check_savable(caller: str, tree: Any) -> None:
    """Every leaf of `tree` that Orbax would be given has values it can store; else a
    `ValueError` naming the first that has not, before anything is written (Orbax saved
    an abstract tree as no arrays at all, and failed on a string array half-way)."""
    leaves = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: x is None)[0]
    if tree is None or not leaves:
        raise ValueError(_NO_LEAVES.format(caller=caller, tree=tree))
    for keys, leaf in leaves:
        path = format_path("tree", keys)
        if isinstance(leaf, jax.ShapeDtypeStruct):
            raise ValueError(_ABSTRACT_LEAF.format(caller=caller, path=path, value=leaf))
        if isinstance(leaf, Tracer):
            value = jax.typeof(leaf).str_short()
            raise ValueError(_TRACED_LEAF.format(caller=caller, path=path, value=value))
        if isinstance(leaf, (np.ndarray, np.generic)) and not _storable(leaf.dtype):
            raise ValueError(_NOT_NUMBERS.format(caller=caller, path=path, dtype=leaf.dtype))
        if isinstance(leaf, jax.Array) and _local_only(leaf):
            raise ValueError(_LOCAL_ONLY.format(caller=caller, path=path, sharding=leaf.sharding))


def check_unique_names(caller: str, tree: Any) -> None:
    """No two leaves of `tree` get one name in Orbax's files (`{'a.b': x, 'a': {'b':
    y}}`, a field `encoder` beside a key `'encoder.w1'`); else a `ValueError` naming
    both, before anything is written (Orbax stored both under one name)."""
    seen: dict[str, str] = {}
    for keys, _ in jax.tree_util.tree_flatten_with_path(tree)[0]:
        name = ".".join(key_of(k) for k in keys)
        path = format_path("tree", keys)
        if name in seen:
            key = next((key_of(k) for k in keys if "." in key_of(k)), key_of(keys[-1]))
            raise ValueError(
                _SAME_NAME.format(caller=caller, first=seen[name], second=path, name=name, key=key)
            )
        seen[name] = path


def _local_only(leaf: jax.Array) -> bool:
    """Whether, in a run of several processes, an array lives on this process's devices
    only: Orbax writes one checkpoint from all processes and refuses it half-way."""
    return jax.process_count() > 1 and has_elements(leaf) and leaf.is_fully_addressable


def check_absent(caller: str, path: str) -> None:
    """Nothing is at `path` yet: a save never writes over or into another directory."""
    if os.path.lexists(path):
        what = "a directory" if os.path.isdir(path) else "a file"
        raise FileExistsError(_EXISTS.format(caller=caller, path=path, what=what))


def describe(shape: Any, dtype: Any) -> str:
    try:
        nameless = np.dtype(dtype).type is np.void
    except TypeError:  # a key's dtype (`key<fry>`), which NumPy does not know
        nameless = False
    if nameless:  # what NumPy reads back for bfloat16 and its kin
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


def _temporary(name: str) -> bool:
    """Whether `name` is the temporary directory of a save (Orbax's or ours)."""
    return any(marker in name for marker in _UNFINISHED)


def _is_complete(directory: str) -> bool:
    """Whether a save finished a checkpoint here: renamed from its temporary name, with
    the tree's metadata written (after the arrays)."""
    return not _temporary(os.path.basename(directory)) and os.path.isfile(
        os.path.join(directory, TREE_METADATA)
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
        unfinished = [
            other
            for other in _listed(parent)
            if other.startswith(private_prefix(name))
            or other.startswith(name + ".orbax-checkpoint-tmp")
        ]
        why = _INTERRUPTED.format(unfinished=unfinished[-1]) if unfinished else ""
        raise FileNotFoundError(
            _NOT_THERE.format(caller=caller, path=path, why=why, complete=complete_beside(path))
        )
    if _temporary(os.path.basename(path)):
        reason = "it is the temporary directory of a save that was interrupted"
    elif not os.path.isdir(path):
        reason = "it is a file, not a checkpoint's directory"
    elif not os.path.isfile(os.path.join(path, TREE_METADATA)):
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
            text = opened.read(CHECKSUMS_LIMIT + 1)
        if len(text) > CHECKSUMS_LIMIT:
            raise ValueError(f"it is larger than {CHECKSUMS_LIMIT // 2**20} MiB")
        leaves = json.loads(text)["leaves"]
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
    checkpoint's files to one copy): a device (`/dev/zero`) or a pipe would be read
    forever or block; its size is bounded where it is read (`CHECKSUMS_LIMIT`)."""
    what = None
    link = f" (a symbolic link to `{os.readlink(file)}`)" if os.path.islink(file) else ""
    try:
        if not stat.S_ISREG(os.stat(file).st_mode):
            what = f"not a regular file (a device, a pipe or a directory){link}"
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
