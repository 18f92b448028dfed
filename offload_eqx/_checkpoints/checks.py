"""What a checkpoint holds, checked: complete, undamaged, the leaves `like` expects.

A save writes its checkpoint into a private temporary directory, renamed into place once
complete (`private_directory`). Here: what can be saved (checked before anything is
written), the name of a save's temporary directory, whether a path is a complete
checkpoint (else which ones beside it are), the JSON files of a checkpoint parsed as
damaged when they cannot be, and the messages that name the first leaf a stored tree and
`like` disagree on.
"""

import hashlib
import json
import os
import re
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
_DIGEST = 16  # hex digits of a long name's SHA-256 in its temporary directory's name


def private_prefix(name: str) -> str:
    """How the name of a save's temporary directory for checkpoint `name` starts: `name`
    and `PRIVATE`. A name longer than 230 bytes does not fit a file name's 255 with them:
    it is cut at a character and followed by `~` and a digest of it whole, so two long
    names sharing their first bytes never take each other's temporary directory for their
    own (cut alone, a never-saved name reported another's leftover as its own)."""
    raw = os.fsencode(name)
    if len(raw) <= _ROOM:
        return name + PRIVATE
    cut = raw[: _ROOM - _DIGEST - 1].decode(errors="ignore")
    return f"{cut}~{hashlib.sha256(raw).hexdigest()[:_DIGEST]}{PRIVATE}"


def load_json(text: bytes | str) -> Any:
    """`json.loads`, where a document nested too deeply for Python's parser (`[[[...]]]`,
    a `RecursionError`) is a `ValueError` like any other damage."""
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError("it is nested too deeply to be parsed") from None


TREE_METADATA = "_METADATA"
MANIFEST = "manifest.ocdbt"  # where each array's bytes are in the data files
READ_FAILED = "Encountered error while reading array index"  # Orbax's words
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
FILE_DAMAGED = (
    "{caller}: `{path}` is damaged: its `{file}` ({what}) cannot be read ({cause}): it "
    "is not as Orbax wrote it (a full disk, a copy cut short, a changed file). {complete}"
)
DATA_DAMAGED = (
    "{caller}: `{path}` is damaged: reading {leaf} from it failed ({cause}). A data file "
    "is shorter than Orbax wrote it, missing or changed (a full disk, a copy cut short). "
    "{complete}"
)
_SAME_NAME = (
    "{caller}: `{first}` and `{second}` would be stored under one name, `{name}` (Orbax "
    "names each array by its keys joined with dots), and the second would overwrite the "
    "first; nothing was written. Rename one of them, say the key `{key}` (or save the "
    "two trees apart)."
)
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
