"""Part 7 of `gpu_check.py`: the optimizer update on the GPU machine's host.

The step is `benchmarks/host_update.py`'s (AdamW, float32 masters of bfloat16
parameters, `update_on="host"`, in `ox.filter_jit(..., donate="all-except-first")`), its
bfloat16 gradients and parameters on the GPU and its state in the host's pinned memory.
On the GPU, XLA runs the update as a host computation on one thread of its host pool;
this part measures what that thread does there: the step's median time and parameters
per second, the threads busy while it runs (the process's CPU time over the wall time),
`ox.calibrate_host`'s measurement of the host (one thread's bandwidth, all cores'), and
`ox.estimate`'s prediction of the step for the target with its published host figures
and with the measured ones. Off a GPU (`--smoke`) the same step runs on the CPU.

The update there is our AdamW kernel where the CUDA plugin's host compiler was proven to
find it (`ox.host_kernels()`, recorded): the same step traced with optax's own
operations (`optax_only`, what XLA compiles without the kernel) is run beside it, once
from the same state for the results (bit for bit, or the largest difference) and then
timed the same way.
"""

import contextlib
import os
import sys
import time
from typing import Any

import jax
import numpy as np

import offload_eqx as ox

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _host_update_cases import _leaf_shapes, _ox_candidate  # noqa: E402

from offload_eqx._optimizer.fused_adamw import optax_only  # noqa: E402

KERNEL = 'custom_call_target="offload_eqx_adamw"'


def _traced(xla: bool) -> Any:
    """Tracing as XLA compiles optax (`xla`), or with the kernel where it applies."""
    return optax_only() if xla else contextlib.nullcontext()


def _against_optax(shapes: list) -> dict[str, Any]:
    """One step from the same state with the kernel and with optax's operations: whether
    the compiled program calls the kernel, and how the results compare."""
    results, calls = [], []
    for xla in (False, True):
        _, step, args = _ox_candidate(shapes, "float32")
        with _traced(xla):
            calls.append((step.trace(*args).lower().compile().as_text() or "").count(KERNEL))
            results.append(jax.device_get(step(*args)))
    pairs = list(zip(*(jax.tree_util.tree_leaves(r) for r in results)))
    differences = [
        float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))
        for a, b in pairs
        if np.size(a)
    ]
    return {
        "kernel_calls": calls[0],
        "kernel_calls_in_optax_program": calls[1],
        "bit_equal_to_optax": all(np.array_equal(a, b) for a, b in pairs),
        "max_abs_difference": max(differences, default=0.0),
    }


def _optax_timed(shapes: list, calls: int) -> tuple[float, float]:
    """`_timed` of the same step traced with optax's own operations."""
    run, _, _ = _ox_candidate(shapes, "float32")
    with optax_only():
        run()  # traced and compiled here; `_timed`'s calls reuse the compile
    return _timed(run, calls)


def _timed(run: Any, calls: int) -> tuple[float, float]:
    """(median seconds per call, threads busy on average), after one warm-up call."""
    run()
    seconds, busy = [], []
    for _ in range(calls):
        cpu = time.process_time()
        begin = time.perf_counter()
        run()
        wall = time.perf_counter() - begin
        seconds.append(wall)
        busy.append((time.process_time() - cpu) / wall)
    return float(np.median(seconds)), float(np.median(busy))


def host_update(parameters: int, target: str, calls: int) -> dict[str, Any]:
    """The host update of `parameters` parameters (4 equal leaves), timed and priced."""
    shapes = _leaf_shapes(parameters, "4")
    run, step, args = _ox_candidate(shapes, "float32")
    abstract = jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype) if hasattr(x, "shape") else x, args
    )
    published = ox.estimate(step, *abstract, target=target).seconds
    # This machine's host, measured (off a GPU the target is this CPU, measured already).
    speeds = ox.calibrate_host("h100").speeds
    assert speeds is not None
    calibrated = published
    if ox.TARGETS[target].speeds is not None:
        calibrated = ox.estimate(step, *abstract, target=ox.calibrate_host(target)).seconds
    median, busy = _timed(run, calls)
    optax_median, optax_busy = _optax_timed(shapes, calls)
    count = sum(int(np.prod(s)) for s in shapes)
    return {
        "host_kernels": ox.host_kernels(),
        **_against_optax(shapes),
        "optax_median_seconds": optax_median,
        "optax_threads_busy": optax_busy,
        "kernel_speedup": optax_median / median,
        "parameters": count,
        "target": target,
        "median_seconds": median,
        "parameters_per_second": count / median,
        "threads_busy": busy,
        "host_thread_GBps": speeds.host_thread_bandwidth / 1e9,
        "host_all_cores_GBps": speeds.host_bandwidth / 1e9,
        "cores": os.cpu_count(),
        "predicted_seconds": published,
        "predicted_seconds_calibrated": calibrated,
    }
