"""Optimizer state offloading: the tutorial's 4-layer MLP with Adam, hand-written vs offload_eqx.

The workload of JAX's host-offloading tutorial: 4 dense DIM x DIM layers with GELU, loss
MSE + L2, `optax.chain(clip_by_global_norm(1.0), adam(0.1))`; published (DIM 7168): 4.59 GB
without offload, 2.87 GB with the optimizer state in host memory. In offload_eqx the
weights are `ox.field`s, the optimizer is `ox.offload_optimizer(...)`, and the strategy
("baseline" or "offload_optimizer") says where its state lives. At DIM 7168 the programs are
compiled from `jax.ShapeDtypeStruct`s for h100 and tpu-v5p: nothing is allocated. The CPU
column uses a smaller DIM (`--cpu-dim`, 512 with `--smoke`).

A third program, "sequential offload", is `ox.offload_optimizer(optax.adam(0.1),
stream="leaf", global_transform=optax.clip_by_global_norm(1.0))`: clipping by the global
norm on all gradients, then Adam one weight at a time, each inside a `jax.lax.cond` gated on
the previous weight's update, so that one weight's state is on the device at a time; see
experiments/README.md for what XLA does.

A fourth, "host update", is `ox.offload_optimizer(OPTIMIZER, update_on="host")` under the
same strategy: the whole update, `clip_by_global_norm` included, is one host computation;
the state (Adam's count too) stays in pinned host memory, the 4 gradients go to the host
once and the 4 updates come back once. XLA:TPU refuses it (a `ValueError` when compiled:
the row says "refused" and the reason is printed under the table). "gradients only" is a
reference without optimizer: the same loss's gradients, returned on the device.

Analytic lower bound of the device total, with P = DIM^2 x 4 bytes (196 MiB at 7168), no
value recomputed, whole arrays moved, the backward pass starting from the loss's cotangent:
- The arguments that stay on the device: the 4 weights and the input (5P); without offload
  also Adam's mu and nu (8P). New weights and state are donated, so they add nothing.
- The backward pass. Layer i computes z_i = a_(i-1) @ w_i and a_i = gelu(z_i) (a_0 = x,
  an argument). Its backward needs z_i (for gelu') and a_(i-1) (for the weight's
  gradient), so without recomputation z_1..z_4 and a_1..a_3 are kept: 7P of residuals,
  and when the backward pass starts the loss's cotangent (1P) is there too: 8P. From there
  each step of the backward pass frees at least what it allocates (a gradient appears as
  a residual dies), so 8P is the gradient computation's peak.
- Clipping by the global norm on the device needs all 4 gradients before any update: 4P
  live at once; the update of one weight needs its mu and nu on the device: 2P with the
  state on the host (one weight at a time), already counted without offload.
- On the host (update_on="host") neither is on the device: the gradients leave as the
  backward pass produces them and the updates come back after it (4P, less than the 8P
  it freed).
  baseline: max(13P + 8P, 13P + 4P) = 21P = 4.02 GiB;
  offloaded state, device update (whole or sequential): max(5P + 8P, 5P + 4P + 2P) = 13P;
  host update and gradients only: 5P + 8P = 13P = 2.49 GiB.
  The host update reaches its bound on h100 (13P, measured also at DIM 1024); a program
  that only computes the gradients has the same 13P total (there XLA places part of the
  8P in the 4P output buffers of the gradients, so its temp reads 4P): the host update
  adds nothing to the device peak of computing the gradients.

This bound replaces an earlier one, 17P (baseline) and 11P = 2.11 GiB (offloaded state,
9P = 1.72 GiB if streamed in pieces smaller than a weight), which assumed the forward
residuals are at most 4P (one activation per layer) and so that the backward pass needs no
more than the update. Without recomputation a GELU layer needs both its pre-activation and
its activation: 7P, and XLA keeps exactly those (the h100 temp at the start of the backward
pass is 7 residuals plus the first cotangent), so no program of this workload can go below
5P + 8P = 13P; 11P would need gelu(z) recomputed in the backward pass. (A scheduler that ran
the last layer's backward inside the forward pass, before the loss, could free 1P more; XLA
does not.)

`host_update_tradeoff` measures what the host update costs in time: the update (and the
update + apply) jitted on this machine's CPU on 4 DIM x DIM float32 arrays, against the
link time it saves on an H100 (bytes per direction from `ox.audit`, host-to-device and
device-to-host bandwidths from `ox.TARGETS["h100"].speeds`).

Run: `python experiments/optimizer_offloading.py [--smoke | --full] [--tradeoff-dim N]`
(`--tradeoff-only` runs only the timing; DIM 512 with `--smoke`, 7168 with `--full`).
"""

