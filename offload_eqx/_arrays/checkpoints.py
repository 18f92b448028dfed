"""Saving and restoring state straight into its planned memory, never whole on the device.

State that does not fit the device (a 13B model's Adam state, in host memory) must be
restored without passing through it. Every restore asks the plan where each leaf goes
(`ox.abstract`): `ox.tree_deserialise_leaves` reads an `eqx.tree_serialise_leaves` file
leaf by leaf into each leaf's planned sharding; `ox.restore_checkpoint` gives Orbax the
planned shardings as its restore target (Orbax does the I/O, `ox.save_checkpoint` too).
Both compare what is stored with `like` first and name the first leaf that differs.
Orbax keeps no checksum: `ox.save_checkpoint` writes one for each array beside Orbax's
files, and `ox.restore_checkpoint` checks it. A path that is no complete checkpoint, or
one that is damaged, is an error naming it and the complete checkpoints beside it.
"""

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import equinox as eqx
import jax

from .._declare.strategy import Strategy
from .._plan.walk import format_path, is_array_leaf
from .._sharding.mesh import AnyMesh
from .checkpoint_checks import (
    DATA_DAMAGED,
    DIFFERENT_LEAF,
    EXTRA_LEAVES,
    METADATA_DAMAGED,
    MISSING_LEAF,
    READ_FAILED,
    check_complete,
    complete_beside,
    describe,
    key_of,
    read_checksums,
    verify_checksums,
    write_checksums,
)
from .checkpoint_files import tree_deserialise_leaves
from .place import abstract, check_not_deleted

__all__ = ["restore_checkpoint", "save_checkpoint", "tree_deserialise_leaves"]

_SAVE_OUTPUTS = (
    "Save the step's outputs, which replace the donated inputs: after `model, opt_state, "
    "loss = step(model, opt_state, x)`, `ox.save_checkpoint(path, (model, opt_state))`."
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


def _by_key(tree: Any) -> dict[tuple[str, ...], Any]:
    leaves = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: hasattr(x, "shape"))[0]
    return {tuple(key_of(k) for k in keys): leaf for keys, leaf in leaves}


def _check_stored(caller: str, stored: Any, target: Any) -> None:
    """`like` (as `target`) and the checkpoint's metadata hold the same leaves, shapes and
    dtypes; else a `ValueError` naming the first leaf of `like` that differs."""
    have = _by_key(stored)
    labelled = jax.tree_util.tree_flatten_with_path(target)[0]
    for keys, leaf in labelled:
        path = format_path("like", keys)
        meta = have.pop(tuple(key_of(k) for k in keys), None)
        if meta is None:
            raise ValueError(MISSING_LEAF.format(caller=caller, path=path, hint=""))
        if tuple(meta.shape) != tuple(leaf.shape) or str(meta.dtype) != str(leaf.dtype):
            raise ValueError(
                DIFFERENT_LEAF.format(
                    caller=caller,
                    path=path,
                    stored=describe(meta.shape, meta.dtype),
                    wanted=describe(leaf.shape, leaf.dtype),
                )
            )
    if have:
        first = "/".join(sorted(have)[0])
        raise ValueError(
            EXTRA_LEAVES.format(caller=caller, what=f"{len(have)} leaves (first: `{first}`)")
        )


def _stored_tree(caller: str, path: str, checkpointer: Any) -> Any:
    """The checkpoint's metadata tree (each leaf's shape and dtype), or a `ValueError`
    saying the checkpoint is damaged: Orbax logs why it could not read it and gives None."""
    try:
        metadata = checkpointer.metadata(path).item_metadata
    except Exception as error:
        cause = f" ({type(error).__name__}: {error})"
        raise ValueError(
            METADATA_DAMAGED.format(
                caller=caller, path=path, cause=cause, complete=complete_beside(path)
            )
        ) from error
    if metadata is None:
        raise ValueError(
            METADATA_DAMAGED.format(
                caller=caller, path=path, cause="", complete=complete_beside(path)
            )
        )
    return metadata.tree


def _failed_leaf(error: BaseException, target: Any) -> str:
    """The leaf whose read failed: Orbax's error quotes the TensorStore spec of the array,
    whose key is the leaf's path joined with dots (`0.layers.w1/`)."""
    text = str(error)
    for keys, _ in jax.tree_util.tree_flatten_with_path(target)[0]:
        if f"'path': '{'.'.join(key_of(k) for k in keys)}/'" in text:
            return f"`{format_path('like', keys)}`"
    return "an array"


