"""`ox.offload_optimizer` with the optax transformations users reach for."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import loss_fn, scanned_model, to_numpy

import offload_eqx as ox


def _labels(model):
    return jax.tree_util.tree_map(lambda _: "adam", eqx.filter(model, eqx.is_array))


TRANSFORMS = {
    "chain_clip_adam": lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2)),
    "adamw": lambda: optax.adamw(1e-2, weight_decay=0.1),
    "sgd_momentum": lambda: optax.sgd(1e-2, momentum=0.9),
    "inject_hyperparams": lambda: optax.inject_hyperparams(optax.adam)(learning_rate=1e-2),
    "multi_transform": lambda: optax.multi_transform(
        {"adam": optax.adam(1e-2), "sgd": optax.sgd(1e-3)},
        lambda model: eqx.tree_at(lambda m: m.layers.w2, _labels(model), "sgd"),
    ),
}


def _reference(model, transform, x, steps):
    state = transform.init(model)
    for _ in range(steps):
        grads = jax.grad(loss_fn)(model, x)
        updates, state = transform.update(grads, state, model)
        model = eqx.apply_updates(model, updates)
    return model


@pytest.mark.parametrize("name", list(TRANSFORMS))
@pytest.mark.parametrize("strategy", ["annotated", "hybrid", "offload_optimizer"])
def test_matches_plain_optax(name, strategy):
    x = jax.random.normal(jax.random.key(1), (8, 16))
    reference = _reference(scanned_model(jax.random.key(0)), TRANSFORMS[name](), x, steps=3)

    opt = ox.offload_optimizer(TRANSFORMS[name]())
    model = ox.place(scanned_model(jax.random.key(0)), strategy)
    state = opt.init(model)

    @ox.filter_jit(strategy=strategy, donate="all")
    def step(model, state, x):
        grads = eqx.filter_grad(loss_fn)(model, x)
        updates, state = opt.update(grads, state, model)
        return ox.apply_updates(model, updates), state

    for _ in range(3):
        model, state = step(model, state, x)
    for a, b in zip(
        jax.tree_util.tree_leaves(to_numpy(model)), jax.tree_util.tree_leaves(to_numpy(reference))
    ):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    # Non-scalar state in host memory, scalars (step counts, hyperparameters) on device.
    for leaf in jax.tree_util.tree_leaves(state):
        expected = "device" if leaf.ndim == 0 else "pinned_host"
        assert leaf.sharding.memory_kind == expected


def test_init_on_host_params_writes_state_straight_to_host():
    model = ox.place(scanned_model(jax.random.key(0)))
    opt = ox.offload_optimizer(optax.adam(1e-3))
    state = opt.init(model)
    assert isinstance(state, ox.OffloadedState)
    mu = state.inner[0].mu
    assert mu.layers.w1.sharding.memory_kind == "pinned_host"
    assert jax.typeof(mu.layers.w1).memory_space == jax.memory.Space.Host
    assert state.inner[0].count.sharding.memory_kind == "device"


def test_device_declared_state():
    opt = ox.offload_optimizer(optax.adam(1e-3), memory="device")
    state = opt.init(scanned_model(jax.random.key(0)))  # pyright: ignore[reportArgumentType]
    assert isinstance(state, ox.DeviceState)
    assert {leaf.sharding.memory_kind for leaf in jax.tree_util.tree_leaves(state)} == {"device"}


def test_apply_updates_keeps_host_params_on_host_and_skips_none():
    model = ox.place(scanned_model(jax.random.key(0)))
    updates = jax.tree_util.tree_map(
        lambda p: jnp.ones(p.shape, p.dtype), eqx.filter(model, eqx.is_array)
    )
    updates = eqx.tree_at(lambda u: u.layers.w2, updates, None, is_leaf=lambda x: x is None)

    @ox.filter_jit
    def apply(model, updates):
        return ox.apply_updates(model, updates)

    new = apply(model, updates)
    assert new.layers.w1.sharding.memory_kind == "pinned_host"
    np.testing.assert_allclose(
        np.asarray(new.layers.w1), np.asarray(model.layers.w1) + 1, rtol=1e-6
    )
    np.testing.assert_array_equal(np.asarray(new.layers.w2), np.asarray(model.layers.w2))
