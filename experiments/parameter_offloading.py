"""Parameter offloading: the tutorial's scan with its weights in host memory.

The tutorial's hybrid program: w1, w2 `device_put` to `pinned_host` before the call, fetched
to the device inside the rematerialised layer (`jax.device_put(w, s_dev)`), with `x`
offloaded. In offload_eqx the model of `activation_offloading.py` is unchanged; the
strategy moves every `ox.field` to `pinned_host` (`strategy="hybrid"`; a model could also
declare `ox.field(memory="pinned_host")`), and `ox.scan` fetches each layer's weights
inside the region, so they are fetched again in the backward pass instead of kept.

Analytic lower bound of the device total (B batch, D width, H hidden, 4 bytes): the
arguments on the device are x alone (BD); the gradients of host-resident weights are
host-typed, so no output stays on the device. No residual need stay on the device, but the
backward of a layer must hold dout (BD), the fetched w2 of that layer (DH) and dy (BH) at
once: BD + BD + DH + BH = 0.25 + 0.25 + 1 + 1 = 2.50 MiB. (Offloading x alone: 41.50 MiB,
see `activation_offloading.py`.)

Run: `python experiments/parameter_offloading.py [--smoke | --full]`.
"""

import argparse
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v5p-8")
os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _tutorial import TARGETS, MiB, run_workload, scan_programs  # noqa: E402
from activation_offloading import RESULTS, abstract_model, bounds, grad_step  # noqa: E402

import offload_eqx as ox  # noqa: E402


def run(targets=TARGETS, layers=10, batch=256, width=256, hidden=1024, results_dir=RESULTS):
    sizes = dict(layers=layers, batch=batch, width=width, hidden=hidden)
    tutorial = scan_programs(**sizes)
    model, x = abstract_model(**sizes)
    pairs = {
        "offload x": (
            tutorial["offload x"],
            (ox.filter_jit(grad_step, strategy="offload_activations"), (model, x)),
        ),
        "params on host + offload x": (
            tutorial["params on host + offload x"],
            (ox.filter_jit(grad_step, strategy="hybrid"), (model, x)),
        ),
    }
    limits = {
        "offload x": bounds(**sizes)["offload x"],
        "params on host + offload x": (2 * batch * width + width * hidden + batch * hidden) * 4,
    }
    return run_workload("parameter", pairs, limits, tuple(targets), MiB, results_dir)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--targets", nargs="+", default=list(TARGETS))
    parser.add_argument("--smoke", action="store_true", help="the default: the tutorial's sizes")
    parser.add_argument("--full", action="store_true", help="same sizes (the workload is small)")
    options = parser.parse_args()
    run(targets=options.targets)
