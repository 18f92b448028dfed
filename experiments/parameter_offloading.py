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

import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v5p-8")
os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _report import DEFAULT_TARGETS, RESULTS, MiB, run_workload, script_main  # noqa: E402
from activation_offloading import bounds, scan_pairs  # noqa: E402


def run(targets=DEFAULT_TARGETS, layers=10, batch=256, width=256, hidden=1024, results_dir=RESULTS):
    sizes = dict(layers=layers, batch=batch, width=width, hidden=hidden)
    pairs = scan_pairs(
        {"offload x": "offload_activations", "params on host + offload x": "hybrid"}, **sizes
    )
    limits = {
        "offload x": bounds(**sizes)["offload x"],
        "params on host + offload x": (2 * batch * width + width * hidden + batch * hidden) * 4,
    }
    weights = 2 * layers * width * hidden * 4 / MiB

    def note(target):  # why the CPU misses the bound of "params on host + offload x"
        if target != "cpu":
            return None
        return (
            f"Under 'params on host', the {weights:.0f} MiB of weights and their {weights:.0f} "
            "MiB of gradients, host memory on h100 and tpu-v5p, are counted here."
        )

    return run_workload(
        "parameter", pairs, limits, tuple(targets), MiB, results_dir, panel_notes=note
    )


if __name__ == "__main__":
    script_main(run, __doc__)
