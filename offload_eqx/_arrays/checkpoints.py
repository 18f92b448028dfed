"""Saving and restoring state straight into its planned memory, never whole on the device.

State that does not fit the device (a 13B model's Adam state, in host memory) must be
restored without passing through it. Every restore asks the plan where each leaf goes
(`ox.abstract`): `ox.tree_deserialise_leaves` reads an `eqx.tree_serialise_leaves` file
leaf by leaf into each leaf's planned sharding; `ox.restore_checkpoint` gives Orbax the
planned shardings as its restore target (Orbax does the I/O, `ox.save_checkpoint` too).
Both compare what is stored with `like` first and name the first leaf that differs, and
type each restored array by its memory. A save refuses what could not be restored before
writing anything, writes privately and renames (`checkpoint_writes`): a checkpoint is
complete or absent. Orbax keeps no checksum: `ox.save_checkpoint` writes one for each
array beside Orbax's files, and `ox.restore_checkpoint` checks it. A path that is no
complete checkpoint, or one that is damaged, is an error naming it and the complete
checkpoints beside it.
"""

import contextlib
import functools
import os
from collections.abc import Iterator
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

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
    check_absent,
    check_complete,
    check_savable,
    check_unique_names,
    complete_beside,
    describe,
    has_elements,
    is_key,
    key_of,
    read_checksums,
    verify_checksums,
    write_checksums,
)
from .checkpoint_files import tree_deserialise_leaves
from .checkpoint_writes import check_no_brackets, private_checkpoint
from .place import abstract, check_not_deleted, match_type

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


def _as_stored(leaf: Any) -> tuple[tuple[int, ...], str]:
    """The shape and dtype Orbax records for a leaf: a key array's are its key data's."""
    if is_key(leaf.dtype):
        leaf = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(leaf.shape, leaf.dtype))
    return tuple(leaf.shape), str(leaf.dtype)


def _check_stored(caller: str, stored: Any, target: Any, records: dict | None) -> None:
    """`like` (as `target`) and the checkpoint hold the same leaves, shapes and dtypes;
    else a `ValueError` naming the first leaf of `like` that differs. Orbax's metadata
    says what it stored; `records` (what `ox.save_checkpoint` wrote beside it, when read)
    tells a key from its key data, and holds the arrays without elements Orbax cannot."""
    have = _by_key(stored)
    for keys, leaf in jax.tree_util.tree_flatten_with_path(target)[0]:
        path = format_path("like", keys)
        key = tuple(key_of(k) for k in keys)
        meta, record = have.pop(key, None), (records or {}).get(key)
        if meta is None and (has_elements(leaf) or (records is not None and record is None)):
            raise ValueError(MISSING_LEAF.format(caller=caller, path=path, hint=""))
        wanted = (tuple(leaf.shape), str(leaf.dtype))
        if record is not None and (tuple(record["shape"]), record["dtype"]) != wanted:
            stored_as = describe(record["shape"], record["dtype"])
        elif meta is not None and (tuple(meta.shape), str(meta.dtype)) != _as_stored(leaf):
            stored_as = describe(meta.shape, meta.dtype)
        else:
            continue
        raise ValueError(
            DIFFERENT_LEAF.format(
                caller=caller,
                path=path,
                stored=stored_as,
                wanted=describe(leaf.shape, leaf.dtype),
            )
        )
    if have:
        first = "/".join(sorted(have)[0])
        raise ValueError(
            EXTRA_LEAVES.format(caller=caller, what=f"{len(have)} leaves (first: `{first}`)")
        )


def _kept_as_numpy(leaf: Any) -> bool:
    """A NumPy leaf of `like` whose dtype JAX does not hold (float64 while
    `jax_enable_x64` is off): restored as the NumPy array it was saved as, not cut down
    to a JAX array of another dtype."""
    if not isinstance(leaf, (np.ndarray, np.generic)):
        return False
    return jax.dtypes.canonicalize_dtype(leaf.dtype) != leaf.dtype


