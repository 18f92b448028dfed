"""`ox.offload_optimizer(stream="leaf" | "layer")`: the same training as plain optax, one
parameter's (one layer's) state on the device at a time."""

import os
from typing import Any, cast

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import offload_eqx as ox
from offload_eqx._optimizer.checks import check_elementwise, check_per_leaf
from offload_eqx._optimizer.state import OffloadedState, StreamState


class MLP(eqx.Module):
    w1: jax.Array = ox.field(memory="device")
    w2: jax.Array = ox.field(memory="device")
    w3: jax.Array = ox.field(memory="device")
    w4: jax.Array = ox.field(memory="device")

    def __call__(self, x):
        for w in (self.w1, self.w2, self.w3, self.w4):
            x = jax.nn.gelu(x @ w)
        return x


def loss_fn(model, x):
    l2 = 0.001 * sum(jnp.sum(w**2) for w in jax.tree_util.tree_leaves(model))
    return jnp.mean((model(x) - x) ** 2) + l2


def _model(dim) -> Any:
    # Any: optax's stubs type params as arrays, not as modules.
    keys = jax.random.split(jax.random.key(0), 4)
    return MLP(*[jax.random.normal(k, (dim, dim)) * 0.1 for k in keys])


def _make_step(opt):
    def step(model, state, x):
        grads = jax.grad(loss_fn)(model, x)
        updates, state = opt.update(grads, state, model)
        return ox.apply_updates(model, updates), state

    return step


@pytest.mark.parametrize(
    "per_leaf, global_transform",
    [
        (optax.adam(0.1), optax.clip_by_global_norm(1.0)),
        (optax.adamw(1e-2, weight_decay=0.1), None),
        (optax.sgd(1e-2, momentum=0.9), optax.clip_by_global_norm(0.5)),
    ],
    ids=["clip_adam", "adamw", "clip_sgd_momentum"],
)
@pytest.mark.parametrize("strategy", ["offload_optimizer", "baseline"])
def test_matches_plain_optax(per_leaf, global_transform, strategy):
    x = jax.random.normal(jax.random.key(1), (32, 32))
    reference_opt = (
        per_leaf if global_transform is None else optax.chain(global_transform, per_leaf)
    )
    reference, reference_state = _model(32), reference_opt.init(_model(32))
    opt = ox.offload_optimizer(per_leaf, stream="leaf", global_transform=global_transform)
    model = ox.place(_model(32), strategy)
    state = cast(OffloadedState, opt.init(model))
    step = ox.filter_jit(_make_step(opt), strategy=strategy, donate="all")
    reference_step = jax.jit(_make_step(reference_opt))
    for _ in range(3):
        model, state = step(model, state, x)
        reference, reference_state = reference_step(reference, reference_state, x)
    # Not bitwise: XLA's algebraic simplifier rewrites a division by a shared scalar (Adam's
    # bias corrections) differently in a per-leaf computation: about 1 ulp per step, which
    # Adam (lr 0.1) turns into absolute differences of about 2e-6 on weights of 0.1.
    for a, b in zip(jax.tree_util.tree_leaves(model), jax.tree_util.tree_leaves(reference)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
    # The per-leaf states have the parameters' structure: a leaf's path names its parameter.
    assert isinstance(state.inner, StreamState) and isinstance(state.inner.leaves, MLP)
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(state)]
    assert any(p.startswith(".inner.leaves.w3[") for p in paths), paths
    if strategy == "offload_optimizer":
        kinds = {
            leaf.sharding.memory_kind
            for leaf in jax.tree_util.tree_leaves(state.inner.leaves)
            if leaf.ndim == 2
        }
        assert kinds == {"pinned_host"}


def test_one_cond_per_leaf_with_an_opaque_predicate():
    opt = ox.offload_optimizer(
        optax.adam(0.1), stream="leaf", global_transform=optax.clip_by_global_norm(1)
    )
    model = _model(8)
    state = opt.init(model)
    x = jnp.ones((8, 8))
    jaxpr = jax.make_jaxpr(_make_step(opt))(model, state, x)
    conds = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "cond"]
    barriers = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "optimization_barrier"]
    assert len(conds) == 4 and len(barriers) == 4


