"""This machine's speeds, measured: what `ox.estimate(..., target="cpu")` prices with.

The CPU target has no datasheet figures: its `Speeds` are measured once per process,
in about a second, by timing jitted programs on the CPU backend and taking the best of
several runs (the least disturbed by other work on the machine):

- `flops`: a float32 matrix multiply of `MATMUL` x `MATMUL` (the rate of a large
  matmul; `efficiency` is 1, since the measurement already is a reachable rate);
- `memory_bandwidth`: an elementwise add over `STREAM` float32 values (two read, one
  written);
- `h2d_bandwidth`, `d2h_bandwidth`: a `jax.device_put` of `STREAM` float32 values between
  the CPU's device and `pinned_host` memory spaces inside a jitted program (a copy
  within this machine's RAM);
- host compute runs on the same cores: `host_flops`, `host_bandwidth` are the same
  figures; `host_memory` is the machine's physical memory;
- `kernel_launch`: a chain of `LAUNCHES` dependent 8 x 8 matmuls, each its own kernel of
  negligible work: the time XLA:CPU spends per instruction beyond its work;
- `first_touch_bandwidth`: a jitted fill of `FRESH` float32 values, larger than the C
  allocator keeps for reuse (32 MiB), so every call writes pages new to the process:
  the rate at which XLA:CPU's per-execution temporary buffer is first written;
- `transpose_bandwidth`: a jitted transposing copy of a `TRANSPOSE` float32 matrix
  (bytes read and written over the time): the rate of XLA:CPU's kernels that transpose.

Measured in float32: bfloat16 arithmetic on a CPU is emulated and far slower, so time
CPU steps in float32.
"""

import functools
import os
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from .targets import Speeds

MATMUL = 1024
STREAM = 4 * 2**20  # float32 values: 16 MiB per array
LAUNCHES = 200
FRESH = 16 * 2**20  # float32 values: 64 MiB, above glibc's largest reuse threshold
TRANSPOSE = (1024, 2048)  # 8 MiB
_REPEATS = 10  # the best of 10: a quiet moment on a shared machine


def _best_seconds(fn: Callable[[], jax.Array], repeats: int = _REPEATS) -> float:
    jax.block_until_ready(fn())  # compile and warm up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        best = min(best, time.perf_counter() - start)
    return best


def _physical_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


@functools.cache
def cpu_speeds() -> Speeds:
    """The CPU's `Speeds`, measured on first use and kept for the process."""
    cpu = jax.devices("cpu")[0]
    a = jax.device_put(jnp.ones((MATMUL, MATMUL), jnp.float32), cpu)
    matmul = jax.jit(lambda a: a @ a)
    flops = 2 * MATMUL**3 / _best_seconds(lambda: matmul(a))

    x = jax.device_put(jnp.ones((STREAM,), jnp.float32), cpu)
    add = jax.jit(lambda x: x + x)
    memory_bandwidth = 3 * 4 * STREAM / _best_seconds(lambda: add(x))

    down = jax.jit(lambda x: jax.device_put(x, jax.memory.Space.Host))
    on_host = down(x)
    up = jax.jit(lambda x: jax.device_put(x, jax.memory.Space.Device))
    d2h = 4 * STREAM / _best_seconds(lambda: down(x))
    h2d = 4 * STREAM / _best_seconds(lambda: up(on_host))
    return _with_overheads(flops, memory_bandwidth, h2d, d2h, cpu)


def _launch_seconds(cpu: Any) -> float:
    def chain(a: jax.Array, w: jax.Array) -> jax.Array:
        for _ in range(LAUNCHES):
            a = a @ w  # a dot is never fused with the next: one kernel each
        return a

    a = jax.device_put(jnp.ones((8, 8), jnp.float32), cpu)
    w = jax.device_put(jnp.eye(8, dtype=jnp.float32), cpu)
    run = jax.jit(chain)
    return _best_seconds(lambda: run(a, w)) / LAUNCHES


def _first_touch_bandwidth(cpu: Any) -> float:
    fill = jax.jit(lambda v: jnp.broadcast_to(v, (FRESH,)))
    v = jax.device_put(jnp.float32(1.0), cpu)
    return 4 * FRESH / _best_seconds(lambda: fill(v))


def _transpose_bandwidth(cpu: Any) -> float:
    x = jax.device_put(jnp.ones(TRANSPOSE, jnp.float32), cpu)
    flip = jax.jit(lambda m: m.T * 1.0)
    return 2 * x.nbytes / _best_seconds(lambda: flip(x))


def _with_overheads(
    flops: float, memory_bandwidth: float, h2d: float, d2h: float, cpu: Any
) -> Speeds:
    return Speeds(
        flops=flops,
        efficiency=1.0,
        memory_bandwidth=memory_bandwidth,
        h2d_bandwidth=h2d,
        d2h_bandwidth=d2h,
        host_flops=flops,
        host_bandwidth=memory_bandwidth,
        host_memory=_physical_memory(),
        source=f"measured on this machine's CPU ({os.cpu_count()} cores), float32",
        kernel_launch=_launch_seconds(cpu),
        first_touch_bandwidth=_first_touch_bandwidth(cpu),
        transpose_bandwidth=_transpose_bandwidth(cpu),
    )
