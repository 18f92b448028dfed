"""What a restore reads: the stored tree compared with `like`, then Orbax's restore.

Each leaf's shape and dtype is compared with `like` before anything is read into memory.
Orbax's `metadata` opens every array's TensorStore to say what it stored (4.5 s of a
12.8 s restore of 6,001 arrays, where Orbax's own restore took 1.0 s).
A checkpoint `ox.save_checkpoint` wrote holds the same facts in one file,
`offload_eqx_checksums.json` (each array's shape and dtype, read for the checksums
anyway), and Orbax's `_METADATA` names every array it stored: the two are compared with
`like` instead, and Orbax's `metadata` is asked only where they do not say (a checkpoint
Orbax wrote, an array spread over processes, which has no checksum).
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

from .._plan.walk import format_path, is_array_leaf
from .._sharding.memory_space import match_type
from .checks import (
    DATA_DAMAGED,
    DIFFERENT_LEAF,
    EXTRA_LEAVES,
    FILE_DAMAGED,
    MANIFEST,
    METADATA_DAMAGED,
    MISSING_LEAF,
    READ_FAILED,
    TREE_METADATA,
    complete_beside,
    describe,
    has_elements,
    is_key,
    key_of,
    load_json,
)
from .checksums import read_checksums

Key = tuple[str, ...]


@contextlib.contextmanager
def opened_checkpointer(ocp: Any, given: Any) -> Iterator[Any]:
    """`given`, untouched; or a `StandardCheckpointer` of our own, closed on the way out
    (its threads would keep the process alive)."""
    if given is not None:
        yield given
        return
    checkpointer = ocp.StandardCheckpointer()
    try:
        yield checkpointer
    except BaseException:
        with contextlib.suppress(Exception):  # the error being raised says more
            checkpointer.close()
        raise
    checkpointer.close()


def records_for(caller: str, path: str, verify: bool) -> dict[Key, Any] | None:
    """What `ox.save_checkpoint` recorded of each array (shape, dtype, checksum): its
    errors raised when verifying; without verifying, only read when it can be (else the
    shapes and dtypes are Orbax's)."""
    if verify:
        return read_checksums(caller, path)
    try:
        return read_checksums(caller, path)
    except ValueError:
        return None


def _tree_metadata(caller: str, path: str) -> Any:
    """`_METADATA` parsed; a `ValueError` saying the checkpoint is damaged when it is no
    JSON (nested too deeply, it was a `RecursionError`); None when it cannot be read."""
    try:
        with open(os.path.join(path, TREE_METADATA), "rb") as file:
            text = file.read()
    except OSError:
        return None
    try:
        return load_json(text)
    except ValueError as error:
        raise ValueError(
            FILE_DAMAGED.format(
                caller=caller,
                path=path,
                file=TREE_METADATA,
                what="each leaf's shape and dtype",
                cause=f"{type(error).__name__}: {error}",
                complete=complete_beside(path),
            )
        ) from None


def _stored_keys(caller: str, path: str) -> set[Key] | None:
    """The key path of each array Orbax stored, from its `_METADATA` (which also lists
    empty nodes, None and `()`, as not to be read); None where the file is not as Orbax
    writes it (then Orbax's `metadata` is asked, and says what is wrong)."""
    document = _tree_metadata(caller, path)
    try:
        entries = document["tree_metadata"].values()
        return {
            tuple(str(key["key"]) for key in entry["key_metadata"])
            for entry in entries
            if not entry["value_metadata"].get("skip_deserialize", False)
        }
    except (KeyError, TypeError, AttributeError):
        return None


def _orbax_metadata(caller: str, path: str, checkpointer: Any) -> Any:
    """The checkpoint's metadata tree (each leaf's shape and dtype), or a `ValueError`
    saying the checkpoint is damaged: Orbax logs why it could not read it and gives None."""
    try:
        metadata = checkpointer.metadata(path).item_metadata
    except Exception as error:
        cause = f" ({type(error).__name__}: {_without_spec(error)})"
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


def _as_stored(leaf: Any) -> tuple[tuple[int, ...], str]:
    """The shape and dtype Orbax records for a leaf: a key array's are its key data's."""
    if is_key(leaf.dtype):
        leaf = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(leaf.shape, leaf.dtype))
    return tuple(leaf.shape), str(leaf.dtype)


def _differs(caller: str, keys: Any, leaf: Any, shape: Any, dtype: Any) -> ValueError:
    return ValueError(
        DIFFERENT_LEAF.format(
            caller=caller,
            path=format_path("like", keys),
            stored=describe(shape, dtype),
            wanted=describe(leaf.shape, leaf.dtype),
        )
    )