import argparse
import functools
import json
import os
import statistics
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v5p-8")
os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from _report import (  # noqa: E402
    DEFAULT_TARGETS,
    RESULTS,
    GiB,
    MiB,
    format_table,
    run_workload,
    transfer_totals,
)
from _tutorial import OPTIMIZER, gelu, optimizer_programs  # noqa: E402

import offload_eqx as ox  # noqa: E402


class MLP(eqx.Module):
    w1: jax.Array = ox.field(memory="device")
    w2: jax.Array = ox.field(memory="device")
    w3: jax.Array = ox.field(memory="device")
    w4: jax.Array = ox.field(memory="device")

    def __call__(self, x):
        for w in (self.w1, self.w2, self.w3, self.w4):
            x = gelu(x @ w)
        return x


def loss_fn(model: MLP, x):
    l2 = 0.001 * sum(jnp.sum(w**2) for w in jax.tree_util.tree_leaves(model))
    return jnp.mean((model(x) - x) ** 2) + l2


def make_step(opt):
    def step(model, opt_state, x):
        grads = jax.grad(loss_fn)(model, x)
        updates, opt_state = opt.update(grads, opt_state, model)
        return ox.apply_updates(model, updates), opt_state

    return step


def gradients(model, x):
    return jax.grad(loss_fn)(model, x)


def programs(dim: int) -> dict[str, tuple]:
    tutorial = optimizer_programs(dim)
    w = jax.ShapeDtypeStruct((dim, dim), jnp.float32)
    model, x = MLP(w, w, w, w), w
    opt = ox.offload_optimizer(OPTIMIZER)
    state = eqx.filter_eval_shape(opt.init, model)
    sequential = ox.offload_optimizer(
        optax.adam(0.1), stream="leaf", global_transform=optax.clip_by_global_norm(1.0)
    )
    sequential_state = eqx.filter_eval_shape(sequential.init, model)
    host = ox.offload_optimizer(OPTIMIZER, update_on="host")
    host_state = eqx.filter_eval_shape(host.init, model)
    return {
        "baseline": (
            tutorial["baseline"],
            (ox.filter_jit(make_step(opt), strategy="baseline", donate="all"), (model, state, x)),
        ),
        "offload optimizer state": (
            tutorial["offload optimizer state"],
            (
                ox.filter_jit(make_step(opt), strategy="offload_optimizer", donate="all"),
                (model, state, x),
            ),
        ),
        "sequential offload": (
            None,
            (
                ox.filter_jit(make_step(sequential), strategy="offload_optimizer", donate="all"),
                (model, sequential_state, x),
            ),
        ),
        "host update": (
            None,
            (
                ox.filter_jit(make_step(host), strategy="offload_optimizer", donate="all"),
                (model, host_state, x),
            ),
        ),
        "gradients only": (
            None,
            (ox.filter_jit(gradients, strategy="baseline"), (model, x)),
        ),
    }


def bounds(dim: int) -> dict[str, int]:
    """The analytic lower bounds of the module docstring (8P of the backward pass)."""
    p = dim * dim * 4
    return {
        "baseline": 21 * p,
        "offload optimizer state": 13 * p,
        "sequential offload": 13 * p,
        "host update": 13 * p,
        "gradients only": 13 * p,
    }


