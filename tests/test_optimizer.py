"""`ox.offload_optimizer` (whole-state fetch) with the optax transformations users reach
for; the options it validates when wrapping; the errors on state it did not make;
`ox.update_and_apply` for any transformation."""

from typing import Any, NamedTuple, cast

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import loss_fn, rotated, scanned_model, to_numpy

import offload_eqx as ox
from offload_eqx._optimizer.state import DeviceState, OffloadedState


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


def _reference(model, transform, x, steps, stale=False):
    """`steps` updates by plain optax; `stale`: each with the initial model's gradient."""
    state = transform.init(model)
    first = jax.grad(loss_fn)(model, x)
    for _ in range(steps):
        grads = first if stale else jax.grad(loss_fn)(model, x)
        updates, state = transform.update(grads, state, model)
        model = eqx.apply_updates(model, updates)
    return model


# Each transformation under the model's declarations and, in turn, one of the strategies
# that move the whole state to the host (both with `--full`).
@pytest.mark.parametrize(
    "name, strategy",
    rotated(list(TRANSFORMS), ["annotated", "hybrid", "offload_optimizer"], ("annotated",)),
)
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


class ValuesState(NamedTuple):
    every: int  # Python values the update branches on (issue 37, item 8)
    mode: str
    mu: Any


def with_python_values(count_in_python: bool = False) -> optax.GradientTransformation:
    """Momentum whose state holds a Python int and a str that its update reads."""

    def init(params):
        return ValuesState(2, "momentum", jax.tree.map(jnp.zeros_like, params))

    def update(grads, state, params=None):
        assert isinstance(state.every, int) and isinstance(state.mode, str)
        if state.mode == "momentum":
            mu = jax.tree.map(lambda m, g: 0.9 * m + g, state.mu, grads)
        else:
            mu = grads
        every = state.every + 1 if count_in_python else state.every
        return jax.tree.map(lambda m: -1e-2 / state.every * m, mu), ValuesState(
            every, "momentum", mu
        )

    return optax.GradientTransformation(cast(Any, init), cast(Any, update))


PYTHON_VALUE_MODES = {
    "device": {},
    "memory_device": {"memory": "device"},
    "host": {"update_on": "host"},
    "stream_leaf": {"stream": "leaf"},
    "stream_layer": {"stream": "layer", "layers": 3},
    "delay": {"delay": 1},
    "delay_host": {"delay": 1, "update_on": "host"},
}


@pytest.mark.parametrize("mode", list(PYTHON_VALUE_MODES))
def test_python_values_in_the_state_pass_through_untouched(mode):
    x = jax.random.normal(jax.random.key(1), (8, 16))
    options = PYTHON_VALUE_MODES[mode]
    opt = ox.offload_optimizer(with_python_values(), **options)
    model = ox.place(scanned_model(jax.random.key(0)))
    state = opt.init(model)

    def values_of(state):
        return [v for v in jax.tree.leaves(state) if not eqx.is_array(v)]

    # One (every, mode) pair for the whole state, or one per parameter when streamed.
    assert values_of(state) == [2, "momentum"] * (2 if "stream" in options else 1)

    @ox.filter_jit(donate="all")
    def step(model, state, x):
        grads = eqx.filter_grad(loss_fn)(model, x)
        return ox.update_and_apply(opt, grads, state, model)

    delayed = "delay" in options
    for _ in range(3 if delayed else 2):
        model, state = step(model, state, x)
    assert values_of(state) == [2, "momentum"] * (2 if "stream" in options else 1)
    # Delayed: the first step applies nothing, the next two the gradients of the first
    # two, both taken at the initial parameters.
    reference = _reference(
        scanned_model(jax.random.key(0)), with_python_values(), x, steps=2, stale=delayed
    )
    for a, b in zip(jax.tree.leaves(to_numpy(model)), jax.tree.leaves(to_numpy(reference))):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_a_python_value_the_update_changes_is_named_where_a_step_may_not_update():
    # A delayed update decides at run time whether to update: a value it changes
    # cannot be the result of that choice.
    opt = ox.offload_optimizer(with_python_values(count_in_python=True), delay=1)
    model = ox.place(scanned_model(jax.random.key(0)))
    state = opt.init(model)
    step = ox.filter_jit(
        lambda m, s, x: ox.update_and_apply(opt, eqx.filter_grad(loss_fn)(m, x), s, m)
    )
    with pytest.raises(
        ValueError,
        match=r"`opt_state.inner.state.every` is the Python value 3 after an update and 2 "
        r"after a step that applies no gradient.*must be an array.*`jnp.asarray\(2\)`",
    ):
        step(model, state, jnp.ones((8, 16)))