def _compare(caller: str, stored: dict[Key, Any] | set[Key], target: Any, records: Any) -> None:
    """`target` (`like`, planned) and the checkpoint hold the same leaves, shapes and
    dtypes; else a `ValueError` naming the first leaf of `like` that differs. `stored`
    is what Orbax stored: each key's metadata (shape and dtype), or only the keys where
    `records` (what `ox.save_checkpoint` wrote beside it) hold the shapes and dtypes; the
    records also tell a key from its key data, and hold the arrays without elements."""
    have = dict.fromkeys(stored) if isinstance(stored, set) else dict(stored)
    for keys, leaf in jax.tree_util.tree_flatten_with_path(target)[0]:
        key = tuple(key_of(k) for k in keys)
        present = key in have
        meta, record = have.pop(key, None), (records or {}).get(key)
        if not present and (has_elements(leaf) or (records is not None and record is None)):
            path = format_path("like", keys)
            raise ValueError(MISSING_LEAF.format(caller=caller, path=path, hint=""))
        wanted = (tuple(leaf.shape), str(leaf.dtype))
        if record is not None and (tuple(record["shape"]), record["dtype"]) != wanted:
            raise _differs(caller, keys, leaf, record["shape"], record["dtype"])
        if meta is not None and (tuple(meta.shape), str(meta.dtype)) != _as_stored(leaf):
            raise _differs(caller, keys, leaf, meta.shape, meta.dtype)
    if have:
        first = "/".join(sorted(have)[0])
        raise ValueError(
            EXTRA_LEAVES.format(caller=caller, what=f"{len(have)} leaves (first: `{first}`)")
        )


def _by_key(tree: Any) -> dict[Key, Any]:
    leaves = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: hasattr(x, "shape"))[0]
    return {tuple(key_of(k) for k in keys): leaf for keys, leaf in leaves}


def check_stored(caller: str, path: str, checkpointer: Any, target: Any, records: Any) -> None:
    """`_compare` against the records and `_METADATA` where they describe every array
    of `target` that Orbax stored; else against Orbax's metadata of each array."""
    recorded: dict[Key, Any] = records if records is not None else {}
    keys = _stored_keys(caller, path) if records is not None else None
    if keys is not None:
        leaves = jax.tree_util.tree_leaves_with_path(target)
        wanted = (tuple(key_of(k) for k in leaf_keys) for leaf_keys, _ in leaves)
        if all(key in recorded or key not in keys for key in wanted):
            _compare(caller, keys, target, records)
            return
    stored = _by_key(_orbax_metadata(caller, path, checkpointer))
    _compare(caller, stored, target, records)


def _kept_as_numpy(leaf: Any) -> bool:
    """A NumPy leaf of `like` whose dtype JAX does not hold (float64 while
    `jax_enable_x64` is off): restored as the NumPy array it was saved as, not cut down
    to a JAX array of another dtype."""
    if not isinstance(leaf, (np.ndarray, np.generic)):
        return False
    return jax.dtypes.canonicalize_dtype(leaf.dtype) != leaf.dtype


def orbax_target(planned: Any, like: Any) -> Any:
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


def completed(planned: Any, restored: Any, like: Any) -> Any:
    """Each leaf of `restored` as `_completed` makes it."""
    like_arrays = eqx.filter(like, is_array_leaf)
    return jax.tree.map(_completed, planned, restored, like_arrays, is_leaf=lambda x: x is None)


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


def _without_spec(error: BaseException) -> str:
    """The first line of an error, less the TensorStore spec of the array it quotes (a
    page of JSON that says nothing about what is wrong)."""
    return _first_line(error).split(" [tensorstore_spec")[0]


def _manifest_damaged(caller: str, path: str, error: BaseException) -> ValueError | None:
    """The error naming `manifest.ocdbt` when TensorStore could not read it."""
    named = f'{os.path.join(path, MANIFEST)}": '
    text = _without_spec(error)
    if named not in text:
        return None
    return ValueError(
        FILE_DAMAGED.format(
            caller=caller,
            path=path,
            file=MANIFEST,
            what="where each array's bytes are in the data files",
            cause=text.split(named, 1)[1],
            complete=complete_beside(path),
        )
    )


def restored_from(caller: str, path: str, checkpointer: Any, target: Any) -> Any:
    """Orbax's restore of `target` from `path`; a data file it cannot read is a
    `ValueError` naming the checkpoint and the leaf."""
    try:
        return checkpointer.restore(path, target)
    except Exception as error:
        manifest = _manifest_damaged(caller, path, error)
        if manifest is not None:
            raise manifest from None  # TensorStore's spec of the array says no more
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