def _median_seconds(fn, args, runs: int, warmup: int = 2):
    """Median wall time of `fn(*args)` over `runs` calls after `warmup`; `fn` returns the
    next `args` (its donated inputs replaced by its outputs)."""
    for _ in range(warmup):
        args = fn(*args)
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        args = jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times), times


def host_update_tradeoff(dim: int, runs: int = 5, target: str = "h100", results_dir=RESULTS):
    """The host update's compute time on this machine's CPU against the link time it
    saves on `target`.

    Time: `OPTIMIZER.update` (what the host computes for parameters on the device) and
    `update` + `optax.apply_updates` (for parameters on the host), each jitted on 4 float32
    DIM x DIM arrays with the state (and parameters) donated, median of `runs` calls after
    2 warm-up calls. Bytes: `ox.audit` of the device update of the offloaded state and of
    the host update (compile-free, from shapes); the difference per direction divided by
    the target's host-link bandwidth of that direction (`ox.TARGETS[target].speeds`). The
    two directions run at once, so the step saves at most the longer of the two.
    """
    p = dim * dim * 4
    steps = programs(dim)
    moved = {
        name: transfer_totals(*steps[name][1])
        for name in ("offload optimizer state", "host update")
    }
    saved = {
        d: moved["offload optimizer state"][d] - moved["host update"][d] for d in ("h2d", "d2h")
    }
    speeds = ox.TARGETS[target].speeds
    link_saved = {
        "h2d": saved["h2d"] / speeds.h2d_bandwidth,
        "d2h": saved["d2h"] / speeds.d2h_bandwidth,
    }
    host_fn, host_args = steps["host update"][1]
    host_bytes = sum(
        c.operand_bytes + c.result_bytes for c in ox.audit(host_fn, *host_args).host_computations
    )

    keys = jax.random.split(jax.random.key(0), 8)
    params = {f"w{i}": 0.01 * jax.random.normal(keys[i], (dim, dim)) for i in range(4)}
    grads = {f"w{i}": 0.01 * jax.random.normal(keys[4 + i], (dim, dim)) for i in range(4)}
    state = OPTIMIZER.init(params)

    @functools.partial(jax.jit, donate_argnums=(1,))
    def update(grads, state, params):
        return OPTIMIZER.update(grads, state, params)[1]

    @functools.partial(jax.jit, donate_argnums=(1, 2))
    def update_and_apply(grads, state, params):
        updates, state = OPTIMIZER.update(grads, state, params)
        return state, optax.apply_updates(params, updates)

    update_s, update_runs = _median_seconds(
        lambda g, s, w: (g, update(g, s, w), w), (grads, state, params), runs
    )
    state = OPTIMIZER.init(params)
    apply_s, apply_runs = _median_seconds(
        lambda g, s, w: (g, *update_and_apply(g, s, w)), (grads, state, params), runs
    )
    longest = max(link_saved.values())
    result = {
        "dim": dim,
        "P_bytes": p,
        "target": target,
        "bytes_per_step": moved,
        "bytes_saved": saved,
        "bandwidth": {"h2d": speeds.h2d_bandwidth, "d2h": speeds.d2h_bandwidth},
        "link_seconds_saved": link_saved,
        "host_computation_bytes": host_bytes,
        "host_seconds_predicted": host_bytes / speeds.host_bandwidth,
        "cpu_update_s": update_s,
        "cpu_update_runs_s": update_runs,
        "cpu_update_and_apply_s": apply_s,
        "cpu_update_and_apply_runs_s": apply_runs,
        "ratio_update": update_s / longest,
        "ratio_update_and_apply": apply_s / longest,
        "cpu_count": os.cpu_count(),
    }
    ms = 1e3
    print(
        f"\nhost update trade-off at DIM {dim} (P = {p / MiB:.0f} MiB), link of {target}\n"
        + format_table(
            ["", "h2d", "d2h"],
            [
                [
                    "device update of the offloaded state, bytes/step",
                    *(_size(moved["offload optimizer state"][d]) for d in ("h2d", "d2h")),
                ],
                [
                    "host update, bytes/step",
                    *(_size(moved["host update"][d]) for d in ("h2d", "d2h")),
                ],
                ["saved, bytes/step", *(_size(saved[d]) for d in ("h2d", "d2h"))],
                [
                    f"{target} link GB/s",
                    f"{speeds.h2d_bandwidth / 1e9:.0f}",
                    f"{speeds.d2h_bandwidth / 1e9:.0f}",
                ],
                ["link time saved, ms", *(f"{link_saved[d] * ms:.3g}" for d in ("h2d", "d2h"))],
            ],
        )
    )
    print(
        f"this CPU ({os.cpu_count()} cores), median of {runs}: update {update_s * ms:.1f} ms, "
        f"update + apply {apply_s * ms:.1f} ms; against the {longest * ms:.3g} ms the link "
        f"saves (the longer direction): x{result['ratio_update']:.1f} / "
        f"x{result['ratio_update_and_apply']:.1f}. The host computation reads and writes "
        f"{_size(host_bytes)} in host memory: {result['host_seconds_predicted'] * ms:.1f} ms at "
        f"the {speeds.host_bandwidth / 1e9:.0f} GB/s of host memory bandwidth per {target} "
        "in ox.TARGETS."
    )
    os.makedirs(results_dir, exist_ok=True)
    with open(os.path.join(results_dir, f"optimizer_host_update_tradeoff_{dim}.json"), "w") as f:
        json.dump(result, f, indent=1)
    return result


