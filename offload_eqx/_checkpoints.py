"""Saving and restoring state straight into its planned memory, never whole on the device.

State that does not fit the device (a 13B model's Adam state, in host memory) must be
restored without passing through it. Every restore asks the plan where each leaf goes
(`ox.abstract`): `ox.tree_deserialise_leaves` reads an `eqx.tree_serialise_leaves` file
leaf by leaf into each leaf's planned sharding; `ox.restore_checkpoint` gives Orbax the
planned shardings as its restore target (Orbax does the I/O, `ox.save_checkpoint` too).
Both compare what is stored with `like` first and name the first leaf that differs.
"""

import contextlib
import os
import pathlib
from collections.abc import Iterator
from typing import Any

import equinox as eqx
import jax
import numpy as np

from ._mesh import AnyMesh, put, typed
from ._place import abstract
from ._plan import Plan, format_path
from ._plan_walk import is_array_leaf
from ._strategy import Strategy

_DIFFERENT_LEAF = (
    "{caller}: `{path}` is {stored} in the checkpoint but {wanted} in `like`, the first "
    "leaf that differs: the checkpoint was written from another model (or this one at "
    "another size or dtype). Pass as `like` the tree the checkpoint was saved from (its "
    "structure, shapes and dtypes; `eqx.filter_eval_shape` builds one without memory)."
)
_MISSING_LEAF = (
    "{caller}: `{path}` is not in the checkpoint{hint}: the checkpoint was "
    "written from another tree. Pass as `like` the tree the checkpoint was saved from."
)
_EXTRA_LEAVES = (
    "{caller}: the checkpoint holds {what} that `like` has no place for: it was written "
    "from a larger tree. Pass as `like` the tree the checkpoint was saved from."
)
_NO_ORBAX = (
    "{caller} needs Orbax (`orbax-checkpoint`), which is not installed. Install the "
    "extra: `pip install 'offload_eqx[checkpoint]'`."
)


def _describe(shape: Any, dtype: Any) -> str:
    return f"{dtype}{list(shape)}"  # float32[3, 16, 32]


# -- Equinox files ---------------------------------------------------------------------


@contextlib.contextmanager
def _opened(path_or_file: Any) -> Iterator[Any]:
    if isinstance(path_or_file, (str, os.PathLike)):
        path = pathlib.Path(path_or_file)
        with open(path.with_suffix(".eqx") if path.suffix == "" else path, "rb") as file:
            yield file
    else:
        yield path_or_file


def _read(file: Any, path: str, caller: str) -> np.ndarray:
    try:
        return np.load(file)
    except (EOFError, ValueError) as error:  # numpy's words for a file that ended
        raise ValueError(
            _MISSING_LEAF.format(caller=caller, path=path, hint=" (the file ends before it)")
        ) from error


def _loaded_array(file: Any, path: str, like: Any, sharding: Any, caller: str) -> Any:
    """The next array of the file, checked against `like`'s leaf and put in `sharding`
    (its planned memory; host memory is written directly, not through the device)."""
    value = _read(file, path, caller)
    if value.dtype.kind == "V" and value.dtype.itemsize == np.dtype(like.dtype).itemsize:
        value = value.view(like.dtype)  # bfloat16 and other ml_dtypes are saved as void
    if value.shape != tuple(np.shape(like)) or value.dtype != like.dtype:
        raise ValueError(
            _DIFFERENT_LEAF.format(
                caller=caller,
                path=path,
                stored=_describe(value.shape, value.dtype),
                wanted=_describe(np.shape(like), like.dtype),
            )
        )
    if isinstance(like, np.ndarray):
        return value  # a NumPy leaf stays NumPy, as `eqx.tree_deserialise_leaves` keeps it
    return put(value, typed(sharding))


def tree_deserialise_leaves(
    path_or_file: Any,
    like: Any,
    strategy: "str | Strategy | None" = None,
    *,
    mesh: AnyMesh | None = None,
) -> Any:
    """Read an `eqx.tree_serialise_leaves` file into planned memory, leaf by leaf.

    **Arguments:**

    - `path_or_file`: the file, as `eqx.tree_deserialise_leaves` takes it (a path, `.eqx`
        added when it has no suffix, or a binary file object).
    - `like`: the tree the file was saved from: arrays or `jax.ShapeDtypeStruct`s
        (`eqx.filter_eval_shape(Model, key)`: nothing is allocated); its non-array
        leaves (functions, static fields) are kept.
    - `strategy`: the strategy the state will be used under; by default the model's own
        annotations. Each array goes where `ox.abstract(like, strategy, mesh=mesh)` puts
        it: host-resident leaves are read into host memory without passing through the
        device (`eqx.tree_deserialise_leaves` makes every leaf a device array first).
    - `mesh`: the mesh for leaves with a `spec` (each process reads the file and keeps
        its own shards).

    Python and NumPy scalars and NumPy arrays are read as Equinox reads them.

    **Returns:** a tree like `like`, each array read into its planned memory.

    **Raises:** `ValueError` naming the first leaf whose shape or dtype differs from
    `like`'s, or that the file lacks, or saying that the file holds more leaves.
    """
    caller = "ox.tree_deserialise_leaves"
    shardings = Plan([("like", like)], strategy, mesh).tree_shardings(0)
    with _opened(path_or_file) as file:

        def load(keys: Any, leaf: Any, sharding: Any) -> Any:
            path = format_path("like", keys)
            if is_array_leaf(leaf) and not isinstance(leaf, np.generic):
                return _loaded_array(file, path, leaf, sharding, caller)
            if eqx.is_array_like(leaf) and leaf is not None:  # bool/int/float/complex
                value = _read(file, path, caller)
                if isinstance(leaf, jax.dtypes.bfloat16):
                    value = value.view(jax.dtypes.bfloat16)
                return type(leaf)(value.item())
            return leaf

        loaded = jax.tree_util.tree_map_with_path(
            load, like, shardings, is_leaf=lambda x: x is None
        )
        if file.read(1):
            raise ValueError(_EXTRA_LEAVES.format(caller=caller, what="more leaves"))
    return loaded