def test_init_on_host_params_writes_state_straight_to_host():
    model = ox.place(scanned_model(jax.random.key(0)))
    opt = ox.offload_optimizer(optax.adam(1e-3))
    state = opt.init(model)
    assert isinstance(state, OffloadedState)
    mu = state.inner[0].mu
    assert mu.layers.w1.sharding.memory_kind == "pinned_host"
    assert jax.typeof(mu.layers.w1).memory_space == jax.memory.Space.Host
    assert state.inner[0].count.sharding.memory_kind == "device"


def test_device_declared_state():
    opt = ox.offload_optimizer(optax.adam(1e-3), memory="device")
    state = opt.init(scanned_model(jax.random.key(0)))  # pyright: ignore[reportArgumentType]
    assert isinstance(state, DeviceState)
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


# -- options, validated when wrapping ------------------------------------------------------


def test_a_factory_instead_of_a_transformation_is_refused_when_wrapping():
    with pytest.raises(TypeError, match=r"`tx` is <function adam.*Call it.*optax\.adam\(1e-3\)"):
        ox.offload_optimizer(optax.adam)
    with pytest.raises(TypeError, match=r"global_transform=\.\.\.\) is <function.*Call it"):
        ox.offload_optimizer(optax.adam(1e-3), global_transform=optax.clip_by_global_norm)
    with pytest.raises(TypeError, match=r"is 'adam' \(a str\); expected an `optax\.Gradient"):
        ox.offload_optimizer("adam")


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (
            {"stream": "layers"},
            r"stream=\.\.\.\) is 'layers'; expected one of None.*'leaf'.*'layer'",
        ),
        ({"stream": "layer"}, r"needs `layers`.*positive int\); got None"),
        ({"stream": "layer", "layers": 0}, r"positive int\); got 0"),
        ({"stream": "layer", "layers": True}, r"positive int\); got True"),
        ({"stream": "leaf", "layers": 4}, r"layers=4\) is only used with `stream='layer'`"),
        ({"layers": 4}, r"layers=4\) is only used with `stream='layer'`.*stream=None"),
        ({"memory": "gpu"}, r"memory=\.\.\.\) has memory 'gpu'; expected one of 'device'"),
    ],
)
def test_options_are_validated_when_wrapping(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ox.offload_optimizer(optax.adam(1e-3), **kwargs)


# -- state it did not make, and leaves it does not optimize --------------------------------


class WithCounter(eqx.Module):
    w: jax.Array
    steps: jax.Array  # an int leaf: not optimized, left unchanged


@pytest.mark.parametrize("stream", [None, "leaf"])
def test_integer_leaves_get_no_state_and_stay_unchanged(stream):
    model: Any = WithCounter(jnp.ones((3, 3)), jnp.arange(3))
    opt = ox.offload_optimizer(optax.adam(0.1), stream=stream)
    state = opt.init(model)
    assert all(
        leaf.dtype != jnp.int32 or leaf.ndim == 0 for leaf in jax.tree_util.tree_leaves(state)
    )

    @ox.filter_jit
    def step(model, state):
        grads = eqx.filter_grad(lambda m: jnp.sum(m.w**2))(model)
        return ox.update_and_apply(opt, grads, state, model)

    new, state = step(model, state)
    np.testing.assert_array_equal(np.asarray(new.steps), np.arange(3))
    np.testing.assert_allclose(np.asarray(new.w), 0.9, rtol=1e-6)  # Adam's first step: lr


@pytest.mark.parametrize("stream", [None, "leaf"])
def test_state_of_another_model_names_the_leaf(stream):
    opt = ox.offload_optimizer(optax.adam(0.1), stream=stream)
    state = opt.init(cast(Any, scanned_model(jax.random.key(0), width=8)))
    model: Any = scanned_model(jax.random.key(0), width=16)
    grads = eqx.filter_grad(loss_fn)(model, jnp.ones((2, 16)))
    with pytest.raises(
        ValueError,
        match=r"does not belong to these gradients: `state\.inner.*layers\.w1.*` has shape "
        r"\(3, 8, 32\), but the gradients give it shape \(3, 16, 32\).*opt\.init\(model\)",
    ):
        opt.update(grads, state, model)


def test_state_of_a_different_structure_names_the_leaf():
    opt = ox.offload_optimizer(optax.adam(0.1))
    state = opt.init({"a": jnp.ones(2), "b": jnp.ones(2)})
    with pytest.raises(ValueError, match=r"the state has a leaf `state\.inner.*\['b'\]`"):
        opt.update({"a": jnp.ones(2)}, state)


@pytest.mark.parametrize("stream", [None, "leaf"])
def test_state_that_is_not_ours_is_refused(stream):
    opt = ox.offload_optimizer(optax.adam(0.1), stream=stream)
    params = {"w": jnp.ones(2)}
    with pytest.raises(
        TypeError, match=r"is a optax.*ScaleByAdamState.*not the state of the optax"
    ):
        opt.update(params, cast(Any, optax.adam(0.1).init(params))[0], params)
    other = ox.offload_optimizer(optax.adam(0.1), stream="leaf" if stream is None else None)
    with pytest.raises(TypeError, match=r"their states differ"):
        opt.update(params, other.init(params), params)


# -- ox.update_and_apply: any transformation ----------------------------------------------


def _adamw():
    return optax.adamw(1e-2, weight_decay=0.1)


@pytest.mark.parametrize(
    "make, strategy",
    [
        # Plain optax cannot take host-typed gradients: its model stays on the device.
        (_adamw, "baseline"),
        (lambda: ox.offload_optimizer(_adamw()), "annotated"),
        (lambda: optax.chain(ox.offload_optimizer(_adamw())), "annotated"),
        (lambda: optax.chain(ox.offload_optimizer(_adamw(), stream="leaf")), "annotated"),
        (lambda: ox.offload_optimizer(_adamw(), stream="leaf"), "annotated"),
        (lambda: ox.offload_optimizer(_adamw(), stream="layer", layers=3), "annotated"),
    ],
    ids=["plain_optax", "ours", "chain_of_ours", "chain_of_streamed", "leaf", "layer"],
)
def test_update_and_apply_works_for_any_transformation(make, strategy):
    x = jax.random.normal(jax.random.key(1), (8, 16))
    reference = _reference(scanned_model(jax.random.key(0)), _adamw(), x, steps=2)
    opt = make()
    model = ox.place(scanned_model(jax.random.key(0)), strategy)
    state = opt.init(model)

    @ox.filter_jit(strategy=strategy, donate="all")
    def step(model, state, x):
        return ox.update_and_apply(opt, eqx.filter_grad(loss_fn)(model, x), state, model)

    for _ in range(2):
        model, state = step(model, state, x)
    expected = "device" if strategy == "baseline" else "pinned_host"
    assert model.layers.w1.sharding.memory_kind == expected
    for a, b in zip(
        jax.tree_util.tree_leaves(to_numpy(model)), jax.tree_util.tree_leaves(to_numpy(reference))
    ):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_update_and_apply_refuses_a_factory():
    with pytest.raises(TypeError, match=r"update_and_apply's `opt` is <function adam.*Call it"):
        ox.update_and_apply(optax.adam, {}, (), {})  # pyright: ignore[reportArgumentType]


@pytest.mark.parametrize("mode", [{}, {"update_on": "host"}, {"stream": "leaf"}, {"delay": 1}])
def test_model_and_state_survive_deepcopy_and_pickle(mode):
    # Issue 37, item 9: `ox.activations` is a static field of the model, and of every
    # state that mirrors the model's structure.
    import copy
    import pickle

    model = ox.place(scanned_model(jax.random.key(0)))
    opt = ox.offload_optimizer(optax.adam(1e-2), **mode)
    state = opt.init(model)
    for copied in (copy.deepcopy, lambda tree: pickle.loads(pickle.dumps(tree))):
        for tree in (model, state):
            again = copied(tree)
            assert jax.tree.structure(again) == jax.tree.structure(tree)
            for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(tree)):
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert copy.deepcopy(model.activations) == model.activations


