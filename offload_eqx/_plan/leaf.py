"""Where one array leaf lives: its `LeafPlan`, the memory a strategy gives it, and the
parameter an optimizer-state leaf mirrors (whose sharding it takes).

`plan` builds a `LeafPlan` for every array leaf of a call's arguments with these rules.
"""

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, cast

import jax
import numpy as np
from jax.core import Tracer
from jax.sharding import NamedSharding, PartitionSpec

from .._declare.placement import Memory, Placement, Role
from .._declare.strategy import HOST_UPDATES, Strategy


@dataclasses.dataclass(frozen=True)
class LeafPlan:
    """The plan for one array leaf.

    - `path`: its path from the argument it belongs to (`model.layers.w1`).
    - `memory`: where it lives under the strategy; None for a leaf nothing manages
        (it stays in the memory it is in).
    - `declared`: the memory its annotation declares (None: not annotated).
    - `role`: `"param"` (a model field), `"optimizer"` (optimizer state) or None.
    - `spec`: the `PartitionSpec` it is sharded with over the plan's mesh, declared or
        mirrored from its parameter (None: none declared).
    - `sharding`: its planned sharding, the one `ox.filter_jit` compiles it with.
    - `mirrors`: for optimizer state, the path of the parameter it mirrors.
    """

    path: str
    shape: tuple[int, ...]
    dtype: Any
    memory: Memory | None
    declared: Memory | None
    role: Role | None
    spec: PartitionSpec | None
    sharding: Any = None
    mirrors: str | None = None
    root: int = dataclasses.field(default=0, repr=False)
    uploaded: bool = dataclasses.field(default=False, repr=False)  # a NumPy leaf
    keys: tuple = dataclasses.field(default=(), repr=False, compare=False)

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize


def current_sharding(leaf: Any) -> Any:
    """Where a leaf is now, if that is decided: not for a tracer (a call inside another
    trace: the outer program decides) nor for an uncommitted array (as under `jax.jit`,
    it goes where the committed arguments are)."""
    if isinstance(leaf, Tracer) or not getattr(leaf, "committed", True):
        return None
    return getattr(leaf, "sharding", None)


def committed_device(leaves: Any) -> Any:
    """The device of the first committed single-device array among `leaves`, where the
    uncommitted ones go (None: there is none)."""
    for leaf in leaves:
        # Only a concrete array has devices: a `jax.ShapeDtypeStruct`'s sharding may be on
        # an abstract mesh, whose `device_set` raises.
        if not isinstance(leaf, jax.Array):
            continue
        devices = getattr(current_sharding(leaf), "device_set", ())
        if len(devices) == 1:
            return next(iter(devices))
    return None


_KEY_ON_HOST = (
    "`{path}` is a PRNG key array (dtype {dtype}) declared `memory='pinned_host'`, but JAX "
    "cannot keep a typed key in host memory: a key's type carries no memory space, so a "
    "step cannot type it as host memory. Declare it "
    "`memory='device'` (a key is a few bytes), or keep its raw bits in host memory "
    "(`jax.random.key_data(key)`, a uint32 array) and `jax.random.wrap_key_data(...)` "
    "them inside the step after `ox.fetch`."
)


def is_key(dtype: Any) -> bool:
    """Whether `dtype` is a typed PRNG key's (`jax.random.key(0).dtype`)."""
    return jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def effective_memory(
    placement: Placement | None,
    ndim: int,
    strategy: Strategy,
    path: str,
    mirrors: str | None = None,
    dtype: Any = None,
) -> Memory | None:
    """Where a leaf of `ndim` dimensions at `path` lives under `strategy` (None: nothing
    manages it); `mirrors` is the path of the parameter an optimizer-state leaf mirrors,
    which a strategy's leaf patterns match too (`Strategy.memory_of`).

    A typed PRNG key (`dtype`) stays on the device whatever a strategy moves: JAX types
    no key as host memory. Declared in host memory itself, it is an error (`ValueError`
    naming its path): the declaration cannot be honoured."""
    memory = _memory(placement, ndim, strategy, path, mirrors)
    if memory != "pinned_host" or dtype is None or not is_key(dtype):
        return memory
    assert placement is not None  # a managed leaf
    if placement.role != "optimizer" and placement.memory == "pinned_host":
        raise ValueError(_KEY_ON_HOST.format(path=path, dtype=dtype))
    return "device"


