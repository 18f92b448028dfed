"""A per-layer plan that pays (issue 67): under a device budget halfway between saving a
name in every layer and recomputing it in every layer, `ox.fit` returns the name saved
in the first `k` layers, and it is faster than every plan that saves, offloads or
recomputes the name alike in every layer and fits.

The model makes saving worth it: each layer is `x + tanh(x @ w + b)` with the product
named `a`. Recomputing `a` is a 4096 x 4096 matrix product per layer (a quarter of the
layer's work, forward and backward); saving it costs its 64 MiB; offloading it moves
those bytes over the host link, slower than the layer computes. Shapes only, compiled
for an h100 without one (deviceless)."""

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
import pytest

import offload_eqx as ox

LAYERS, WIDTH, BATCH = 7, 4096, 4096
_MIB = 2**20


class Layer(eqx.Module):
    w: jax.Array
    b: jax.Array

    def __call__(self, x):
        a = ox.name(x @ self.w + self.b, "a")
        return x + jnp.tanh(a)


class Model(eqx.Module):
    layers: Layer
    activations: ox.Activations = ox.activations(a="save")

    def __call__(self, x):
        return ox.scan(self.layers, x)


def _shape(*shape) -> Any:
    return jax.ShapeDtypeStruct(shape, jnp.float32)


def _problem():
    model = Model(Layer(_shape(LAYERS, WIDTH, WIDTH), _shape(LAYERS, WIDTH)))
    optimizer = optax.adam(1e-3)
    state = eqx.filter_eval_shape(optimizer.init, model)

    def make(strategy):
        @ox.filter_jit(strategy=strategy, donate="all")
        def step(model, state, x):
            loss, grads = eqx.filter_value_and_grad(lambda m: jnp.mean(m(x) ** 2))(model)
            updates, state = optimizer.update(grads, state, model)
            return eqx.apply_updates(model, updates), state, loss

        return step

    return make, (model, state, _shape(BATCH, WIDTH))


def _uniform(policy):
    return ox.Strategy(
        f"a={policy}",
        params="device",
        optimizer="device",
        activations="remat",
        names={"a": policy},
    )


@pytest.mark.deviceless
def test_fit_finds_a_per_layer_plan_faster_than_every_uniform_plan_that_fits():
    pytest.importorskip("jax_plugins.xla_cuda12", reason="needs the 'cuda' extra")
    make, args = _problem()
    uniform = {
        policy: ox.estimate(make(_uniform(policy)), *args, target="h100")
        for policy in ("save", "remat", "offload")
    }
    save, remat = uniform["save"].device_bytes, uniform["remat"].device_bytes
    assert save is not None and remat is not None and save > remat
    budget = (save + remat) // 2
    result = ox.fit(make("baseline"), *args, target="h100", device_budget=budget, max_compiles=6)
    (policy,) = [p for n, p in result.strategy.names if n == "a"]
    assert isinstance(policy, ox.LayerSplit), result.table()
    assert (policy.first, policy.rest) == ("save", "remat") and 0 < policy.layers < LAYERS
    assert (result.estimate.device_bytes or 0) <= budget
    # Every plan that treats `a` alike in every layer and fits: the three above, and the
    # others `ox.fit` compiled (other placements, the base that saves everything).
    fitting = [e.seconds for e in uniform.values() if (e.device_bytes or 0) <= budget]
    fitting += [
        c.simulated_seconds
        for c in result.candidates
        if c.simulated_seconds is not None and "[:" not in c.label
    ]
    assert fitting, result.table()
    assert result.estimate.seconds <= 0.97 * min(fitting), result.table()