def test_coupling_transformation_is_rejected():
    coupled = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(0.1))
    with pytest.raises(ValueError, match="couples parameters.*global_transform=.*stream=None"):
        check_per_leaf(coupled, _model(4))
    check_per_leaf(optax.adamw(0.1), _model(4))  # elementwise: accepted


def test_a_jitted_transformation_is_followed_into_its_call():
    # Written under `jax.jit` (as some optax versions and user code are), the update traces
    # as one call equation with every leaf in and out: its body says what depends on what.
    adamw = optax.adamw(0.1)
    jitted = optax.GradientTransformation(adamw.init, jax.jit(adamw.update))
    check_per_leaf(jitted, _model(4))
    clipped = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(0.1))
    with pytest.raises(ValueError, match="couples parameters"):
        check_per_leaf(
            optax.GradientTransformation(clipped.init, jax.jit(clipped.update)), _model(4)
        )


def test_coupling_is_reported_at_init():
    opt = ox.offload_optimizer(
        optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(0.1)), stream="leaf"
    )
    with pytest.raises(ValueError, match="couples parameters"):
        opt.init(_model(4))
    # `check=False` skips the check (the caller vouches for the transformation).
    ox.offload_optimizer(optax.adam(0.1), stream="leaf", check=False).init(_model(4))


def test_foreign_state_is_an_error():
    opt = ox.offload_optimizer(optax.adam(0.1), stream="leaf")
    model = _model(4)
    with pytest.raises(TypeError, match="not the state returned"):
        opt.update(model, optax.adam(0.1).init(model), model)


@pytest.mark.deviceless
def test_h100_total_reaches_the_published_number():
    """The tutorial's workload (DIM 7168, compile-only): published 2.87 GiB with the state
    offloaded; the whole-state fetch (`stream=None`) gives 3.83 GiB here."""
    pytest.importorskip("jax_plugins.xla_cuda12", reason="needs the 'cuda' extra")
    assert os.environ.get("JAX_PLATFORMS") == "cpu", "deviceless compiles need JAX_PLATFORMS=cpu"
    w = jax.ShapeDtypeStruct((7168, 7168), jnp.float32)
    model = cast(Any, MLP)(w, w, w, w)
    opt = ox.offload_optimizer(
        optax.adam(0.1), stream="leaf", global_transform=optax.clip_by_global_norm(1.0)
    )
    state = eqx.filter_eval_shape(opt.init, model)
    step = ox.filter_jit(_make_step(opt), strategy="offload_optimizer", donate="all")
    report = ox.memory_report(step, model, state, w, target="h100")
    p = 7168 * 7168 * 4
    assert report.host["argument"] == 8 * p  # mu and nu of 4 weights (counts stay on the device)
    assert report.total <= 2.87 * 2**30


class Layer(eqx.Module):
    w: jax.Array = ox.field(memory="pinned_host")
    b: jax.Array = ox.field(memory="pinned_host")

    def __call__(self, x):
        return jnp.tanh(x @ self.w + self.b)


class Stacked(eqx.Module):
    layers: Layer
    head: jax.Array  # not managed: stays on the device, updated whole

    def __call__(self, x):
        return ox.scan(self.layers, x) @ self.head


def _stacked(layers=4, dim=16) -> Any:
    k = jax.random.split(jax.random.key(0), 3)
    return Stacked(
        Layer(
            jax.random.normal(k[0], (layers, dim, dim)) * 0.3,
            jax.random.normal(k[1], (layers, dim)) * 0.1,
        ),
        jax.random.normal(k[2], (dim, dim)) * 0.3,
    )


_HOST = ox.Strategy("host", params="pinned_host", optimizer="pinned_host", activations="remat")