# -- Orbax -------------------------------------------------------------------------------


def _orbax(caller: str) -> Any:
    try:
        import orbax.checkpoint as ocp
    except ImportError:
        raise ImportError(_NO_ORBAX.format(caller=caller)) from None
    return ocp


def _key(entry: Any) -> str:
    """A key of a pytree path as Orbax writes it in its metadata (`layers`, `0`)."""
    for name in ("name", "key", "idx"):
        if hasattr(entry, name):
            return str(getattr(entry, name))
    return str(entry)


def _by_key(tree: Any) -> dict[tuple[str, ...], Any]:
    leaves = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: hasattr(x, "shape"))[0]
    return {tuple(_key(k) for k in keys): leaf for keys, leaf in leaves}


def _check_stored(caller: str, stored: Any, target: Any) -> None:
    """`like` (as `target`) and the checkpoint's metadata hold the same leaves, shapes and
    dtypes; else a `ValueError` naming the first leaf of `like` that differs."""
    have = _by_key(stored)
    labelled = jax.tree_util.tree_flatten_with_path(target)[0]
    for keys, leaf in labelled:
        path = format_path("like", keys)
        meta = have.pop(tuple(_key(k) for k in keys), None)
        if meta is None:
            raise ValueError(_MISSING_LEAF.format(caller=caller, path=path, hint=""))
        if tuple(meta.shape) != tuple(leaf.shape) or str(meta.dtype) != str(leaf.dtype):
            raise ValueError(
                _DIFFERENT_LEAF.format(
                    caller=caller,
                    path=path,
                    stored=_describe(meta.shape, meta.dtype),
                    wanted=_describe(leaf.shape, leaf.dtype),
                )
            )
    if have:
        first = "/".join(sorted(have)[0])
        raise ValueError(
            _EXTRA_LEAVES.format(caller=caller, what=f"{len(have)} leaves (first: `{first}`)")
        )


def save_checkpoint(path: Any, tree: Any, *, checkpointer: Any = None) -> None:
    """Save the arrays of `tree` (a model, an optimizer state, a tuple of them) with
    Orbax, wherever they live; waits until the checkpoint is written.

    `checkpointer` defaults to `orbax.checkpoint.StandardCheckpointer()`; `path` must
    not exist yet (Orbax's rule). Non-array leaves are not saved: `restore_checkpoint`
    takes them from `like`.
    """
    ocp = _orbax("ox.save_checkpoint")
    checkpointer = checkpointer or ocp.StandardCheckpointer()
    checkpointer.save(os.path.abspath(path), eqx.filter(tree, eqx.is_array))
    checkpointer.wait_until_finished()


def restore_checkpoint(
    path: Any,
    like: Any,
    strategy: "str | Strategy | None" = None,
    *,
    mesh: AnyMesh | None = None,
    checkpointer: Any = None,
) -> Any:
    """Restore an Orbax checkpoint of `like`'s arrays straight into planned memory.

    **Arguments:**

    - `path`: the checkpoint `ox.save_checkpoint` (or Orbax's `StandardCheckpointer`,
        given the arrays of the tree) wrote.
    - `like`: the tree it was saved from, arrays or `jax.ShapeDtypeStruct`s
        (`eqx.filter_eval_shape`); its non-array leaves are kept.
    - `strategy`, `mesh`: where each leaf goes, as `ox.abstract(like, strategy,
        mesh=mesh)` says: host-resident leaves are read into host memory, sharded leaves
        into their shards, on one device or a mesh (Orbax records no memory kinds, so the
        target carries them).

    **Returns:** a tree like `like`, its arrays read from the checkpoint into planned
    memory (and shards).

    **Raises:** `ValueError` naming the first leaf of `like` that the checkpoint lacks or
    stores with another shape or dtype, before anything is read.
    """
    caller = "ox.restore_checkpoint"
    ocp = _orbax(caller)
    checkpointer = checkpointer or ocp.StandardCheckpointer()
    path = os.path.abspath(path)
    target = eqx.filter(abstract(like, strategy, mesh=mesh), is_array_leaf)
    _check_stored(caller, checkpointer.metadata(path).item_metadata.tree, target)
    restored = checkpointer.restore(path, target)
    return eqx.combine(restored, eqx.filter(like, is_array_leaf, inverse=True))
