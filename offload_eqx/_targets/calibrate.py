"""This machine's speeds, measured: what `ox.estimate(..., target="cpu")` prices with.

The CPU target has no datasheet figures: its `Speeds` are measured once per process,
in about a second, by timing jitted programs on the CPU backend and taking the median of
ten runs: the machine as it is when the process first prices a step, other work on it
included. An estimate made under load prices the step as it runs under that load; one
made at a quiet moment, as it runs then (the figures are kept for the process):

- `flops`: a float32 matrix multiply of `MATMUL` x `MATMUL` (the rate of a large
  matmul; `efficiency` is 1, since the measurement already is a reachable rate);
- `memory_bandwidth`: STREAM's triad `a = b + s c` over `STREAM` float32 values per
  array (12 bytes an element: two read, one written into a donated buffer, so no page
  is new), arrays larger than the last-level caches of common CPUs: the bandwidth of
  main memory, which a step's large arrays (an optimizer state) stream at;
- `h2d_bandwidth`, `d2h_bandwidth`: a `jax.device_put` of `LINK` float32 values between
  the CPU's device and `pinned_host` memory spaces inside a jitted program (a copy
  within this machine's RAM);
- host compute runs on the same cores: `host_flops` is the same figure;
  `host_bandwidth` an update in place, `x = x + s y` over a donated `x` (12 bytes an
  element), what the optimizer update on the host streams; `host_memory` is the
  machine's physical memory;
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

import dataclasses
import functools
import os
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .targets import Speeds, Target, get_target

MATMUL = 1024
STREAM = 16 * 2**20  # float32 values: 64 MiB per array, 192 MiB in all
LINK = 4 * 2**20  # float32 values copied between memory spaces: 16 MiB
LAUNCHES = 200
FRESH = 16 * 2**20  # float32 values: 64 MiB, above glibc's largest reuse threshold
TRANSPOSE = (1024, 2048)  # 8 MiB
_REPEATS = 10


def _typical_seconds(fn: Callable[[], jax.Array], repeats: int = _REPEATS) -> float:
    """The median time of `repeats` runs: the machine as it is now, its load included
    (the best of them priced a quiet moment, which a step run under load never gets:
    the 50M-parameter host update ran at 0.64x its estimate at load 3)."""
    jax.block_until_ready(fn())  # compile and warm up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return float(np.median(times))


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
    flops = 2 * MATMUL**3 / _typical_seconds(lambda: matmul(a))

    memory_bandwidth = _triad_bandwidth(cpu)
    host_bandwidth = _update_bandwidth(cpu)
    x = jax.device_put(jnp.ones((LINK,), jnp.float32), cpu)

    down = jax.jit(lambda x: jax.device_put(x, jax.memory.Space.Host))
    on_host = down(x)
    up = jax.jit(lambda x: jax.device_put(x, jax.memory.Space.Device))
    d2h = 4 * LINK / _typical_seconds(lambda: down(x))
    h2d = 4 * LINK / _typical_seconds(lambda: up(on_host))
    return _with_overheads(flops, memory_bandwidth, host_bandwidth, h2d, d2h, cpu)


def _triad_bandwidth(cpu: Any) -> float:
    """STREAM's triad, the result written over a donated (unread, kept) argument."""
    b, c = (jax.device_put(jnp.full((STREAM,), v, jnp.float32), cpu) for v in (1.0, 2.0))
    triad = jax.jit(lambda a, b, c: b + 1.5 * c, donate_argnums=0, keep_unused=True)
    cell = [jax.device_put(jnp.zeros((STREAM,), jnp.float32), cpu)]

    def run() -> jax.Array:
        cell[0] = triad(cell[0], b, c)
        return cell[0]

    return 3 * 4 * STREAM / _typical_seconds(run)


def _update_bandwidth(cpu: Any) -> float:
    """An update in place, `x = x + s y` over a donated `x`: 12 bytes an element, what a
    host computation that updates optimizer state streams (XLA's loops and the fused
    AdamW kernel both read the state and write it back where it was). On this VM it
    runs at 1.4 times the triad's counted bytes (a triad's result is written to lines
    it must first read, which STREAM does not count)."""
    x, y = (jax.device_put(jnp.full((STREAM,), v, jnp.float32), cpu) for v in (1.0, 2.0))
    update = jax.jit(lambda x, y: x + 1.5 * y, donate_argnums=0)
    cell = [x]

    def run() -> jax.Array:
        cell[0] = update(cell[0], y)
        return cell[0]

    return 3 * 4 * STREAM / _typical_seconds(run)


