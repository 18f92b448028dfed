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
"""

import os
import sys
import time
from typing import Any

import jax
import numpy as np

import offload_eqx as ox

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _host_update_cases import _leaf_shapes, _ox_candidate  # noqa: E402


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
    count = sum(int(np.prod(s)) for s in shapes)
    return {
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