def test_a_model_a_step_donated_is_named_by_apply_updates_and_update_and_apply():
    """Issue 50, item 8: arrays a donating step consumed, passed again, raised XLA's
    "Invalid buffer passed to Execute() ... Buffer has been deleted", naming no leaf."""
    opt = ox.offload_optimizer(optax.adam(1e-2))
    model: Any = scanned_model(jax.random.key(0))
    state = opt.init(model)
    x = jax.random.normal(jax.random.key(1), (8, 16))

    @ox.filter_jit(donate="all")
    def step(model, state, x):
        grads = eqx.filter_grad(loss_fn)(model, x)
        return ox.update_and_apply(opt, grads, state, model)

    zeros = jax.tree_util.tree_map(jnp.zeros_like, eqx.filter(model, eqx.is_array))
    # The first call moves the model to its planned memory and donates the moved copy;
    # the second donates the first's outputs themselves.
    model, state = step(model, state, x)
    new_model, new_state = step(model, state, x)
    deleted = r"`model\..*` has been deleted: it was donated to a step .* use the new `model`"
    with pytest.raises(ValueError, match=rf"ox.apply_updates: {deleted}"):
        ox.apply_updates(model, zeros)
    with pytest.raises(ValueError, match=r"ox.update_and_apply: `opt_state.*` has been deleted"):
        ox.update_and_apply(opt, zeros, state, new_model)
    assert ox.apply_updates(new_model, zeros) is not None  # the outputs are what to pass
