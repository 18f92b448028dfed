"""XLA:GPU's rematerialization limit, with the program's host-memory bytes taken off it.

XLA:GPU runs `HloRematerialization` after scheduling, with the limit
`GetSchedulerMemoryLimit` computes (`xla/service/gpu/gpu_hlo_schedule.cc`):

    limit = (base - device inputs - device outputs + aliased device outputs)
            * xla_gpu_memory_limit_slop_factor / 100

where `base` is the module's `device_memory_size` when the client sets it (JAX does, from
the device allocator's `bytes_limit`) and 80% of the device description's memory
otherwise (a deviceless compile: the target config's `device_memory_size`); the slop
factor is 95 by default. The inputs and outputs are sized in memory space 0 only (the
jaxlib 0.10.2 and 0.12.0.1 plugins log `gpu_hlo_schedule.cc`'s "The byte size of
input/output arguments ... exceeds the base limit" from that version), so host
arguments and results do not lower that limit. The pass itself still charges
host memory to it (`xla/hlo/transforms/simplifiers/hlo_rematerialization.cc`):

- `HloRematerialization::RunImpl` takes `module_output_size`, every result of the entry
  computation sized by the compiler's shape function (`GetSizeOfShape`, which ignores the
  memory space), off the limit: the host results too, aliased or not;
- `MemoryUsageTracker::AllocatedSize` counts every buffer the program defines at its full
  size, unless `host_memory_offload_config` is set, which XLA:GPU sets only under
  `xla_gpu_enable_host_memory_offloading` (an option that also lets the pass move buffers
  to the host on its own): host stacks of offloaded activations, and the result buffers
  of a host computation before they are copied into their outputs.

A step whose optimizer state lives on the host hands XLA a limit its host bytes exceed,
and XLA clones matmuls the plan never asked to recompute although the device has room
(the Llama-2-13B delayed host update: `docs/guides/memory.md`). Only the slop factor is
ours to set (`device_memory_size` is the client's), so `remat_limit_options` raises it by
the host bytes the pass surely charges (`charged_host_bytes`) over what is left of the
device's memory:

    factor = slop + floor(100 * host bytes / (base - device inputs/outputs))

which gives the device buffers no more than the limit they would have had with no host
bytes (floor; the device's inputs and outputs are counted at most as XLA counts them,
so the room divided by is never smaller than XLA's). A program whose device buffers
exceed that limit is still rematerialized down to it. The latency-hiding scheduler
reads the same limit and sizes buffers with the same shape function, host ones included.
"""

import math
import os
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.extend as jex

from .._base.primitives import scan_consts_and_carry

# XLA:GPU's own default (`xla_gpu_memory_limit_slop_factor`, debug_options_flags.cc),
# and the share of the device's memory it starts from without a client limit.
DEFAULT_SLOP = 95
DESCRIPTION_SHARE = 0.80
SLOP_OPTION = "xla_gpu_memory_limit_slop_factor"
# Bodies that run once where they are called: their host values are the program's.
_CALLS = frozenset(
    "pjit closed_call core_call remat checkpoint custom_jvp_call custom_vjp_call "
    "custom_vjp_call_jaxpr".split()
)


def _bytes(aval: Any) -> int:
    """Bytes of one device's piece of an abstract value (the whole value when its type
    names no sharding)."""
    shape = getattr(aval, "shape", None)
    dtype = getattr(aval, "dtype", None)
    if shape is None or dtype is None:
        return 0
    sharding = getattr(aval, "sharding", None)
    try:
        shape = sharding.shard_shape(shape) if sharding is not None else shape
    except (AttributeError, TypeError, ValueError):
        pass
    if jax.dtypes.issubdtype(dtype, jax.dtypes.extended):  # a PRNG key: a few bytes
        return 0
    return math.prod(shape) * jax.numpy.dtype(dtype).itemsize


def _is_host(aval: Any) -> bool:
    return getattr(aval, "memory_space", None) == jax.memory.Space.Host


def _stacks(jaxpr: Any, outputs: set[int]) -> int:
    """Host bytes of the stacks a loop writes (a `scan`'s host-typed stacked outputs that
    are not the program's results: offloaded activations), at the top level or in a body
    run once. Each is a buffer of its own, live from the forward loop to the backward
    one, where the pass looks for work to recompute."""
    total = 0
    for eqn in jaxpr.eqns:
        inner = list(jex.core.jaxprs_in_params(eqn.params))
        if eqn.primitive.name in _CALLS and len(inner) == 1:
            body = getattr(inner[0], "jaxpr", inner[0])
            out = {id(b) for b, o in zip(body.outvars, eqn.outvars) if id(o) in outputs}
            total += _stacks(body, out)
        elif eqn.primitive.name == "scan":
            ys = eqn.outvars[scan_consts_and_carry(eqn.params)[1] :]
            total += sum(_bytes(v.aval) for v in ys if _is_host(v.aval) and id(v) not in outputs)
    return total


