"""How long `ox.audit` takes as the program grows: it should grow linearly with its size.

Audits one training step (value_and_grad, `ox.offload_optimizer(adam)`, `ox.apply_updates`)
of a stack of layers with host-resident weights and an offloaded activation, built two
ways: unrolled (`ox.checkpoint` in a Python loop, one region per layer in the program)
and scanned (`ox.scan`, one region whatever the depth). Nothing is compiled or run: the
arguments are `jax.ShapeDtypeStruct`s. Each row is the best of `--repeats` audits of a
fresh `ox.filter_jit` (so the trace is included; `walk s` is a second audit of the same
function, whose trace is cached), next to the number of equations in the program.

    JAX_PLATFORMS=cpu python benchmarks/audit_time.py            # 12, 24, 48 layers
    JAX_PLATFORMS=cpu python benchmarks/audit_time.py --smoke    # 2, 4 layers, once
"""

import argparse
import json
import time

import equinox as eqx
import jax
import jax.extend as jex
import jax.numpy as jnp
import optax

import offload_eqx as ox

S = jax.ShapeDtypeStruct


class Layer(eqx.Module):
    w1: jax.Array = ox.field(memory="pinned_host")
    w2: jax.Array = ox.field(memory="pinned_host")

    def __call__(self, x):
        x = ox.name(x, "x")
        return jnp.tanh(x @ self.w1) @ self.w2


class Scanned(eqx.Module):
    layers: Layer
    activations: ox.Activations = ox.activations(x="offload")

    def __call__(self, x):
        return ox.scan(self.layers, x)


class Unrolled(eqx.Module):
    layers: tuple[Layer, ...]
    activations: ox.Activations = ox.activations(x="offload")

    def __call__(self, x):
        for layer in self.layers:
            x = ox.checkpoint(layer, x)
        return x


def _model(kind: str, layers: int, width: int) -> eqx.Module:
    if kind == "scanned":
        return Scanned(
            Layer(
                S((layers, width, 4 * width), jnp.float32),
                S((layers, 4 * width, width), jnp.float32),
            )
        )
    return Unrolled(
        tuple(
            Layer(S((width, 4 * width), jnp.float32), S((4 * width, width), jnp.float32))
            for _ in range(layers)
        )
    )


def _equations(jaxpr) -> int:
    total = 0
    for eqn in jaxpr.eqns:
        total += 1
        for sub in jex.core.jaxprs_in_params(eqn.params):
            total += _equations(getattr(sub, "jaxpr", sub))
    return total


def _audit_once(kind: str, layers: int, width: int) -> tuple[float, int, int]:
    model = _model(kind, layers, width)
    opt = ox.offload_optimizer(optax.adam(1e-3))
    opt_state = eqx.filter_eval_shape(opt.init, model)
    x = S((width, width), jnp.float32)

    @ox.filter_jit
    def step(model, opt_state, x):
        loss, grads = eqx.filter_value_and_grad(lambda m: jnp.sum(m(x) ** 2))(model)
        updates, opt_state = opt.update(grads, opt_state, model)
        return ox.apply_updates(model, updates), opt_state, loss

    start = time.perf_counter()
    report = ox.audit(step, model, opt_state, x)
    cold = time.perf_counter() - start
    # Again on the same function: the trace is cached, what remains is the walk.
    start = time.perf_counter()
    ox.audit(step, model, opt_state, x)
    warm = time.perf_counter() - start
    entry, leaves = step.compilation(model, opt_state, x)
    equations = _equations(jax.make_jaxpr(entry.flat)(*entry.abstract(leaves)).jaxpr)
    return cold, warm, equations, len(report.transfers)


def run(depths=(12, 24, 48), width: int = 64, repeats: int = 3) -> list[dict]:
    rows = []
    for kind in ("scanned", "unrolled"):
        for layers in depths:
            runs = [_audit_once(kind, layers, width) for _ in range(repeats)]
            cold = min(r[0] for r in runs)
            warm = min(r[1] for r in runs)
            _, _, equations, transfers = runs[0]
            rows.append(
                {
                    "program": kind,
                    "layers": layers,
                    "equations": equations,
                    "transfers": transfers,
                    "seconds": cold,
                    "walk_seconds": warm,
                    "us_per_equation": 1e6 * cold / equations,
                }
            )
    return rows


def _print(rows: list[dict]) -> None:
    header = (
        f"{'program':<9} {'layers':>6} {'equations':>9} {'transfers':>9} {'audit s':>8} "
        f"{'walk s':>7} {'us/eqn':>7}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        print(
            f"{r['program']:<9} {r['layers']:>6} {r['equations']:>9} {r['transfers']:>9} "
            f"{r['seconds']:>8.3f} {r['walk_seconds']:>7.3f} {r['us_per_equation']:>7.0f}"
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[12, 24, 48])
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", help="also write the rows to this JSON file")
    parser.add_argument("--smoke", action="store_true", help="2 and 4 layers, one repeat")
    args = parser.parse_args()
    if args.smoke:
        args.layers, args.repeats = [2, 4], 1
    rows = run(tuple(args.layers), args.width, args.repeats)
    _print(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
