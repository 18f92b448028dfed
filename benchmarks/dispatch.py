"""Per-call dispatch overhead of `ox.filter_jit` against `eqx.filter_jit` and `jax.jit`.

The function is tiny (a small `eqx.nn.MLP` on one vector), so a call's time is almost all
dispatch: flattening, the cache lookup and jax.jit's C++ fast path. The three are timed
in one run, interleaved, and the report gives ratios: absolute microseconds on a noisy
2-core machine mean little, their ratio does.

    python benchmarks/dispatch.py [--calls 2000] [--repeats 7]
"""

import argparse
import json
import os
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

import offload_eqx as ox


def _median_microseconds(fn, args, calls: int, repeats: int) -> float:
    jax.block_until_ready(fn(*args))
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            out = fn(*args)
        jax.block_until_ready(out)
        samples.append((time.perf_counter() - start) / calls * 1e6)
    return float(np.median(samples))


def run(calls: int = 2000, repeats: int = 7) -> dict[str, float]:
    model = eqx.nn.MLP(8, 8, 16, 2, key=jax.random.key(0))
    x = jnp.ones(8)

    def forward(model, x):
        return model(x)

    ours = ox.filter_jit(forward)
    theirs = eqx.filter_jit(forward)
    params, static = eqx.partition(model, eqx.is_array)
    presplit = jax.jit(lambda params, x: eqx.combine(params, static)(x))

    candidates = {
        "ox.filter_jit": (ours, (model, x)),
        "eqx.filter_jit": (theirs, (model, x)),
        "jax.jit (pre-split arrays)": (presplit, (params, x)),
    }
    times: dict[str, list[float]] = {name: [] for name in candidates}
    for _ in range(3):  # interleave, so drift in machine load hits all three alike
        for name, (fn, args) in candidates.items():
            times[name].append(_median_microseconds(fn, args, calls, repeats))
    result = {name: float(np.median(t)) for name, t in times.items()}
    result["ratio ox / eqx.filter_jit"] = result["ox.filter_jit"] / result["eqx.filter_jit"]
    result["ratio ox / jax.jit"] = result["ox.filter_jit"] / result["jax.jit (pre-split arrays)"]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--smoke", action="store_true", help="few calls, for CI")
    args = parser.parse_args()
    calls, repeats = (200, 3) if args.smoke else (args.calls, args.repeats)
    result = run(calls, repeats)
    print(f"{'function':<30} {'median µs per call':>20}")
    for name, value in result.items():
        if name.startswith("ratio"):
            print(f"{name:<30} {value:>20.2f}")
        else:
            print(f"{name:<30} {value:>20.1f}")
    os.makedirs("benchmarks/results", exist_ok=True)
    with open("benchmarks/results/dispatch.json", "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