def charged_host_bytes(closed: Any, out_memories: Sequence[str] | None = None) -> int:
    """Host bytes XLA:GPU's rematerialization surely charges to the device's limit: the
    program's host results (host-typed, or placed in `"pinned_host"` by `out_memories`),
    which `RunImpl` takes off the limit whole, and the host stacks of its loops
    (`_stacks`). Host arguments are not charged. Other host buffers the program defines
    are left charged (a host computation's own result buffers, values sent to the host
    and read back): whether they are live at the pass's peak is XLA's schedule, and
    counting one that is not would raise the limit for device buffers."""
    jaxpr = getattr(closed, "jaxpr", closed)
    outvars = list(jaxpr.outvars)
    memories = list(out_memories) if out_memories is not None else [None] * len(outvars)
    results = sum(
        _bytes(v.aval)
        for v, memory in zip(outvars, memories)
        if _is_host(getattr(v, "aval", None)) or memory == "pinned_host"
    )
    return results + _stacks(jaxpr, {id(v) for v in outvars})


def _device_io(closed: Any, donated: Sequence[int] | None) -> int:
    """Device bytes of the program's arguments and results, less the results that alias
    a donated argument (same type), as `GetSchedulerMemoryLimit` counts them. Without
    the donation (None), the larger of the two: never more than XLA counts."""
    jaxpr = getattr(closed, "jaxpr", closed)
    ins = [v.aval for v in jaxpr.invars if not _is_host(v.aval)]
    outs = [v.aval for v in jaxpr.outvars if not _is_host(v.aval)]
    inputs, results = sum(map(_bytes, ins)), sum(map(_bytes, outs))
    if donated is None:
        return max(inputs, results)
    free = [jaxpr.invars[i].aval for i in donated if i < len(jaxpr.invars)]
    free = [a for a in free if not _is_host(a)]
    aliased = 0
    for aval in outs:
        match = next((a for a in free if (a.shape, a.dtype) == (aval.shape, aval.dtype)), None)
        if match is not None:
            free.remove(match)
            aliased += _bytes(aval)
    return inputs + results - aliased


def default_slop() -> int:
    """The slop factor XLA would use: `XLA_FLAGS`' when it sets one, else XLA's 95."""
    found = re.findall(rf"--{SLOP_OPTION}=(\d+)", os.environ.get("XLA_FLAGS", ""))
    return int(found[-1]) if found else DEFAULT_SLOP


def base_limit(platform: str, device_memory: int | None) -> int | None:
    """The bytes `GetSchedulerMemoryLimit` starts from: 80% of the target description's
    `device_memory` for a deviceless compile (`"cuda"`), the allocator's limit of this
    process's GPU (`"gpu"`), which JAX passes as the module's `device_memory_size`."""
    if device_memory is not None:
        return int(device_memory) * 80 // 100
    if platform != "gpu":
        return None
    try:
        stats = jax.local_devices()[0].memory_stats() or {}
    except (RuntimeError, IndexError):
        return None
    limit = stats.get("bytes_limit")
    return int(limit) if limit else None


def remat_limit_options(
    closed: Any,
    platform: str,
    device_memory: int | None = None,
    donated: Sequence[int] | None = None,
    out_memories: Sequence[str] | None = None,
) -> dict[str, Any]:
    """`{SLOP_OPTION: factor}` for an XLA:GPU program that holds host memory (see the
    module's docstring), else `{}`."""
    if platform not in ("cuda", "gpu"):
        return {}
    host = charged_host_bytes(closed, out_memories)
    base = base_limit(platform, device_memory)
    if not host or base is None:
        return {}
    room = base - _device_io(closed, donated)
    if room <= 0:  # the device's own inputs and outputs do not fit: nothing to add to
        return {}
    factor = default_slop() + (100 * host) // room
    return {SLOP_OPTION: int(min(factor, 2**31 - 1))}


def within_capacity(
    compiled: Any,
    options: Mapping[str, Any] | None,
    recompile: Callable[[dict[str, Any]], Any],
    capacity: int | None,
) -> tuple[Any, Mapping[str, Any] | None]:
    """`(compiled, options)`, or, where `options` raise the slop factor and the program
    needs more device memory than `capacity`, the program compiled again with XLA's own
    factor, when that needs less: `(that program, its options)`. The factor also raises
    the latency-hiding scheduler's limit, and the scheduler does not charge the entry's
    host results as the rematerialization pass does, so it may prefetch more (the
    planning guide's `save[h=offload] params=pinned_host` plan: 81.44 GiB against 80.94
    with XLA's factor): a program that fits with XLA's factor is never given up for one
    that does not."""
    if not options or SLOP_OPTION not in options or capacity is None:
        return compiled, options
    if device_bytes(compiled) <= capacity:
        return compiled, options
    # Options given to a compile are added to the jit's: the factor is set back, not left out.
    own = {**options, SLOP_OPTION: default_slop()}
    again = recompile(own)
    if device_bytes(again) < device_bytes(compiled):
        return again, own
    return compiled, options


def device_bytes(compiled: Any, memory: str = "") -> int:
    """The memory a compiled program needs, temp + argument + output - alias: on the
    device, or in host memory with `memory="host_"`."""
    stats = compiled.memory_analysis()
    size = lambda field: int(getattr(stats, f"{memory}{field}_size_in_bytes", 0) or 0)  # noqa: E731
    return size("temp") + size("argument") + size("output") - size("alias")
