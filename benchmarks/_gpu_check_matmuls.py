"""Part 8 of `gpu_check.py` (added 2026-12-08): bf16 matmuls of the shapes the H100's
table of efficiency by shape is checked at (`MATMUL_SHAPES`), each timed on the attached
device and reported as a fraction of the target's peak, beside what `ox.matmul_efficiency`
predicts for it.

Each shape is one jitted `a @ b` (bf16 in, bf16 out), compiled, called twice to warm up,
then timed as `calls` batches of `repeat` calls issued without waiting and blocked at the
batch's end (`block_until_ready`), `repeat` chosen so that a batch lasts about 20 ms as
predicted: the median batch over `repeat` is one matmul's time. A call also costs JAX's
dispatch (`dispatch_seconds`: the same of an almost empty program); a row whose time is
within a few dispatches of it measures the dispatch more than the kernel.
"""

import math
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import offload_eqx as ox
from offload_eqx._planning.traced_time import speeds_of

BATCH_SECONDS = 0.02  # a timed batch lasts about this long, as predicted
MOST_REPEATS = 200


def _batch_seconds(run: Any, args: tuple, repeat: int, calls: int) -> float:
    """Median seconds of one call over `calls` batches of `repeat` calls each."""
    jax.block_until_ready(run(*args))
    jax.block_until_ready(run(*args))
    times = []
    for _ in range(calls):
        begin = time.perf_counter()
        for _ in range(repeat - 1):
            run(*args)
        jax.block_until_ready(run(*args))
        times.append((time.perf_counter() - begin) / repeat)
    return float(np.median(times))


def matmuls(shapes: Any, target: str, calls: int = 5) -> dict[str, Any]:
    """Each `(m, n, k)` of `shapes` timed on the attached device: measured and predicted
    fraction of `target`'s peak."""
    speeds = speeds_of(ox.TARGETS[target])  # the CPU's measured (`--smoke`)
    tiny = jax.jit(lambda a: a[0, 0] + 1)
    dispatch = _batch_seconds(tiny, (jnp.ones((8, 8), jnp.bfloat16),), 20, calls)
    product = jax.jit(lambda a, b: a @ b)
    rows = []
    for m, n, k in shapes:
        keys = jax.random.split(jax.random.key(m + n + k))
        a = jax.random.normal(keys[0], (m, k), jnp.bfloat16)
        b = jax.random.normal(keys[1], (k, n), jnp.bfloat16)
        flops = 2.0 * m * n * k
        predicted = ox.matmul_efficiency(speeds, m, n, k, jnp.bfloat16)
        predicted_seconds = flops / (speeds.flops * predicted)
        repeat = min(MOST_REPEATS, max(1, math.ceil(BATCH_SECONDS / predicted_seconds)))
        seconds = _batch_seconds(product, (a, b), repeat, calls)
        rows.append(
            {
                "shape": [m, n, k],
                "predicted": predicted,
                "measured": flops / seconds / speeds.flops,
                "seconds": seconds,
                "predicted_seconds": predicted_seconds,
                "repeat": repeat,
            }
        )
        print(
            f"matmul {m}x{n}x{k} bf16: measured {rows[-1]['measured']:.3f} of peak "
            f"({seconds * 1e6:.1f} us), table {predicted:.3f}",
            flush=True,
        )
        del a, b
    return {
        "rows": rows,
        "target": target,
        "peak_flops": speeds.flops,
        "dispatch_seconds": dispatch,
        "calls": calls,
    }


def markdown(part: dict) -> list[str]:
    """The part's table for `gpu_check`'s report."""
    rows = [
        (
            " x ".join(map(str, r["shape"])),
            f"{r['measured']:.3f}",
            f"{r['predicted']:.3f}",
            f"{r['seconds'] * 1e6:.1f}",
            f"{r['predicted_seconds'] * 1e6:.1f}",
        )
        for r in part["rows"]
    ]
    header = ("M x N x K (bf16)", "measured of peak", "table", "measured us", "table us")
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return [
        f"Fraction of {part['target']}'s peak ({part['peak_flops'] / 1e12:.3g} TFLOP/s), "
        f"median of {part['calls']} batches; one dispatch "
        f"{part['dispatch_seconds'] * 1e6:.1f} us.",
        "",
        *lines,
    ]
