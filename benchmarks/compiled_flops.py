"""FLOPs of the compiled program against the jaxpr count and against XLA's cost analysis.

For the experiments' decoder (`experiments/_decoder.py`) at 1B, 8B and 13B, one training
step at batch 1, compiled without the hardware for an H100 under `hybrid` (q, k, v
offloaded, the rest recomputed, weights and AdamW state in host memory) and for a TPU
v5p chip under `qkv_offload` (the same activations, every leaf on the device: XLA:TPU
does not compile the layer-streamed update of host-resident bf16 state, and 13B's state
does not fit the chip, so its compile is refused and reported as such):

- `jaxpr`: `ox.estimate(...).flops`, the matmul FLOPs counted on the traced program,
  scan bodies times their length, recomputation included;
- `simulated`: the FLOPs of the dots in the compiled program as the simulation ran them
  (`StepEstimate.simulation.flops`: every `while` body times its trip count);
- `compiled once`: the dots of the step compiled for this machine's CPU with every
  computation counted once, beside XLA's `compiled.cost_analysis()["flops"]` of that
  compile, which counts each `while` body once too and adds the elementwise work (its
  figure is the larger by that). A compile for a GPU without the hardware has no cost
  analysis (`cost_analysis()` returns None), so the CPU compiler stands in.

    JAX_PLATFORMS=cpu python benchmarks/compiled_flops.py          # 1B, 8B, 13B: minutes
    JAX_PLATFORMS=cpu python benchmarks/compiled_flops.py --smoke  # 1B on h100 only
    ... --targets h100 tpu-v5p                                     # both targets

Writes `benchmarks/results/compiled_flops.json`.
"""

import argparse
import json
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v5p-8")
os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "experiments"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from _decoder import CONFIGS, STRATEGIES, abstract_state, make_step, optimizer_for  # noqa: E402

import offload_eqx as ox  # noqa: E402
from offload_eqx._inspect.memory_report import compiled_report  # noqa: E402
from offload_eqx._planning.hlo import parse_module  # noqa: E402
from offload_eqx._planning.kernels import inner_flops  # noqa: E402
from offload_eqx._targets.deviceless import program_of_step  # noqa: E402

RESULTS = os.path.join(HERE, "results")


STRATEGY = {"h100": "hybrid", "tpu-v5p": "qkv_offload"}


def measure(size: str, target: str = "h100") -> dict:
    config, strategy = CONFIGS[size], STRATEGY[target]
    model, state = abstract_state(config, strategy)
    step = make_step(optimizer_for(strategy, config), STRATEGIES[strategy])
    tokens = jax.ShapeDtypeStruct((1, config.seq + 1), jnp.int32)
    begin = time.perf_counter()
    try:
        estimate = ox.estimate(step, model, state, tokens, target=target)
    except Exception as error:  # XLA refuses a step over the chip's memory: reported
        first = str(error).splitlines()[0][:160]
        return {"size": size, "target": target, "strategy": strategy, "error": first}
    _, compiled = compiled_report(
        program_of_step(step, (model, state, tokens), {}), ox.TARGETS["cpu"], size
    )
    module = parse_module(compiled.as_text())
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    assert estimate.simulation is not None
    return {
        "size": size,
        "target": target,
        "strategy": strategy,
        "jaxpr": estimate.flops,
        "simulated": estimate.simulation.flops,
        "compiled_once": inner_flops(module, module.entry),
        "cost_analysis": float(cost.get("flops", 0.0)),
        "seconds": time.perf_counter() - begin,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="1B on h100 only")
    parser.add_argument("--targets", nargs="+", choices=sorted(STRATEGY), default=["h100"])
    args = parser.parse_args()
    sizes = ("1B",) if args.smoke else ("1B", "8B", "13B")
    targets = ("h100",) if args.smoke else args.targets
    rows = [measure(size, target) for target in targets for size in sizes]
    print(
        "target | size | jaxpr TFLOP | simulated TFLOP | simulated/jaxpr | compiled once | "
        "cost_analysis | once/cost"
    )
    for r in rows:
        if "error" in r:
            print(f"{r['target']} | {r['size']} | not compiled: {r['error']}")
            continue
        print(
            f"{r['target']} | {r['size']} | {r['jaxpr'] / 1e12:.3f} | "
            f"{r['simulated'] / 1e12:.3f} | "
            f"{r['simulated'] / r['jaxpr']:.4f} | {r['compiled_once'] / 1e12:.4f} | "
            f"{r['cost_analysis'] / 1e12:.4f} | {r['compiled_once'] / r['cost_analysis']:.4f}"
        )
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, "compiled_flops.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