def _launch_seconds(cpu: Any) -> float:
    def chain(a: jax.Array, w: jax.Array) -> jax.Array:
        for _ in range(LAUNCHES):
            a = a @ w  # a dot is never fused with the next: one kernel each
        return a

    a = jax.device_put(jnp.ones((8, 8), jnp.float32), cpu)
    w = jax.device_put(jnp.eye(8, dtype=jnp.float32), cpu)
    run = jax.jit(chain)
    return _typical_seconds(lambda: run(a, w)) / LAUNCHES


def _first_touch_bandwidth(cpu: Any) -> float:
    fill = jax.jit(lambda v: jnp.broadcast_to(v, (FRESH,)))
    v = jax.device_put(jnp.float32(1.0), cpu)
    return 4 * FRESH / _typical_seconds(lambda: fill(v))


def _transpose_bandwidth(cpu: Any) -> float:
    x = jax.device_put(jnp.ones(TRANSPOSE, jnp.float32), cpu)
    flip = jax.jit(lambda m: m.T * 1.0)
    return 2 * x.nbytes / _typical_seconds(lambda: flip(x))


def _with_overheads(
    flops: float, memory_bandwidth: float, host_bandwidth: float, h2d: float, d2h: float, cpu: Any
) -> Speeds:
    return Speeds(
        flops=flops,
        efficiency=1.0,
        memory_bandwidth=memory_bandwidth,
        h2d_bandwidth=h2d,
        d2h_bandwidth=d2h,
        host_flops=flops,
        host_bandwidth=host_bandwidth,
        host_memory=_physical_memory(),
        source=f"measured on this machine's CPU ({os.cpu_count()} cores), float32",
        kernel_launch=_launch_seconds(cpu),
        first_touch_bandwidth=_first_touch_bandwidth(cpu),
        transpose_bandwidth=_transpose_bandwidth(cpu),
    )


HOST_STREAM = 32 * 2**20  # float32 values per array of the one-thread measurement: 128 MiB


def _one_thread_bandwidth() -> float:
    """NumPy's `add(a, b, out=a)`: one thread updating in place, 12 bytes an element."""
    a, b = (np.full(HOST_STREAM, v, np.float32) for v in (0.0, 1.0))
    np.add(a, b, out=a)
    times = []
    for _ in range(_REPEATS // 2):
        start = time.perf_counter()
        np.add(a, b, out=a)
        times.append(time.perf_counter() - start)
    return 3 * 4 * HOST_STREAM / float(np.median(times))


def calibrate_host(target: "str | Target") -> Target:
    """`target` with its host measured on this machine: run it on the host of the
    accelerator you plan for (the GPU machine), and pass the result as `target=` to
    `ox.estimate`, `ox.fit` and `ox.max_batch`.

    A host computation (the optimizer update on the host) streams at the bandwidth of
    the threads XLA gives it (its intra-op pool: the machine's cores), at most the
    memory's; a datasheet says neither for the host a GPU is actually in. This measures
    both in about a second, updating arrays in place as the optimizer update does:
    `host_thread_bandwidth`, one thread's (NumPy's `add(a, b, out=a)` over 128 MiB
    arrays, 12 bytes an element), and `host_bandwidth`, every core's (XLA:CPU's
    `x + s y` over a donated `x`, as `ox.estimate(..., target="cpu")` measures it), with
    `host_threads` the cores this process may use, and returns a `Target` named
    `"<name>+host"` with those figures in its `Speeds` (its source says so). Nothing is
    registered. On a machine whose GPUs all update at once, divide `host_bandwidth` by
    their number (`dataclasses.replace`)."""
    base = get_target(target)
    if base.speeds is None:
        raise ValueError(
            f"ox.calibrate_host({base.name!r}): this target has no datasheet speeds to "
            "calibrate (its speeds are this machine's, measured already); pass a "
            "target such as 'h100'."
        )
    one = _one_thread_bandwidth()
    every = max(cpu_speeds().host_bandwidth, one)
    speeds = dataclasses.replace(
        base.speeds,
        host_bandwidth=every,
        host_thread_bandwidth=one,
        host_threads=len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1,
        source=f"{base.speeds.source}; host measured by ox.calibrate_host "
        f"({os.cpu_count()} cores: {one / 1e9:.1f} GB/s a thread, {every / 1e9:.1f} all)",
    )
    return dataclasses.replace(base, name=f"{base.name}+host", speeds=speeds)
