"""Equinox code written elsewhere, annotated from outside (issue 25, items 9-15): optimizer
state placed and typed by the plan, regions that return what the module returned,
methods other than `__call__`, Equinox's checkpointed loop, a block's own
`jax.checkpoint`, and errors and audit rows that name leaves."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import scanned_model

import offload_eqx as ox

HOST = jax.memory.Space.Host


def _placements(tree) -> dict[str, tuple[str, bool]]:
    """Each array leaf's memory kind and whether its type says host."""
    return {
        jax.tree_util.keystr(path): (
            leaf.sharding.memory_kind,
            jax.typeof(leaf).memory_space == HOST,
        )
        for path, leaf in jax.tree_util.tree_leaves_with_path(eqx.filter(tree, eqx.is_array))
    }


# -- 9. Optimizer state placed by the parameter it mirrors, and typed so. -----------------


def test_init_state_in_host_memory_is_typed_host():
    """`nu` of the first layers was in pinned_host but typed as device memory: the mask of
    host leaves was misaligned by the MLP's activation fields (None in the state)."""
    mlp = eqx.nn.MLP(8, 4, 16, 2, key=jax.random.key(0))
    mlp = ox.place(ox.annotate(mlp, lambda m: m.layers[:-1], memory="pinned_host"))
    state = ox.offload_optimizer(optax.adam(1e-2)).init(eqx.filter(mlp, eqx.is_inexact_array))
    placed = _placements(state)
    assert placed.pop(".inner[0].count") == ("device", False)
    assert set(placed.values()) == {("pinned_host", True)}, placed
    assert len(placed) == 12


@pytest.mark.parametrize(
    "strategy, memory", [("offload_params", "device"), ("hybrid", "pinned_host")]
)
def test_init_traced_under_a_strategy_builds_where_the_strategy_keeps_it(strategy, memory):
    """`ox.filter_jit(opt.init, strategy=...)`: the state is built where that strategy's
    plan puts it (under offload_params the moments were built in pinned_host)."""
    model = ox.place(scanned_model(jax.random.key(0)), strategy)
    opt = ox.offload_optimizer(optax.adam(1e-2))
    state = ox.filter_jit(opt.init, strategy=strategy)(model)
    placed = _placements(state)
    assert placed.pop(".inner[0].count") == ("device", False)
    assert set(placed.values()) == {(memory, memory == "pinned_host")}, placed
    plan = ox.plan((model, state), strategy)
    planned = {leaf.path: leaf.memory for leaf in plan.leaves if ".mu." in leaf.path}
    assert set(planned.values()) == {memory}


# -- 10, 11. A stateful layer annotated from outside. ------------------------------------


class _Net(eqx.Module):
    linear: eqx.nn.Linear
    norm: eqx.nn.BatchNorm

    def __call__(self, x, state):
        return self.norm(self.linear(x), state)


def _batch_norm_net():
    linear = eqx.nn.Linear(4, 4, key=jax.random.key(0))
    norm = eqx.nn.BatchNorm(4, "batch", mode="ema")
    return _Net(linear, norm)


def _state_step(model, state, x):
    def loss(model):
        forward = jax.vmap(model, axis_name="batch", in_axes=(0, None), out_axes=(0, None))
        y, new_state = forward(x, state)
        return jnp.sum(y**2), new_state

    (value, new_state), grads = eqx.filter_value_and_grad(loss, has_aux=True)(model)
    return value, new_state, grads


def test_constant_outputs_of_a_region_come_back_as_arrays():
    """BatchNorm's first-time flag is `jnp.array(False)` in the state it returns; the
    region `ox.annotate` adds returned a Python bool (the state changed structure)."""
    net, state = eqx.nn.make_with_state(_batch_norm_net)()
    x = jnp.linspace(0.0, 1.0, 12).reshape(3, 4)
    _, expected, _ = eqx.filter_jit(_state_step)(net, state, x)
    annotated = ox.place(ox.annotate(net, lambda m: m.norm, memory="pinned_host"))
    _, ours, _ = ox.filter_jit(_state_step)(annotated, state, x)
    assert jax.tree_util.tree_structure(ours) == jax.tree_util.tree_structure(expected)
    for a, b in zip(jax.tree_util.tree_leaves(ours), jax.tree_util.tree_leaves(expected)):
        assert isinstance(a, jax.Array) and a.dtype == b.dtype
        np.testing.assert_allclose(a, b, rtol=1e-6)


