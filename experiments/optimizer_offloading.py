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

Analytic lower bound of the device total, with P = DIM^2 x 4 bytes (196 MiB at 7168), no
gradient recomputed, whole arrays moved:
- The arguments that stay on the device: the 4 weights and the input (5P); without offload
  also Adam's mu and nu (8P). New weights and state are donated, so they add nothing.
- Clipping by the global norm needs all 4 gradients before any update: 4P live at once.
  (Forward residuals are at most 4P and die as the gradients appear, so the backward pass
  needs no more than the update phase.)
- The update of one weight needs its mu and nu on the device: with the state on the host
  that is 2P (one weight at a time); without offload it is already counted.
  baseline: 13P + 4P = 17P = 3.25 GiB; offloaded state: 5P + 4P + 2P = 11P = 2.11 GiB
  (9P = 1.72 GiB if the state were streamed in pieces smaller than one weight).

Run: `python experiments/optimizer_offloading.py [--smoke | --full]`.
"""

import argparse
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v5p-8")
os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from _report import DEFAULT_TARGETS, RESULTS, GiB, MiB, run_workload  # noqa: E402
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
    }


def bounds(dim: int) -> dict[str, int]:
    p = dim * dim * 4
    return {
        "baseline": 17 * p,
        "offload optimizer state": 11 * p,
        "sequential offload": 11 * p,
    }


def run(targets=DEFAULT_TARGETS, dim=7168, cpu_dim=2048, results_dir=RESULTS):
    def size(target):
        return cpu_dim if target == "cpu" else dim

    cache: dict[int, dict] = {}

    def pairs(target):
        return cache.setdefault(size(target), programs(size(target)))

    unit = GiB if dim >= 4096 else MiB
    print(f"DIM {dim} on {[t for t in targets if t != 'cpu']}, DIM {cpu_dim} on cpu")
    return run_workload(
        "optimizer", pairs, lambda target: bounds(size(target)), tuple(targets), unit, results_dir
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--targets", nargs="+", default=list(DEFAULT_TARGETS))
    parser.add_argument("--dim", type=int, default=7168, help="DIM for h100/tpu (compile-only)")
    parser.add_argument("--cpu-dim", type=int, default=2048, help="DIM for the cpu target")
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--smoke", action="store_true", help="cpu DIM 512")
    size.add_argument("--full", action="store_true", help="cpu DIM 7168 too (compile-only)")
    options = parser.parse_args()
    cpu_dim = 512 if options.smoke else 7168 if options.full else options.cpu_dim
    run(targets=options.targets, dim=options.dim, cpu_dim=cpu_dim)