def _first_line(error: BaseException) -> str:
    return (str(error).splitlines() or [type(error).__name__])[0]


@contextlib.contextmanager
def _checkpointer(ocp: Any, given: Any) -> Iterator[Any]:
    """`given`, untouched; or a `StandardCheckpointer` of our own, closed on the way out.
    It creates the checkpoint's directory before starting its threads: created in the
    background (Orbax's default), a directory that cannot be made leaves threads waiting
    for it for 20 minutes, and the process does not exit."""
    if given is not None:
        yield given
        return
    checkpointer = ocp.StandardCheckpointer(
        async_options=ocp.options.AsyncOptions(create_directories_asynchronously=False)
    )
    try:
        yield checkpointer
    except BaseException:
        with contextlib.suppress(Exception):  # the error being raised says more
            checkpointer.close()
        raise
    checkpointer.close()


def save_checkpoint(path: Any, tree: Any, *, checkpointer: Any = None) -> None:
    """Save the arrays of `tree` (a model, an optimizer state, a tuple of them) with
    Orbax, wherever they live; waits until the checkpoint is written.

    **Arguments:**

    - `path`: the checkpoint's directory, which must not exist yet (Orbax's rule);
        resolved as the operating system resolves it (`os.path.realpath`: a `..` after a
        symbolic link leaves the link's target).
    - `tree`: the state. Non-array leaves are not saved: `restore_checkpoint` takes them
        from `like`.
    - `checkpointer`: by default an `orbax.checkpoint.StandardCheckpointer`, closed when
        the save ends (or fails: its threads would keep the process alive). One you pass
        is used and left open.

    Beside Orbax's files the checkpoint gets `offload_eqx_checksums.json`: each array's
    shape, dtype and CRC32, written once Orbax has finished, which `restore_checkpoint`
    checks. Each array is copied to host memory to be hashed, one at a time (never to
    the device). In a run of several processes the first process writes it, and an array
    spread over the devices of several processes has no checksum.

    **Raises:** `ValueError` naming the first leaf that has been deleted (donated to a
    step), before anything is written; Orbax's `OSError`s for a directory it cannot
    create (`PermissionError`, `NotADirectoryError`) or an existing `path`'s
    `ValueError`.
    """
    caller = "ox.save_checkpoint"
    check_not_deleted(tree, "tree", caller, _SAVE_OUTPUTS)
    ocp = _orbax(caller)
    path = os.path.realpath(path)
    arrays = eqx.filter(tree, eqx.is_array)
    with _checkpointer(ocp, checkpointer) as opened:
        opened.save(path, arrays)
        opened.wait_until_finished()
    if jax.process_index() == 0:
        write_checksums(path, arrays)
    if jax.process_count() > 1:  # no process restores before the checksums are there
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(f"{caller}: {path}")


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

    **Returns:** a tree like `like`, its arrays read from the checkpoint into planned
    memory (and shards).

    **Raises:**

    - `FileNotFoundError` when `path` does not exist (saying when only an interrupted
        save's temporary directory does), and `ValueError` when it is not a complete
        checkpoint (no `_METADATA`) or its metadata is damaged; each names the complete
        checkpoints beside it. All before anything is read.
    - `ValueError` naming the first leaf of `like` that the checkpoint lacks or stores
        with another shape or dtype, before anything is read.
    - `ValueError` naming the checkpoint and the leaf when a data file cannot be read
        (truncated or missing: the checkpoint is damaged), or when an array differs from
        its checksum.
    """
    caller = "ox.restore_checkpoint"
    ocp = _orbax(caller)
    path = os.path.realpath(path)
    check_complete(caller, path)
    target = eqx.filter(abstract(like, strategy, mesh=mesh), is_array_leaf)
    checksums = read_checksums(caller, path) if verify else None
    with _checkpointer(ocp, checkpointer) as opened:
        _check_stored(caller, _stored_tree(caller, path, opened), target)
        try:
            restored = opened.restore(path, target)
        except Exception as error:
            if READ_FAILED not in str(error):
                raise
            cause = _first_line(error.__cause__ or error)
            raise ValueError(  # TensorStore's spec of the array, a page long, says no more
                DATA_DAMAGED.format(
                    caller=caller,
                    path=path,
                    leaf=_failed_leaf(error, target),
                    cause=cause,
                    complete=complete_beside(path),
                )
            ) from None
    if checksums is not None:
        verify_checksums(caller, path, restored, checksums)
    return eqx.combine(restored, eqx.filter(like, is_array_leaf, inverse=True))
