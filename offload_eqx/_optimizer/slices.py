"""How a streamed update cuts one leaf for its `fori_loop`: the layer slices of a stacked
leaf (`stream="layer"`), or, for any large leaf of an elementwise transformation, slices
of one weight, so that only a slice of its state is on the device at a time.

A weight updated whole holds its gradient, its fetched state and parameter and their new
values on the device together: for Adam on one 2048 x 2048 float32 weight, six copies of
the weight (96 MiB), where keeping everything on the device updates three in place
(65 MiB for the whole step). Cut into slices of at most `SLICE_BYTES`, the update holds
the gradient and one slice of the rest. The cut is along an axis the mesh does not shard
(a dynamic slice of a sharded axis would gather the leaf on every device), into a number
of slices that divides it (so every slice has one static shape).
"""

import dataclasses
import math
from typing import Any

import equinox as eqx
import jax
import numpy as np

from .._sharding.memory_space import is_host_typed, to_device, to_host
from .._trace.state import active_plan, argument_path

# The one rule of every device update in slices (a stream's weight here, a group of
# `stream=None` in `whole_slices`): one trip computes at most this many bytes of results
# (a slice of the update or of the new parameter, and of the new state), and reads about
# as much again (the slices of its operands). At most 64 trips of a weight's loop (each
# trip is a few copies; on an H100 a copy costs ~10 us to start).
SLICE_BYTES = 8 * 2**20
MAX_SLICES = 64


@dataclasses.dataclass(frozen=True)
class Slices:
    """`count` slices of `size` along `axis`; `squeeze` drops the axis from each slice
    (one layer of a stacked leaf is a slice of size 1 along its leading axis)."""

    axis: int
    size: int
    count: int
    squeeze: bool

    def shape(self, x: Any) -> jax.ShapeDtypeStruct:
        """The abstract value of one slice of `x`."""
        shape = list(np.shape(x))
        if self.squeeze:
            del shape[self.axis]
        else:
            shape[self.axis] = self.size
        return jax.ShapeDtypeStruct(tuple(shape), x.dtype)

    def read(self, x: Any, i: Any) -> Any:
        """Slice `i` of `x`, where `x` is (in host memory, sliced there)."""
        if self.squeeze:
            return jax.lax.dynamic_index_in_dim(x, i, self.axis, keepdims=False)
        return jax.lax.dynamic_slice_in_dim(x, i * self.size, self.size, self.axis)

    def write(self, buffer: Any, value: Any, i: Any) -> Any:
        """`buffer` with slice `i` replaced by `value` (of `buffer`'s memory space)."""
        if self.squeeze:
            return jax.lax.dynamic_update_index_in_dim(buffer, value, i, self.axis)
        return jax.lax.dynamic_update_slice_in_dim(buffer, value, i * self.size, self.axis)


def layer_slices(layers: int) -> Slices:
    """One layer at a time of a leaf stacked along a leading axis of `layers`."""
    return Slices(axis=0, size=1, count=layers, squeeze=True)


def weight_slices(shape: tuple, itemsize: int, sharded: tuple[bool, ...]) -> Slices | None:
    """The slices of a leaf of `shape` whose update's results (the update or the new
    value, and the new state) take `itemsize` bytes an element, cut along an axis not
    `sharded` (one flag per axis): the fewest whose results are at most `SLICE_BYTES`, or
    else the most that divide an axis up to `MAX_SLICES`; None for a leaf whose results
    are at most `SLICE_BYTES` (updated whole) or one no free axis can cut."""
    nbytes = math.prod(shape) * itemsize
    if nbytes <= SLICE_BYTES:
        return None
    free = [axis for axis, n in enumerate(shape) if not (axis < len(sharded) and sharded[axis])]
    best: Slices | None = None
    for axis in free:
        n = shape[axis]
        counts = [c for c in range(2, min(n, MAX_SLICES) + 1) if n % c == 0]
        small = [c for c in counts if nbytes / c <= SLICE_BYTES]
        if small:
            return Slices(axis=axis, size=n // small[0], count=small[0], squeeze=False)
        if counts and (best is None or counts[-1] > best.count):
            best = Slices(axis=axis, size=n // counts[-1], count=counts[-1], squeeze=False)
    return best


def write(slices: Slices, buffer: Any, value: Any, i: Any) -> Any:
    """Write `value` (on the device) as slice `i` of `buffer`, sending it to host memory
    first when `buffer` is host-typed (XLA then updates the host buffer in place)."""
    value = to_host(value) if is_host_typed(buffer) else to_device(value)
    return slices.write(buffer, value.astype(buffer.dtype), i)


def _plan_sharding(grad: Any, leaf_state: Any, param: Any, memory: str) -> Any:
    """The sharding the plan gives the parameter `grad` mirrors (without parameters, its
    optimizer state's), in `memory`; None off a mesh or for a leaf the plan does not shard."""
    plan = active_plan()
    if plan is None or plan.mesh is None:
        return None
    for leaf in [param, *jax.tree_util.tree_leaves(leaf_state)]:
        if eqx.is_array(leaf) and np.shape(leaf) == np.shape(grad):
            sharding = plan.mirrored_sharding(argument_path(leaf), memory)
            if sharding is not None:
                return sharding
    return None


def sharded_axes(grad: Any, leaf_state: Any, param: Any) -> tuple[bool, ...]:
    """Which axes of `grad`'s leaf the mesh shards (under `Explicit` axes its type says)."""
    sharding = _plan_sharding(grad, leaf_state, param, "device")
    spec = getattr(sharding or getattr(jax.typeof(grad), "sharding", None), "spec", None)
    return () if spec is None else tuple(entry is not None for entry in spec)


def sharded_like_its_leaf(grad: Any, leaf_state: Any, param: Any) -> Any:
    """On a mesh, `grad` constrained to the sharding the plan gives the parameter it
    mirrors (`_plan_sharding`). The per-slice loop then slices the gradient, the parameter
    and the state alike; left to the partitioner, a gradient sharded as the backward pass
    made it (FSDP: on another axis) is resharded whole, every stacked layer of it, on each
    trip of the loop. Under `Explicit` axes there is nothing to do: a gradient's type
    carries its parameter's sharding already."""
    plan = active_plan()
    if plan is None or plan.mesh is None:
        return grad
    if any(t == jax.sharding.AxisType.Explicit for t in plan.mesh.axis_types):
        return grad
    memory = "pinned_host" if is_host_typed(grad) else "device"
    sharding = _plan_sharding(grad, leaf_state, param, memory)
    return grad if sharding is None else jax.lax.with_sharding_constraint(grad, sharding)
