"""Equinox files (`eqx.tree_serialise_leaves`) read leaf by leaf into planned memory.

`eqx.tree_deserialise_leaves` makes every leaf a device array first; here each array is
read and put straight into the memory (and shards) the plan gives it, after its shape
and dtype are compared with `like`'s.
"""

import contextlib
import os
import pathlib
from collections.abc import Iterator
from typing import Any

import equinox as eqx
import jax
import numpy as np

from .._declare.strategy import Strategy
from .._plan.plan import Plan
from .._plan.walk import format_path, is_array_leaf
from .._sharding.memory_space import match_type
from .._sharding.mesh import AnyMesh, put, typed
from .checks import DIFFERENT_LEAF, EXTRA_LEAVES, MISSING_LEAF, describe

_NOT_EQUINOX = (
    "{caller}: where `{path}` should start, the file holds {what}, not a NumPy array: it "
    "is not an `eqx.tree_serialise_leaves` file{fix}"
)
_NPZ_FIX = (
    ". Read it with `np.load(path)`, a dict of its arrays by name, and put them into "
    "your tree (`eqx.tree_at`); or pass the file `eqx.tree_serialise_leaves` wrote."
)
_EQUINOX_FIX = " (or it is damaged). Pass the file `eqx.tree_serialise_leaves(path, tree)` wrote."
_NUMPY_MAGIC = b"\x93NUMPY"  # how every `.npy` record starts
_ZIP_MAGIC = b"PK\x03\x04"  # how an `.npz` (a zip archive) starts


@contextlib.contextmanager
def _opened(path_or_file: Any) -> Iterator[Any]:
    if isinstance(path_or_file, (str, os.PathLike)):
        path = pathlib.Path(path_or_file)
        with open(path.with_suffix(".eqx") if path.suffix == "" else path, "rb") as file:
            yield file
    else:
        yield path_or_file


def _read(file: Any, path: str, caller: str) -> np.ndarray:
    """The next array of the file; each one `eqx.tree_serialise_leaves` writes is a
    `.npy` record starting with NumPy's magic string."""
    magic = file.read(len(_NUMPY_MAGIC))
    if not magic:
        raise ValueError(
            MISSING_LEAF.format(caller=caller, path=path, hint=" (the file ends before it)")
        )
    if magic != _NUMPY_MAGIC:
        npz = magic.startswith(_ZIP_MAGIC)
        raise ValueError(
            _NOT_EQUINOX.format(
                caller=caller,
                path=path,
                what="a zip archive (an `.npz` file)" if npz else f"bytes {magic!r}",
                fix=_NPZ_FIX if npz else _EQUINOX_FIX,
            )
        )
    file.seek(-len(magic), os.SEEK_CUR)  # np.load reads the magic again
    try:
        return np.load(file)
    except (EOFError, ValueError) as error:  # numpy's words for a file that ended
        raise ValueError(
            MISSING_LEAF.format(caller=caller, path=path, hint=" (the file ends before it)")
        ) from error


def _loaded_array(file: Any, path: str, like: Any, sharding: Any, caller: str) -> Any:
    """The next array of the file, checked against `like`'s leaf and put in `sharding`
    (its planned memory; host memory is written directly, not through the device)."""
    value = _read(file, path, caller)
    wanted = np.dtype(like.dtype)
    # NumPy stores bfloat16 and the other ml_dtypes types as nameless bytes (`V2`): read
    # them as `like`'s type only when it is one of those too, never a NumPy type of the
    # same size (float16 bits are not bfloat16 bits).
    if value.dtype.kind == "V" and wanted.kind == "V" and value.dtype.itemsize == wanted.itemsize:
        value = value.view(wanted)
    if value.shape != tuple(np.shape(like)) or value.dtype != wanted:
        raise ValueError(
            DIFFERENT_LEAF.format(
                caller=caller,
                path=path,
                stored=describe(value.shape, value.dtype),
                wanted=describe(np.shape(like), like.dtype),
            )
        )
    if isinstance(like, np.ndarray):
        return value  # a NumPy leaf stays NumPy, as `eqx.tree_deserialise_leaves` keeps it
    return match_type(put(value, typed(sharding)))


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

    Python and NumPy scalars and NumPy arrays are read as Equinox reads them. NumPy
    stores bfloat16 and the other ml_dtypes types as nameless bytes (`|V2`), read as
    `like`'s type when that is one of them of the same size: a float16 leaf of `like`
    does not take a bfloat16 array's bits, but one ml_dtypes type cannot be told from
    another of its size (float8_e4m3fn from float8_e5m2).

    **Returns:** a tree like `like`, each array read into its planned memory.

    **Raises:** `ValueError` naming the first leaf whose shape or dtype differs from
    `like`'s, or that the file lacks, or saying that the file holds more leaves; or
    saying that the file is not an `eqx.tree_serialise_leaves` file (a JSON file, an
    `.npz` archive: no NumPy array where a leaf should start).
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
            raise ValueError(EXTRA_LEAVES.format(caller=caller, what="more leaves"))
    return loaded