def _memory(
    placement: Placement | None,
    ndim: int,
    strategy: Strategy,
    path: str,
    mirrors: str | None,
) -> Memory | None:
    if placement is None:
        return None
    if placement.role == "optimizer" and strategy.update_of(placement.update) in HOST_UPDATES:
        return "pinned_host"  # updated on the host: all of it lives there, never moved
    if placement.role == "optimizer" and ndim == 0:
        # Scalars (Adam's step count, injected hyperparameters) stay on the device: they
        # are bytes, every update reads them, and a donated host scalar that XLA aliases
        # to a device output aborts the process (see `Plan.output_shardings`).
        return "device"
    memory = strategy.memory_of(placement.role, path, placement.memory, mirrors)
    return cast(Memory, memory)


def parameter_suffixes(params: dict[tuple, int]) -> dict[tuple, int | None]:
    """Every suffix of every parameter's key path, with the parameter it names (None
    where two parameters end the same way): a state leaf mirrors its parameter by the
    part of the path below the container that holds both (`tree[0].layers.w1` and
    `tree[1].inner[0].mu.layers.w1` in one `(model, opt_state)` tuple share `.layers.w1`)."""
    found: dict[tuple, int | None] = {}
    for keys, index in params.items():
        for start in range(len(keys)):
            suffix = keys[start:]
            found[suffix] = index if found.get(suffix, index) == index else None
    return found


def mirrored(keys: tuple, shape: tuple, suffixes: dict[tuple, int | None], leaves: list):
    """The parameter whose key path (or the longest unambiguous end of it) occurs in an
    optimizer-state leaf's key path, if its shape is the state leaf's: Adam's
    `mu.layers.w1` mirrors `layers.w1`, a streamed `leaves.layers.w1[0].mu` too."""
    n = len(keys)
    for length in range(n, 0, -1):
        for start in range(0, n - length + 1):
            index = suffixes.get(keys[start : start + length])
            if index is not None and leaves[index]["shape"] == shape:
                return index
    return None


def mirror_states(
    entries: list[dict[str, Any]],
    placements: Mapping[str, Placement | None],
    strategy: Strategy,
    on_mesh: bool,
    sharding_of: Callable[[dict[str, Any]], Any],
) -> list[Any]:
    """The sharding of every leaf entry, parameters first: an optimizer-state leaf takes
    the spec of the parameter it mirrors (recorded in `entry["mirrors"]`), and, under
    leaf patterns, the memory a pattern gives that parameter's path too."""
    params = parameter_suffixes(
        {e["keys"]: i for i, e in enumerate(entries) if e["role"] != "optimizer"}
    )
    shardings: list[Any] = [None] * len(entries)
    order = sorted(range(len(entries)), key=lambda i: entries[i]["role"] == "optimizer")
    for i in order:
        entry = entries[i]
        mirror = None
        if entry["role"] == "optimizer":
            mirror = mirrored(entry["keys"], entry["shape"], params, entries)
        if mirror is not None:
            entry["mirrors"] = entries[mirror]["path"]
            if not isinstance(strategy.optimizer, str):  # leaf patterns: see either path
                placement = placements.get(entry["path"])
                ndim = len(entry["shape"])
                entry["memory"] = effective_memory(
                    placement, ndim, strategy, entry["path"], entry["mirrors"], entry["dtype"]
                )
            like = shardings[mirror]
            if isinstance(like, NamedSharding) and on_mesh:
                entry["spec"] = like.spec
        shardings[i] = sharding_of(entry)
    return shardings
