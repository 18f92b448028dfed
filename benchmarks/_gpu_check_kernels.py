"""Part 6 of `gpu_check.py`: cuDNN's fused attention compiled on the attached GPU, against
the same step compiled without it.

Compiled deviceless for an H100, cuDNN's kernels get an empty workspace (`u8[0]`: cuDNN
sizes it only on a GPU), so `ox.memory_report` names them and leaves their workspace out
(`MemoryReport.notes`). Here the same causal attention, forward and backward, is compiled
for the attached GPU: each cuDNN kernel's workspace as the GPU compile sized it, the
compiled temp bytes on both sides, and the step's measured median time beside what
`ox.estimate` predicts for it (cuDNN attention priced by its causal tiles, `fused.py`).
Off a GPU (`--smoke`) the attention is XLA's (`implementation="xla"`), to run the code.
"""

import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import offload_eqx as ox
from offload_eqx._inspect.workspaces import cudnn_workspaces


def attention_step(implementation: str) -> Any:
    """Gradients of causal attention over q, k, v (batch, seq, heads, head_dim)."""

    def step(q, k, v):
        def loss(q, k, v):
            out = jax.nn.dot_product_attention(
                q, k, v, is_causal=True, implementation=implementation
            )
            return out.astype(jnp.float32).sum()

        return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

    return step


def _median_seconds(compiled: Any, args: tuple, calls: int) -> float:
    jax.block_until_ready(compiled(*args))
    times = []
    for _ in range(calls):
        begin = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        times.append(time.perf_counter() - begin)
    return float(np.median(times))


def kernels(shape: tuple[int, int, int, int], target: str, calls: int) -> dict[str, Any]:
    """The attention step at `shape` on the attached device and compiled for `target`."""
    implementation = "cudnn" if jax.default_backend() == "gpu" else "xla"
    step = attention_step(implementation)
    q = jax.random.normal(jax.random.key(0), shape, jnp.bfloat16)
    compiled = jax.jit(step).lower(q, q, q).compile()
    abstract = jax.ShapeDtypeStruct(shape, jnp.bfloat16)
    planned = ox.filter_jit(step)
    report = ox.memory_report(planned, abstract, abstract, abstract, target=target)
    estimate = ox.estimate(planned, abstract, abstract, abstract, target=target)
    return {
        "shape": list(shape),
        "implementation": implementation,
        "target": target,
        "workspaces": cudnn_workspaces(compiled.as_text() or ""),
        "temp_bytes": compiled.memory_analysis().temp_size_in_bytes,
        "predicted_temp_bytes": report.device["temp"],
        "report_notes": list(report.notes),
        "median_seconds": _median_seconds(compiled, (q, q, q), calls),
        "predicted_seconds": estimate.seconds,
        "predicted_flops": estimate.flops,
    }