def _size(n: int) -> str:
    return f"{n / GiB:.2f} GiB" if n >= GiB // 4 else f"{n / MiB:.2f} MiB"


def run(targets=DEFAULT_TARGETS, dim=7168, cpu_dim=2048, results_dir=RESULTS):
    def size(target):
        return cpu_dim if target == "cpu" else dim

    cache: dict[int, dict] = {}

    def pairs(target):
        return cache.setdefault(size(target), programs(size(target)))

    unit = GiB if dim >= 4096 else MiB
    print(f"DIM {dim} on {[t for t in targets if t != 'cpu']}, DIM {cpu_dim} on cpu")

    def note(target):
        compiled = "compile-only, nothing allocated" if target != "cpu" else "this machine"
        return f"DIM {size(target)} ({compiled})."

    return run_workload(
        "optimizer",
        pairs,
        lambda target: bounds(size(target)),
        tuple(targets),
        unit,
        results_dir,
        panel_notes=note,
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--targets", nargs="+", default=list(DEFAULT_TARGETS))
    parser.add_argument("--dim", type=int, default=7168, help="DIM for h100/tpu (compile-only)")
    parser.add_argument("--cpu-dim", type=int, default=2048, help="DIM for the cpu target")
    parser.add_argument(
        "--tradeoff-dim",
        type=int,
        help="DIM of the host update's timing on this CPU (512 with --smoke, 7168 with "
        "--full, 2048 otherwise)",
    )
    parser.add_argument("--tradeoff-runs", type=int, default=5)
    parser.add_argument(
        "--tradeoff-only", action="store_true", help="only the timing, no memory table"
    )
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--smoke", action="store_true", help="cpu DIM 512")
    size.add_argument("--full", action="store_true", help="cpu DIM 7168 too (compile-only)")
    options = parser.parse_args()
    cpu_dim = 512 if options.smoke else 7168 if options.full else options.cpu_dim
    if not options.tradeoff_only:
        run(targets=options.targets, dim=options.dim, cpu_dim=cpu_dim)
    tradeoff_dim = options.tradeoff_dim or (
        512 if options.smoke else 7168 if options.full else 2048
    )
    host_update_tradeoff(tradeoff_dim, runs=options.tradeoff_runs)
