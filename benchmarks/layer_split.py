"""What a name saved in only some layers of a scan costs: device memory and simulated
step time of uniform plans against per-layer splits (`ox.LayerSplit`), and the plan
`ox.fit` returns under a device budget halfway between saving everywhere and
recomputing everywhere. Deviceless h100, the real XLA:GPU compiler.

Two models: the README's layer (`x + tanh(x @ w1) @ w2`, `h` named), 8 layers of
1024 x 4096 in float32, batch 2048, plain Adam; and the experiments' decoder at the
planner tests' size (`tests/fit_problem.py`: 4 layers of width 128, q, k and v named).
Each split saves the names in the first `k` layers of the scan and recomputes them in the
rest. The planning guide's "Plans per layer" table is this script's output.

    JAX_PLATFORMS=cpu python benchmarks/layer_split.py [--smoke]
"""

import argparse
import json
import os
import pathlib
import sys
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import optax

import offload_eqx as ox

_MIB = 2**20
ROOT = pathlib.Path(__file__).resolve().parents[1]


class Layer(eqx.Module):
    w1: jax.Array
    w2: jax.Array

    def __call__(self, x):
        h = ox.name(jnp.tanh(x @ self.w1), "h")
        return x + h @ self.w2


class Model(eqx.Module):
    layers: Layer
    activations: ox.Activations = ox.activations(h="save")

    def __call__(self, x):
        return ox.scan(self.layers, x)


def readme_problem(dim: int, hidden: int, layers: int, batch: int) -> tuple:
    def shape(*s):
        return jax.ShapeDtypeStruct(s, jnp.float32)

    model: Any = Model(Layer(shape(layers, dim, hidden), shape(layers, hidden, dim)))
    opt = optax.adam(1e-3)
    state = eqx.filter_eval_shape(opt.init, model)

    def make(strategy: Any) -> Any:
        @ox.filter_jit(strategy=strategy, donate="all")
        def step(model, state, x):
            loss, grads = eqx.filter_value_and_grad(lambda m: jnp.mean(m(x) ** 2))(model)
            updates, state = opt.update(grads, state, model)
            return eqx.apply_updates(model, updates), state, loss

        return step

    return make, (model, state, shape(batch, dim)), ("h",), layers


def _decoder_problem() -> tuple:
    sys.path.insert(0, str(ROOT / "tests"))
    try:
        import fit_problem  # pyright: ignore[reportMissingImports]
    finally:
        sys.path.remove(str(ROOT / "tests"))
    problem = fit_problem.make_problem()
    return (
        lambda strategy: fit_problem.step_of(problem, strategy),
        problem[1],
        ("q", "k", "v"),
        fit_problem.CONFIG.layers,
    )


def _plans(names: tuple, layers: int) -> list[tuple[str, Any]]:
    def strategy(label: str, policy: Any) -> ox.Strategy:
        return ox.Strategy(
            label,
            params="device",
            optimizer="device",
            activations="remat",
            names={n: policy for n in names},
        )

    plans = [("save in every layer", strategy("save", "save"))]
    plans.append(("recompute in every layer", strategy("remat", "remat")))
    for k in sorted({1, layers // 2, layers - 1} - {0, layers}):
        plans.append((f"save in the first {k}", strategy(f"split{k}", ("save", k, "remat"))))
    return plans


def rows_of(label: str, problem: tuple) -> list[dict]:
    make, args, names, layers = problem
    rows, estimates = [], {}
    for what, strategy in _plans(names, layers):
        estimate = ox.estimate(make(strategy), *args, target="h100")
        estimates[what] = estimate
        rows.append(
            {
                "model": label,
                "plan": what,
                "device MiB": estimate.device_bytes / _MIB,
                "sim ms": estimate.seconds * 1e3,
                "count ms": (estimate.traced_seconds or 0.0) * 1e3,
            }
        )
    save = estimates["save in every layer"].device_bytes
    remat = estimates["recompute in every layer"].device_bytes
    budget = (save + remat) // 2
    result = ox.fit(make("baseline"), *args, target="h100", device_budget=budget)
    rows.append(
        {
            "model": label,
            "plan": f"ox.fit, budget {budget / _MIB:.1f} MiB: {result.strategy.name}",
            "budget MiB": budget / _MIB,
            "device MiB": (result.estimate.device_bytes or 0) / _MIB,
            "sim ms": result.estimate.seconds * 1e3,
            "count ms": (result.estimate.traced_seconds or 0.0) * 1e3,
        }
    )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="the README model at width 256")
    args = parser.parse_args()
    size = (256, 1024, 4, 256) if args.smoke else (1024, 4096, 8, 2048)
    rows = rows_of(f"README layer x{size[2]}", readme_problem(*size))
    rows += rows_of("decoder (planner tests)", _decoder_problem())
    print("| model | plan | device MiB | sim ms | count ms |\n|---|---|---|---|---|")
    for row in rows:
        print(
            f"| {row['model']} | {row['plan']} | {row['device MiB']:.1f} | "
            f"{row['sim ms']:.3f} | {row['count ms']:.3f} |"
        )
    os.makedirs(ROOT / "benchmarks" / "results", exist_ok=True)
    with open(ROOT / "benchmarks" / "results" / "layer_split.json", "w") as f:
        json.dump({"jax": jax.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