@pytest.mark.parametrize("fused", [False, True], ids=["update", "update_and_apply"])
@pytest.mark.parametrize("strategy", [_HOST, "baseline"], ids=["host", "baseline"])
def test_streamed_layers_match_plain_optax(fused, strategy):
    x = jax.random.normal(jax.random.key(5), (8, 16))

    def loss(model):
        return jnp.mean((model(x) - x) ** 2)

    reference_opt = optax.adamw(0.05, weight_decay=0.1)
    opt = ox.offload_optimizer(optax.adamw(0.05, weight_decay=0.1), stream="layer", layers=4)

    def step(model, state):
        grads = jax.grad(loss)(model)
        if fused:
            return ox.update_and_apply(opt, grads, state, model)
        updates, state = opt.update(grads, state, model)
        return ox.apply_updates(model, updates), state

    @jax.jit
    def reference_step(model, state):
        updates, state = reference_opt.update(jax.grad(loss)(model), state, model)
        return optax.apply_updates(model, updates), state

    model = ox.place(_stacked(), strategy)
    state: Any = opt.init(model)
    reference, reference_state = _stacked(), reference_opt.init(_stacked())
    jitted = ox.filter_jit(step, strategy=strategy, donate="all")
    for _ in range(3):
        model, state = jitted(model, state)
        reference, reference_state = reference_step(reference, reference_state)
    # About 1 ulp per step, not bitwise (as for whole leaves, see above).
    for a, b in zip(jax.tree_util.tree_leaves(model), jax.tree_util.tree_leaves(reference)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    leaves = state.inner.leaves
    counts = [leaves.layers.w[0].count, leaves.layers.b[0].count, leaves.head[0].count]
    assert [int(c) for c in counts] == [3, 3, 3]
    if strategy is _HOST:
        assert model.layers.w.sharding.memory_kind == "pinned_host"
        assert leaves.layers.w[0].mu.sharding.memory_kind == "pinned_host"


def test_stacked_leaves_run_in_a_loop_over_layers():
    opt = ox.offload_optimizer(optax.adam(0.1), stream="layer", layers=4)
    model = _stacked()
    state = opt.init(model)

    def step(model, state):
        grads = jax.grad(lambda m: jnp.sum(m(jnp.ones((2, 16)))))(model)
        return ox.update_and_apply(opt, grads, state, model)

    jaxpr = jax.make_jaxpr(step)(model, state)
    names = [e.primitive.name for e in jaxpr.jaxpr.eqns]
    # w and b (leading dimension 4) each in a loop of 4 iterations; the head in a cond.
    loops = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "scan"]
    assert names.count("cond") == 1
    assert [e.params["length"] for e in loops[-2:]] == [4, 4]


def test_non_elementwise_transformation_cannot_stream():
    with pytest.raises(
        ValueError, match=r"on `params\.layers\.w` is not elementwise.*stream='leaf'"
    ):
        ox.offload_optimizer(optax.lamb(0.1), stream="layer", layers=4).init(_stacked())
    with pytest.raises(ValueError, match="state leaf of shape"):
        check_elementwise(optax.adafactor(0.1), jnp.zeros((4, 16, 16)))
    check_elementwise(optax.adamw(0.1), jnp.zeros((4, 16, 16)))
    with pytest.raises(ValueError, match="positive int"):
        ox.offload_optimizer(optax.adam(0.1), stream="layer", layers=0)


def test_update_and_apply_takes_the_streamed_path():
    opt = ox.offload_optimizer(optax.adam(0.1), stream="leaf")
    model = _model(8)
    state = opt.init(model)
    x = jnp.ones((8, 8))

    def fused(model, state):
        return ox.update_and_apply(opt, jax.grad(loss_fn)(model, x), state, model)

    # The new parameters are computed inside each leaf's `cond`: four conds, and no add
    # of a parameter and its update outside them.
    jaxpr = jax.make_jaxpr(fused)(model, state)
    names = [e.primitive.name for e in jaxpr.jaxpr.eqns]
    assert names.count("cond") == 4
    new_model, new_state = jax.jit(fused)(model, state)
    reference_model, reference_state = jax.jit(_make_step(opt))(model, state, x)
    for a, b in zip(
        jax.tree_util.tree_leaves(new_model), jax.tree_util.tree_leaves(reference_model)
    ):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)
    with pytest.raises(ValueError, match=r"needs the parameters.*ox\.update_and_apply\(opt, grads"):
        ox.update_and_apply(opt, jax.grad(loss_fn)(model, x), state, None)
