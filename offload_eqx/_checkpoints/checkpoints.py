"""Saving and restoring state straight into its planned memory, never whole on the device.

State that does not fit the device (a 13B model's Adam state, in host memory) must be
restored without passing through it. Every restore asks the plan where each leaf goes
(`ox.abstract`): `ox.tree_deserialise_leaves` reads an `eqx.tree_serialise_leaves` file
leaf by leaf into each leaf's planned sharding; `ox.restore_checkpoint` gives Orbax the
planned shardings as its restore target (Orbax does the I/O, `ox.save_checkpoint` too).
Both compare what is stored with `like` first and name the first leaf that differs, and
type each restored array by its memory (`reads`). A save refuses what could not be
restored before writing anything, writes privately and renames (`private_directory`),
each write in a thread of its own, whose writers have all stopped before an error or an
interrupt reaches the caller (`writers`): a checkpoint is complete or absent. Orbax
keeps no checksum: `ox.save_checkpoint` writes one for each array beside Orbax's files,
and `ox.restore_checkpoint` checks it (`checksums`). A path that is no
complete checkpoint, or one that is damaged, is an error naming it and the complete
checkpoints beside it.
"""

import os
import threading
from concurrent.futures import Future
from typing import Any

import equinox as eqx
import jax

from .._arrays.place import abstract, check_not_deleted
from .._declare.strategy import Strategy
from .._plan.walk import is_array_leaf
from .._sharding.mesh import AnyMesh
from .checks import check_absent, check_complete, check_savable, check_unique_names
from .checksums import verify_checksums, write_checksums
from .equinox_files import tree_deserialise_leaves
from .private_directory import check_not_abandoned, check_readable_path, private_checkpoint
from .reads import (
    check_stored,
    completed,
    opened_checkpointer,
    orbax_target,
    records_for,
    restored_from,
)
from .writers import in_background, orbax_write, raise_named, write_to_the_end

__all__ = ["restore_checkpoint", "save_checkpoint", "tree_deserialise_leaves"]

_SAVE_OUTPUTS = (
    "Nothing of the checkpoint `{path}` was written. Save the step's outputs, which "
    "replace the donated inputs: after `model, opt_state, loss = step(model, opt_state, "
    "x)`, `ox.save_checkpoint(path, (model, opt_state))`."
)
_NO_ORBAX = (
    "{caller} needs Orbax (`orbax-checkpoint`), which is not installed. Install the "
    "extra: `pip install 'offload_eqx[checkpoint]'`."
)


def _orbax(caller: str) -> Any:
    try:
        import orbax.checkpoint as ocp
    except ImportError:
        raise ImportError(_NO_ORBAX.format(caller=caller)) from None
    return ocp


def _save(caller: str, ocp: Any, path: str, tree: Any, checkpointer: Any) -> None:
    """Every write of the save in a thread of its own (`write_to_the_end`), into a
    private directory renamed to `path` once complete; an error, once every writer has
    stopped and nothing is left, as `raise_named` names it."""
    arrays = eqx.filter(tree, eqx.is_array)

    def write(abandoned: threading.Event) -> None:
        with private_checkpoint(caller, path, abandoned) as written:
            check_not_abandoned(abandoned)
            orbax_write(ocp, written, arrays, checkpointer)
            check_not_abandoned(abandoned)
            if jax.process_index() == 0:
                write_checksums(written, arrays)

    try:
        write_to_the_end(write)
    except Exception as error:
        raise_named(caller, path, tree, error)
        raise


def save_checkpoint(
    path: Any, tree: Any, *, checkpointer: Any = None, wait: bool = True
) -> "Future[None] | None":
    """Save the arrays of `tree` (a model, an optimizer state, a tuple of them) with
    Orbax, wherever they live; waits until the checkpoint is written (or, with
    `wait=False`, until the arrays are copied).

    **Arguments:**

    - `path`: the checkpoint's directory, which must not exist yet; resolved as the
        operating system resolves it (`os.path.realpath`: a `..` after a symbolic link
        leaves the link's target). Its parent is made when missing.
    - `tree`: the state. Its arrays are saved: JAX and NumPy arrays and scalars of
        numbers and booleans (bfloat16, int4 and float8 too), typed keys
        (`jax.random.key`, restored as keys of the same implementation) and arrays
        without elements (recorded beside Orbax's files, which refuse them). Other
        leaves (Python numbers, None, functions) are not saved: `restore_checkpoint`
        takes them from `like`.
    - `checkpointer`: by default an `orbax.checkpoint.StandardCheckpointer`, closed when
        the save ends (or fails: its threads would keep the process alive). One you pass
        is used and left open.
    - `wait`: with `False`, the save copies every array into host memory (device arrays
        to `pinned_host`: no device memory is taken; host arrays within host memory, so
        the state needs room for a second copy there), returns once the copies are made,
        and writes them in a thread of its own. A step may then donate `tree` at once:
        this is how to checkpoint while training goes on. It returns a
        `concurrent.futures.Future`, whose `.result()` waits for the checkpoint and
        raises what the save raised; the process does not exit before the save ends.
        Not in a run of several processes.

    A checkpoint is complete or absent. The save writes into a directory of its own
    beside `path` (`<name>.offload_eqx-tmp-<random>`), and renames the finished
    checkpoint to `path` in one step; a save that fails, for any reason, removes it and
    leaves nothing. Every write runs in a thread of its own, and the error (or a Ctrl-C,
    or `sys.exit` from a SIGTERM handler, while the save runs) reaches the caller once
    every writer of Orbax and TensorStore has stopped and the directory is removed: a
    Ctrl-C waits for the writes already under way. Of two saves racing for one path (two
    threads, two processes), the first to finish wins and its checkpoint is kept whole;
    the other raises `FileExistsError` naming the path and leaves nothing.

    Beside Orbax's files the checkpoint gets `offload_eqx_checksums.json`: each array's
    shape, dtype and CRC32, which `restore_checkpoint` checks. Each array is copied to
    host memory to be hashed, one at a time (never to the device). In a run of several
    processes the first process writes it, and an array spread over the devices of
    several processes has no checksum.

    **Returns:** None; with `wait=False`, the `Future` of the save.

    **Raises:**

    - Before anything is written: `ValueError` naming the first leaf that cannot be
        saved: deleted (donated to a step), abstract (a `jax.ShapeDtypeStruct`: no
        values), traced, a NumPy array of strings or objects, or (in a run of several
        processes) an array on one process's devices only; `ValueError` naming `path`
        when Orbax could not read it back (`[`, `]`, `\\`, or bytes that are not UTF-8);
        `FileExistsError` when `path` exists; `NotADirectoryError` or
        `PermissionError` when its directory cannot be made.
    - Once nothing is left: `FileExistsError` naming `path` when another save finished
        it first; `OSError` naming `path` and what to do, with the error chained, when
        the disk is full (`errno.ENOSPC`, or `EDQUOT`: Orbax's own errors were a bare
        `OSError` or TensorStore's `ValueError`) or the process has too many open files
        (`EMFILE`); `ValueError` naming the first leaf deleted while the save read it (a
        step in another thread donated it).
    """
    caller = "ox.save_checkpoint"
    check_not_deleted(tree, "tree", caller, _SAVE_OUTPUTS.format(path=os.fspath(path)))
    check_savable(caller, tree)
    check_unique_names(caller, eqx.filter(tree, eqx.is_array))
    ocp = _orbax(caller)
    path = os.path.realpath(os.fsdecode(path))
    check_readable_path(caller, path)
    check_absent(caller, path)
    if not wait:
        return in_background(
            caller, tree, lambda copy: _save(caller, ocp, path, copy, checkpointer)
        )
    _save(caller, ocp, path, tree, checkpointer)
    return None