def test_initial_state_leaves_get_optimizer_state_in_host_memory():
    """Without `make_with_state`, `StateIndex.init` holds arrays that `is_inexact_array`
    trains; the optimizer's state for them is optimizer state, in pinned_host."""
    net = ox.place(ox.annotate(_batch_norm_net(), lambda m: m.norm, memory="pinned_host"))
    assert net.norm.ema_state_index.init[0].sharding.memory_kind == "device"  # not a parameter
    state = ox.offload_optimizer(optax.adam(1e-2)).init(eqx.filter(net, eqx.is_inexact_array))
    init_moments = {p: v for p, v in _placements(state).items() if "ema_state_index" in p}
    assert len(init_moments) == 4  # mu and nu of the two running statistics
    assert set(init_moments.values()) == {("pinned_host", True)}


# -- 12. Methods other than `__call__`. ---------------------------------------------------


class _LM(eqx.Module):
    embed: eqx.nn.Embedding
    hidden: eqx.nn.Linear
    head: eqx.nn.Linear

    def __init__(self, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.embed = eqx.nn.Embedding(10, 8, key=k1)
        self.hidden = eqx.nn.Linear(8, 8, key=k2)
        self.head = eqx.nn.Linear(8, 10, key=k3)

    def logits(self, token):
        return self.head(jnp.tanh(self.hidden(self.embed.weight[token])))

    def generate_step(self, token):
        return jnp.argmax(self.logits(token))

    def generate(self, token, steps: int = 4):
        def body(token, _):
            token = jnp.argmax(self.head(jnp.tanh(self.hidden(self.embed.weight[token]))))
            return token, token

        return jax.lax.scan(body, token, None, length=steps)[1]


@pytest.mark.parametrize("strategy", ["annotated", "offload_params", "hybrid"])
@pytest.mark.parametrize("method", ["generate", "generate_step"])
def test_methods_of_an_annotated_module_bring_their_region(method, strategy):
    """`ox.filter_jit(model.generate)` of a module annotated whole: the method reads the
    weights directly (not through a submodule's `__call__`), in its own region."""
    model = _LM(jax.random.key(0))
    expected = eqx.filter_jit(getattr(model, method))(jnp.array(3))
    annotated = ox.place(ox.annotate(model, lambda m: m, memory="pinned_host"), strategy)
    step = ox.filter_jit(getattr(annotated, method), strategy=strategy, audit=True)
    report = ox.audit(step, jnp.array(3))
    report.assert_no_implicit()
    assert report.total("host-to-device", kind="parameter") > 0
    np.testing.assert_array_equal(step(jnp.array(3)), expected)


def test_methods_of_a_module_declaring_host_fields_bring_their_region():
    class Decoder(eqx.Module):
        w: jax.Array = ox.field(memory="pinned_host")

        def generate(self, x, steps: int = 3):
            return jax.lax.fori_loop(0, steps, lambda i, x: jnp.tanh(self.w @ x), x)

    model = Decoder(jnp.eye(4) * 0.5)
    expected = eqx.filter_jit(model.generate)(jnp.ones(4))
    np.testing.assert_allclose(ox.filter_jit(ox.place(model).generate)(jnp.ones(4)), expected)


# -- 13. Equinox's checkpointed while loop (diffrax's solver loop). ----------------------


@pytest.mark.parametrize("kind", ["bounded", "checkpointed"])
def test_host_weights_in_a_checkpointed_while_loop_are_fetched_once(kind):
    class Score(eqx.Module):
        linear: eqx.nn.Linear

        def __call__(self, x):
            return jnp.tanh(self.linear(x))

    def sample(model, x):
        def body(carry):
            i, x = carry
            return i + 1, x - 0.1 * model(x)

        return eqx.internal.while_loop(lambda c: c[0] < 5, body, (0, x), max_steps=8, kind=kind)

    def gradient(model, x):
        return eqx.filter_grad(lambda m: jnp.sum(sample(m, x)[1] ** 2))(model)

    model = Score(eqx.nn.Linear(4, 4, key=jax.random.key(0)))
    expected = eqx.filter_jit(gradient)(model, jnp.ones(4))
    placed = ox.place(ox.annotate(model, lambda m: m.linear, memory="pinned_host"))
    step = ox.filter_jit(gradient, audit=True)
    report = ox.audit(step, placed, jnp.ones(4))
    fetched = report.select("host-to-device", kind="parameter")
    assert {(t.what, t.count) for t in fetched} == {
        ("model.linear.weight", 1),
        ("model.linear.bias", 1),
    }, report
    got = step(placed, jnp.ones(4))
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(expected)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


# -- 14. A block's own `jax.checkpoint`, with a weight passed in. -------------------------


class _OwnCheckpoint(eqx.Module):
    linear: eqx.nn.Linear

    def __call__(self, x):
        def mix(weight, x):
            return jnp.tanh(x @ weight.T)

        return jax.checkpoint(mix)(self.linear.weight, x) + self.linear.bias


class _Stack(eqx.Module):
    blocks: list

    def __call__(self, x):
        for block in self.blocks:
            x = block(x)
        return jnp.sum(x**2)


@pytest.mark.parametrize("strategy", ["annotated", "offload_params", "hybrid"])
def test_a_blocks_own_checkpoint_keeps_no_device_copy(strategy):
    model = _Stack([_OwnCheckpoint(eqx.nn.Linear(4, 4, key=jax.random.key(i))) for i in range(2)])

    def gradient(model, x):
        return eqx.filter_grad(lambda m: m(x))(model)

    expected = eqx.filter_jit(gradient)(model, jnp.ones((3, 4)))
    annotated = ox.place(ox.annotate(model, lambda m: m.blocks, memory="pinned_host"), strategy)
    step = ox.filter_jit(gradient, strategy=strategy)
    ox.audit(step, annotated, jnp.ones((3, 4)))  # raises ContractError on a kept copy
    got = step(annotated, jnp.ones((3, 4)))
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(expected)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


# -- 15. Errors and audit rows that name leaves. -----------------------------------------


class _Scanned(eqx.Module):
    layers: eqx.nn.Linear  # stacked

    def __call__(self, x):
        dynamic, static = eqx.partition(self.layers, eqx.is_array)

        def body(x, layer):
            return eqx.combine(layer, static)(x), None

        return jnp.sum(jax.lax.scan(body, x, dynamic)[0] ** 2)


def _scanned():
    keys = jax.random.split(jax.random.key(0), 3)
    layers = eqx.filter_vmap(lambda k: eqx.nn.Linear(4, 4, key=k))(keys)
    return ox.annotate(_Scanned(layers), lambda m: m.layers, memory="pinned_host")


@pytest.mark.parametrize("strategy", ["offload_params", "hybrid"])
def test_gradient_rows_name_a_leaf_the_backward_pass_does_not_fetch(strategy):
    """A bias is not fetched again for the backward pass (its gradient does not read it);
    its gradient's row said "a host-resident leaf"."""
    step = ox.filter_jit(lambda m, x: eqx.filter_grad(lambda m: m(x))(m), strategy=strategy)
    report = ox.audit(step, ox.place(_scanned(), strategy), jnp.ones(4))
    sent = {t.what for t in report.select("device-to-host", kind="gradient")}
    assert sent == {"m.layers.weight", "m.layers.bias"}, report


def test_eqx_apply_updates_on_host_parameters_points_to_ox_apply_updates():
    opt = ox.offload_optimizer(optax.adam(1e-2))

    def train(model, opt_state, x):
        grads = eqx.filter_grad(lambda m: m(x))(model)
        updates, opt_state = opt.update(grads, opt_state, model)
        return eqx.apply_updates(model, updates), opt_state

    model = ox.place(_scanned())
    opt_state = opt.init(eqx.filter(model, eqx.is_inexact_array))
    with pytest.raises(
        ox.HostUseError,
        match=r"`eqx.apply_updates` adds the updates to them on the device.*"
        r"replace `eqx.apply_updates\(model, updates\)` with `ox.apply_updates\(model, updates\)`",
    ):
        ox.filter_jit(train)(model, opt_state, jnp.ones(4))


def test_host_use_error_does_not_advise_annotating_an_annotated_module():
    class Model(eqx.Module):
        linear: eqx.nn.Linear

        def __call__(self, x):
            return self.linear(x)

    model = ox.place(
        ox.annotate(
            Model(eqx.nn.Linear(3, 3, key=jax.random.key(0))),
            lambda m: m.linear,
            memory="pinned_host",
        )
    )
    loss = ox.filter_jit(lambda m, x: jnp.sum(m.linear.weight @ x))
    with pytest.raises(ox.HostUseError) as caught:
        loss(model, jnp.ones(3))
    assert "ox.fetch" in str(caught.value)
    assert "annotate it" not in str(caught.value)