def _orbax_target(planned: Any, like: Any) -> Any:
    """What Orbax restores into: each planned leaf with elements (`ox.abstract`'s
    `ShapeDtypeStruct`, its memory and sharding), or the NumPy array `like` holds where
    it is kept as NumPy; None for a leaf without elements, which Orbax did not store."""

    def one(sharded: Any, leaf: Any) -> Any:
        if sharded is None or not has_elements(sharded):
            return None
        return np.asarray(leaf) if _kept_as_numpy(leaf) else sharded

    like = eqx.filter(like, is_array_leaf)
    return jax.tree.map(one, planned, like, is_leaf=lambda x: x is None)


def _completed(planned: Any, restored: Any, like: Any) -> Any:
    """A restored leaf typed by its memory (Orbax types a single-device `pinned_host`
    array as device memory); one without elements, which nothing stored, made where the
    plan puts it."""
    if planned is None or has_elements(planned):
        if isinstance(like, np.generic) and isinstance(restored, np.ndarray):
            return restored[()]  # a NumPy scalar, as it was saved
        return match_type(restored)
    if _kept_as_numpy(like):
        return np.zeros(planned.shape, planned.dtype)
    zeros = functools.partial(jnp.zeros, planned.shape, planned.dtype)
    return match_type(jax.jit(zeros, out_shardings=planned.sharding)())


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

    A checkpoint is complete or absent. The save writes into a directory of its own
    beside `path` (`<name>.offload_eqx-tmp-<random>`), and renames the finished
    checkpoint to `path` in one step; a save that fails, for any reason, removes it and
    leaves nothing. Of two saves racing for one path (two threads, two processes), the
    first to finish wins and its checkpoint is kept whole; the other raises
    `FileExistsError` naming the path and leaves nothing.

    Beside Orbax's files the checkpoint gets `offload_eqx_checksums.json`: each array's
    shape, dtype and CRC32, which `restore_checkpoint` checks. Each array is copied to
    host memory to be hashed, one at a time (never to the device). In a run of several
    processes the first process writes it, and an array spread over the devices of
    several processes has no checksum.

    **Raises:**

    - Before anything is written: `ValueError` naming the first leaf that cannot be
        saved: deleted (donated to a step), abstract (a `jax.ShapeDtypeStruct`: no
        values), traced, a NumPy array of strings or objects, or (in a run of several
        processes) an array on one process's devices only; `FileExistsError` when `path`
        exists; `NotADirectoryError` or `PermissionError` when its directory cannot be
        made.
    - `FileExistsError` naming `path` when another save finished it first, once this
        one's directory is removed.
    """
    caller = "ox.save_checkpoint"
    check_not_deleted(tree, "tree", caller, _SAVE_OUTPUTS)
    check_savable(caller, tree)
    check_unique_names(caller, eqx.filter(tree, eqx.is_array))
    ocp = _orbax(caller)
    path = os.path.realpath(path)
    check_no_brackets(caller, path)
    check_absent(caller, path)
    arrays = eqx.filter(tree, eqx.is_array)
    with private_checkpoint(caller, path) as written:
        with _checkpointer(ocp, checkpointer) as opened:
            opened.save(written, eqx.filter(arrays, has_elements))  # Orbax refuses empty ones
            opened.wait_until_finished()
        if jax.process_index() == 0:
            write_checksums(written, arrays)


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
        its checksum.
    """
    caller = "ox.restore_checkpoint"
    ocp = _orbax(caller)
    path = os.path.realpath(path)
    check_complete(caller, path)
    check_no_brackets(caller, path, restoring=True)
    planned = eqx.filter(abstract(like, strategy, mesh=mesh), is_array_leaf)
    records = read_checksums(caller, path) if verify else None
    with _checkpointer(ocp, checkpointer) as opened:
        _check_stored(caller, _stored_tree(caller, path, opened), planned, records)
        target = _orbax_target(planned, like)
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
    like_arrays = eqx.filter(like, is_array_leaf)
    restored = jax.tree.map(_completed, planned, restored, like_arrays, is_leaf=lambda x: x is None)
    if records is not None:
        verify_checksums(caller, path, restored, records)
    return eqx.combine(restored, eqx.filter(like, is_array_leaf, inverse=True))
