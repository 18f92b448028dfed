"""Can XLA:GPU overlap a per-layer host update with the backward loop? Compiled schedules.

ZeRO-Offload updates layer i+1 on the CPU while the GPU computes layer i's backward. In
one XLA program that is a host computation inside the backward `while` body that reads
nothing the same iteration computes (one layer of lag). This script compiles, without the
hardware, for an H100 (`ox.TARGETS["h100"]`, with the options offload_eqx compiles
delayed host updates with: `OVERLAP_OPTIONS`), a scanned `tanh(h @ w)` stack whose
weights (bf16) and Adam moments (f32) live in host memory, trained four ways:

- `after`: `jax.grad`, then one host computation updating every layer (what an
  undelayed `ox.offload_optimizer(..., update_on="host")` step compiles to);
- `in loop, sent at once`: a hand-written backward loop whose iteration i updates layer
  i+1 on the host and writes the new slices into host stacks in the same iteration;
- `in loop, sent next iteration`: the same, the new slices kept on the device for one
  iteration and written to the host stacks in the next;
- `delayed`: `after` with the previous step's gradients (`delay=1`): the host
  computation depends on the step's inputs only.

For each: the simulated step (`ox.estimate`'s simulator on the compiled text), the host
computation's busy time (with its operands and results in device memory crossing the
link as part of it) and the time the device waits for it, the link's busy time each way,
how many device matmuls XLA scheduled between the host call's start and done in the
backward loop's body, and the bytes of whole-stack copies outside the loops. The in-loop
programs are schedule probes: they skip the edge layers' updates, so they are not a
correct optimizer.

    JAX_PLATFORMS=cpu python benchmarks/host_call_in_loop.py           # 8 x 2048^2, 16k tokens
    JAX_PLATFORMS=cpu python benchmarks/host_call_in_loop.py --smoke   # 8 x 512^2, 2k tokens

Writes `benchmarks/results/host_call_in_loop.json`.
"""

import argparse
import json
import os
import re
import time
from collections.abc import Callable

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec  # noqa: E402

import offload_eqx as ox  # noqa: E402
from offload_eqx._host.compute import OVERLAP_OPTIONS  # noqa: E402
from offload_eqx._planning.schedule import simulate  # noqa: E402
from offload_eqx._targets.devices import target_mesh  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
LAYERS = 8


def adam(g, w, m, v):
    """One Adam step of a layer slice (bias correction left out: a constant factor)."""
    g = g.astype(jnp.float32)
    m = 0.9 * m + 0.1 * g
    v = 0.999 * v + 0.001 * g * g
    w = (w.astype(jnp.float32) - 1e-3 * m / (jnp.sqrt(v) + 1e-8)).astype(w.dtype)
    return w, m, v


try:  # JAX's host-computation transform: `compute_on2` in jax 0.10, `compute_on` from 0.11
    from jax.experimental.compute_on import compute_on2 as _compute_on  # noqa: E402
except ImportError:
    from jax.experimental.compute_on import compute_on as _compute_on  # noqa: E402


def on_host(f):
    """`f` as one host computation, its results in device memory."""
    return _compute_on(f, compute_type="device_host", out_memory_spaces=jax.memory.Space.Device)


host_adam = on_host(jax.jit(adam))


@on_host
@jax.jit
def host_adam_at(g, W, M, V, j):
    """Adam on layer `j` of the host stacks, sliced on the host."""
    return adam(g, *(jax.lax.dynamic_index_in_dim(S, j, keepdims=False) for S in (W, M, V)))


def forward(W, x, dev):
    def layer(h, w):
        return jnp.tanh(h @ jax.device_put(w, dev)), h

    return jax.lax.scan(layer, x, W)


def loss(W, x, dev):
    out, _ = forward(W, x, dev)
    return jnp.mean(out.astype(jnp.float32) ** 2)


def after(host, dev, delayed=False):
    def step(W, M, V, x, pending):
        g = jax.grad(loss)(W, x, dev)
        grads = pending if delayed else jax.device_put(g, host)
        new = host_adam(grads, W, M, V)
        return (*new, jax.device_put(g, host)) if delayed else new

    return step


def in_loop(host, dev, send_next: bool):
    """The lagged backward loop: iteration i computes layer i's gradient on the device
    while the host updates layer i+1 from the gradient the previous iteration sent."""

    def step(W, M, V, x):
        out, hs = forward(W, x, dev)
        dh = (2.0 / out.size) * out.astype(jnp.float32)

        def body(carry, xs):
            dh, g_prev, kept = carry
            i, w, h = xs
            new = host_adam_at(g_prev, W, M, V, jnp.minimum(i + 1, LAYERS - 1))
            wd = jax.device_put(w, dev)
            y = jnp.tanh(h @ wd).astype(jnp.float32)
            dz = (dh * (1 - y * y)).astype(h.dtype)
            gw = h.T @ dz
            dh = (dz @ wd.T).astype(jnp.float32)
            g_sent = jax.device_put(gw, host)
            if send_next:
                kept_new = jax.tree.map(lambda a: jax.device_put(a, dev), new)
                return (dh, g_sent, kept_new), jax.device_put(kept, host)
            return (dh, g_sent, kept), jax.device_put(new, host)

        g0 = jax.device_put(jnp.zeros(W.shape[1:], W.dtype), host)
        kept = tuple(jnp.zeros(S.shape[1:], S.dtype) for S in (W, M, V))
        _, new = jax.lax.scan(body, (dh, g0, kept), (jnp.arange(LAYERS), W, hs), reverse=True)
        return new

    return step


