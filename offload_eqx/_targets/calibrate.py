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
  figures; `host_memory` is the machine's physical memory.

Measured in float32: bfloat16 arithmetic on a CPU is emulated and far slower, so time
CPU steps in float32.
"""

import functools
import os
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp

from .targets import Speeds

MATMUL = 1024
STREAM = 4 * 2**20  # float32 values: 16 MiB per array
_REPEATS = 5


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
    )
