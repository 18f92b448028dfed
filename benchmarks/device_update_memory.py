"""Device memory of a training step whose optimizer state lives in host memory and is
updated on the device, per `stream`, against plain Equinox + optax with everything on the
device and against the update on the host: the real XLA:GPU compiler, deviceless.

Weights of `--dim` x `--dim` float32 (`x @ w`, then `tanh`) in pinned host memory, Adam,
batch `--batch`: one weight, `--layers` weights in a list, and the same weights stacked
and applied with `ox.scan` (for `stream="layer"`). The step computes the gradients with
`eqx.filter_grad` and applies the update with `opt.update` + `ox.apply_updates` or with
`ox.update_and_apply`, compiled by `ox.filter_jit(..., donate="all")`. The table in the
optimizer guide (`docs/guides/optimizer.md`) is this script's output.

    JAX_PLATFORMS=cpu python benchmarks/device_update_memory.py [--dim 2048] [--layers 4]
"""

import argparse
import json
import os
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import optax

import offload_eqx as ox

_MIB = 2**20


class Layer(eqx.Module):
    w: jax.Array = ox.field(memory="pinned_host")

    def __call__(self, x):
        return jnp.tanh(x @ self.w)


class Plain(eqx.Module):
    w: jax.Array

    def __call__(self, x):
        return jnp.tanh(x @ self.w)


class Listed(eqx.Module):
    layers: list

    def __call__(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


class Stacked(eqx.Module):
    layers: Layer

    def __call__(self, x):
        return ox.scan(self.layers, x)


def _step(opt: Any, fused: bool):
    def step(model, state, x):
        grads = eqx.filter_grad(lambda m: jnp.mean(m(x) ** 2))(model)
        if fused:
            return ox.update_and_apply(opt, grads, state, model)
        updates, state = opt.update(grads, state, model)
        return ox.apply_updates(model, updates), state

    return step


def _plain_step(model, state, x):
    grads = eqx.filter_grad(lambda m: jnp.mean(m(x) ** 2))(model)
    updates, state = optax.adam(1e-3).update(grads, state, model)
    return eqx.apply_updates(model, updates), state


def _report(step: Any, model: Any, opt: Any, x: Any) -> float:
    state = eqx.filter_eval_shape(opt.init, model)
    report = ox.memory_report(ox.filter_jit(step, donate="all"), model, state, x, target="h100")
    return report.total / _MIB


def _rows(dim: int, layers: int, batch: int) -> list[tuple[str, str, float]]:
    w = jax.ShapeDtypeStruct((dim, dim), jnp.float32)
    stacked_w = jax.ShapeDtypeStruct((layers, dim, dim), jnp.float32)
    x = jax.ShapeDtypeStruct((batch, dim), jnp.float32)
    rows = []
    for count in (1, layers):
        label = f"{count} weight" + ("s" if count > 1 else "")
        plain: Any = Listed([Plain(w) for _ in range(count)])  # type: ignore[arg-type]
        model: Any = Listed([Layer(w) for _ in range(count)])  # type: ignore[arg-type]
        rows.append(
            (label, "plain Equinox + optax", _report(_plain_step, plain, optax.adam(1e-3), x))
        )
        for stream in (None, "leaf"):
            for fused in (False, True):
                opt = ox.offload_optimizer(optax.adam(1e-3), stream=stream)
                how = "ox.update_and_apply" if fused else "opt.update"
                rows.append(
                    (label, f"stream={stream!r}, {how}", _report(_step(opt, fused), model, opt, x))
                )
        host = ox.offload_optimizer(optax.adam(1e-3), update_on="host")
        rows.append((label, "update_on='host'", _report(_step(host, False), model, host, x)))
    stacked: Any = Stacked(Layer(stacked_w))  # type: ignore[arg-type]
    layer = ox.offload_optimizer(optax.adam(1e-3), stream="layer", layers=layers)
    label = f"{layers} weights stacked (ox.scan)"
    rows.append(
        (
            label,
            "stream='layer', ox.update_and_apply",
            _report(_step(layer, True), stacked, layer, x),
        )
    )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--smoke", action="store_true", help="width 256, 2 layers")
    args = parser.parse_args()
    dim, layers = (256, 2) if args.smoke else (args.dim, args.layers)
    rows = _rows(dim, layers, args.batch)
    print(
        f"h100 deviceless, Adam, float32 weights {dim} x {dim} in pinned_host, batch {args.batch}"
    )
    print("| model | optimizer | device MiB |\n|---|---|---|")
    for model, opt, mib in rows:
        print(f"| {model} | {opt} | {mib:.1f} |")
    os.makedirs("benchmarks/results", exist_ok=True)
    with open("benchmarks/results/device_update_memory.json", "w") as f:
        json.dump({"jax": jax.__version__, "dim": dim, "layers": layers, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