def compile_text(step: Callable, shapes: tuple, mesh) -> str:
    """The compiled text of `step`, its results in host memory."""
    host = NamedSharding(mesh.abstract_mesh, PartitionSpec(), memory_kind="pinned_host")
    with jax.set_mesh(mesh):
        lowered = jax.jit(step, out_shardings=host)
        compiled = lowered.trace(*shapes).lower().compile(compiler_options=dict(OVERLAP_OPTIONS))
    return compiled.as_text()


def body_overlap(text: str) -> int | None:
    """Matmuls scheduled between the host call's start and done in a loop body (None
    when no loop body holds a host call)."""
    for body in re.split(r"\n(?=%\S+ \(|ENTRY )", text):
        lines = body.splitlines()
        starts = [i for i, line in enumerate(lines) if "call-start" in line and " = " in line]
        if not starts or lines[0].startswith("ENTRY"):
            continue
        done = next(i for i, line in enumerate(lines) if "call-done(" in line)
        return sum("gemm_fusion" in line and " = " in line for line in lines[starts[0] : done])
    return None


def whole_copies(text: str, stack_elements: int) -> int:
    """Bytes of `copy-start`s of whole layer stacks in the entry computation."""
    entry = text[text.index("\nENTRY") :]
    total = 0
    for match in re.finditer(r"= \((\w+)\[(\d+),(\d+),(\d+)\]\{[^}]*\}, \S+ copy-start", entry):
        dtype, *dims = match.groups()
        count = int(dims[0]) * int(dims[1]) * int(dims[2])
        if count == stack_elements:
            total += count * {"bf16": 2, "f32": 4}[dtype]
    return total


def measure(width: int, tokens: int) -> list[dict]:
    mesh = target_mesh("h100")
    host = NamedSharding(mesh.abstract_mesh, PartitionSpec(), memory_kind="pinned_host")
    dev = NamedSharding(mesh.abstract_mesh, PartitionSpec(), memory_kind="device")
    stack = (LAYERS, width, width)
    W = jax.ShapeDtypeStruct(stack, jnp.bfloat16, sharding=host)
    M = jax.ShapeDtypeStruct(stack, jnp.float32, sharding=host)
    x = jax.ShapeDtypeStruct((tokens, width), jnp.bfloat16, sharding=dev)
    plans = {
        "after": (after(host, dev), (W, M, M, x, W)),
        "in loop, sent at once": (in_loop(host, dev, False), (W, M, M, x)),
        "in loop, sent next iteration": (in_loop(host, dev, True), (W, M, M, x)),
        "delayed": (after(host, dev, delayed=True), (W, M, M, x, W)),
    }
    speeds = ox.TARGETS["h100"].speeds
    rows = []
    for name, (step, shapes) in plans.items():
        begin = time.perf_counter()
        text = compile_text(step, shapes, mesh)
        sim = simulate(text, speeds)
        rows.append(
            {
                "plan": name,
                "width": width,
                "tokens": tokens,
                "step_ms": sim.seconds * 1e3,
                "host_busy_ms": sim.busy.get("host", 0.0) * 1e3,
                "host_waited_ms": sim.waited.get("host", 0.0) * 1e3,
                "h2d_ms": sim.busy.get("h2d", 0.0) * 1e3,
                "d2h_ms": sim.busy.get("d2h", 0.0) * 1e3,
                "matmuls_during_host_call": body_overlap(text),
                "whole_stack_copies_mb": whole_copies(text, LAYERS * width * width) / 1e6,
                "seconds": time.perf_counter() - begin,
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="8 x 512^2, 2048 tokens")
    args = parser.parse_args()
    width, tokens = (512, 2048) if args.smoke else (2048, 16384)
    rows = measure(width, tokens)
    print(
        "plan | step ms | host busy ms | device waits for host ms | h2d / d2h busy ms | "
        "matmuls during the host call (loop body) | whole-stack copies MB"
    )
    for r in rows:
        overlap = "-" if r["matmuls_during_host_call"] is None else r["matmuls_during_host_call"]
        print(
            f"{r['plan']} | {r['step_ms']:.3f} | {r['host_busy_ms']:.3f} | "
            f"{r['host_waited_ms']:.3f} | {r['h2d_ms']:.3f} / {r['d2h_ms']:.3f} | {overlap} | "
            f"{r['whole_stack_copies_mb']:.1f}"
        )
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, "host_call_in_loop.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