def restore_checkpoint(
    path: Any,
    like: Any,
    strategy: "str | Strategy | None" = None,
    *,
    mesh: AnyMesh | None = None,
    checkpointer: Any = None,
    verify: bool = True,
) -> Any:
    """Restore an Orbax checkpoint of `like`'s arrays straight into planned memory.

    **Arguments:**

    - `path`: the checkpoint `ox.save_checkpoint` (or Orbax's `StandardCheckpointer`,
        given the arrays of the tree) wrote, resolved as the operating system resolves it
        (`os.path.realpath`).
    - `like`: the tree it was saved from, arrays or `jax.ShapeDtypeStruct`s
        (`eqx.filter_eval_shape`); its non-array leaves are kept.
    - `strategy`, `mesh`: where each leaf goes, as `ox.abstract(like, strategy,
        mesh=mesh)` says: host-resident leaves are read into host memory, sharded leaves
        into their shards, on one device or a mesh (Orbax records no memory kinds, so the
        target carries them).
    - `checkpointer`: by default an `orbax.checkpoint.StandardCheckpointer`, closed when
        the restore ends. One you pass is used and left open.
    - `verify`: check each restored array against the checksum `ox.save_checkpoint`
        wrote (`offload_eqx_checksums.json`; Orbax keeps none, and a changed byte of a
        data file restores as other numbers). Each array is copied to host memory once to
        be hashed, where it lives; `verify=False` skips this. A checkpoint without the
        file (written by Orbax directly) is restored without verification, and so is an
        array that this process does not hold whole (spread over several processes).
        The shapes and dtypes compared with `like` come from this file and Orbax's
        `_METADATA` (the names of the arrays stored), also with `verify=False` when the
        file can be read: Orbax's own metadata, which opens every array, is read only
        for a checkpoint without them.

    **Returns:** a tree like `like`, its arrays read from the checkpoint into planned
    memory (and shards), each typed by its memory (`f32<host>[...]` in `pinned_host`:
    Orbax types a single-device array in `pinned_host` as device memory, which a step
    would then compile it as). Typed keys come back as keys; an array without elements
    is made where the plan puts it. A NumPy array of `like` whose dtype JAX does not hold
    (float64 while `jax_enable_x64` is off) comes back as the NumPy array it was saved
    as, not cut down to a JAX array of another dtype.

    **Raises:**

    - `FileNotFoundError` when `path` does not exist (saying when only an interrupted
        save's temporary directory does), and `ValueError` when it is not a complete
        checkpoint (no `_METADATA`) or its metadata is damaged; each names the complete
        checkpoints beside it. All before anything is read.
    - `ValueError` naming the first leaf of `like` that the checkpoint lacks or stores
        with another shape or dtype, before anything is read.
    - `ValueError` naming the checkpoint and the leaf when a data file cannot be read
        (truncated or missing: the checkpoint is damaged), or when an array differs from
        its checksum; naming the checkpoint and the file when `manifest.ocdbt`,
        `_METADATA` or the checksum file cannot be read.
    """
    caller = "ox.restore_checkpoint"
    ocp = _orbax(caller)
    path = os.path.realpath(os.fsdecode(path))
    check_complete(caller, path)
    check_readable_path(caller, path, restoring=True)
    planned = eqx.filter(abstract(like, strategy, mesh=mesh), is_array_leaf)
    records = records_for(caller, path, verify)
    with opened_checkpointer(ocp, checkpointer) as opened:
        check_stored(caller, path, opened, planned, records)
        restored = restored_from(caller, path, opened, orbax_target(planned, like))
    restored = completed(planned, restored, like)
    if verify and records is not None:
        verify_checksums(caller, path, restored, records)
    return eqx.combine(restored, eqx.filter(like, is_array_leaf, inverse=True))
