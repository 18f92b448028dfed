"""Activation offloading: the tutorial's 10-layer scan, hand-written vs offload_eqx.

The workload of JAX's host-offloading tutorial: 10 scanned layers `(x @ w1) @ w2`, x 256x256,
w1 10x256x1024, w2 10x1024x256 (float32), `jax.grad` of the sum. The tutorial offloads the
layer input `x` with a remat policy; offload_eqx declares the same on the model:

    class Layer(eqx.Module):          # ox.name(x, "x") in __call__
    class Model(eqx.Module):
        activations: ox.Activations = ox.activations(x="offload")
        def __call__(self, x): return ox.scan(self.layers, x)

and switches strategies without touching the model: "baseline" (save everything, as the
tutorial's first program) and "offload_activations".

Analytic lower bound of the device total (B batch, D width, H hidden, L layers, 4 bytes):
arguments (w: 2LDH, x: BD) and outputs (the gradients, 2LDH) are on the device in both
programs. Baseline keeps every residual for the backward pass: the inputs of layers 2..L
and every y, (L-1)BD + LBH; the bound adds nothing else (the backward working set reuses
them). Offloading x and recomputing y leaves no residual on the device, but the backward
of a layer must hold dy = dout @ w2^T beside dout: BD + BH.
  baseline: 20.25 + 20 + 12.25 = 52.50 MiB;  offload x: 20.25 + 20 + 1.25 = 41.50 MiB.

Run: `python experiments/activation_offloading.py [--smoke | --full]` (results in
`experiments/results/`). `--smoke` compiles the same sizes (a few seconds per target).
"""

import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v5p-8")
os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from _report import DEFAULT_TARGETS, RESULTS, MiB, run_workload, script_main  # noqa: E402
from _tutorial import scan_arguments, scan_programs  # noqa: E402

import offload_eqx as ox  # noqa: E402


class Layer(eqx.Module):
    w1: jax.Array = ox.field(memory="device")
    w2: jax.Array = ox.field(memory="device")

    def __call__(self, x):
        x = ox.name(x, "x")
        return (x @ self.w1) @ self.w2


class Model(eqx.Module):
    layers: Layer  # stacked: every leaf has the layer axis first
    activations: ox.Activations = ox.activations(x="offload")

    def __call__(self, x):
        return ox.scan(self.layers, x)


def grad_step(model: Model, x):
    return eqx.filter_grad(lambda m: jnp.sum(m(x)))(model)


def abstract_model(layers: int, batch: int, width: int, hidden: int):
    (w1, w2), x = scan_arguments(layers, batch, width, hidden)
    return Model(Layer(w1, w2)), x


def bounds(layers: int, batch: int, width: int, hidden: int) -> dict[str, int]:
    params = 2 * layers * width * hidden * 4
    arguments, outputs = params + batch * width * 4, params
    return {
        "baseline": arguments
        + outputs
        + ((layers - 1) * batch * width + layers * batch * hidden) * 4,
        "offload x": arguments + outputs + (batch * width + batch * hidden) * 4,
    }


def scan_pairs(strategies: dict[str, str], **sizes: int) -> dict[str, tuple]:
    """For `run_workload`: each tutorial program beside the model under `strategies[name]`."""
    tutorial = scan_programs(**sizes)
    model, x = abstract_model(**sizes)
    return {
        name: (tutorial[name], (ox.filter_jit(grad_step, strategy=strategy), (model, x)))
        for name, strategy in strategies.items()
    }


def run(targets=DEFAULT_TARGETS, layers=10, batch=256, width=256, hidden=1024, results_dir=RESULTS):
    sizes = dict(layers=layers, batch=batch, width=width, hidden=hidden)
    pairs = scan_pairs({"baseline": "baseline", "offload x": "offload_activations"}, **sizes)
    return run_workload("activation", pairs, bounds(**sizes), tuple(targets), MiB, results_dir)


if __name__ == "__main__":
    script_main(run, __doc__)
