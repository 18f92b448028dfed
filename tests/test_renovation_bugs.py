"""The bugs the scattered placement rules caused (issue 9) and the Equinox code that broke
(issue 10), each pinned against what plain Equinox does."""

import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from beartype import beartype
from jaxtyping import Array, Float, jaxtyped

import offload_eqx as ox
from offload_eqx._jit.jit import CACHE_WARNING

STRATEGIES = ["annotated", "baseline", "remat", "offload_params", "offload_optimizer", "hybrid"]


def _mlp(key=jax.random.key(0)) -> eqx.nn.MLP:
    return eqx.nn.MLP(16, 16, 32, depth=2, key=key)


def test_a_module_as_the_function_is_traced_and_planned_not_baked_in():
    mlp = _mlp()
    x = jnp.ones(16)
    step = ox.filter_jit(mlp)
    np.testing.assert_allclose(step(x), eqx.filter_jit(mlp)(x), rtol=1e-6)
    paths = [leaf.path for leaf in step.plan(x).leaves]
    assert paths[:2] == ["fn.layers[0].weight", "fn.layers[0].bias"]
    # Weights are arguments: the program does not grow with them (it held 1.58 M
    # characters of constants for MLP(64, 64, 384, depth=2) when they were baked in).
    big = eqx.nn.MLP(64, 64, 384, depth=2, key=jax.random.key(1))
    assert len(ox.filter_jit(big).lower(jnp.ones(64)).as_text()) < 20_000
    # A bound method too, and an error inside is the user's error, not the wrapper's.
    assert ox.filter_jit(mlp.__call__)(x).shape == (16,)
    with pytest.raises(TypeError, match="dot_general requires contracting dimensions"):
        step(jnp.ones(3))


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_an_annotated_eqx_nn_layer_brings_its_own_region(strategy):
    """`ox.annotate` on an unmodified `eqx.nn.MLP`'s layer, called as `mlp(x)`."""
    plain = _mlp()
    mlp = ox.place(ox.annotate(plain, lambda m: m.layers[1], memory="pinned_host"), strategy)
    x = jnp.linspace(-1.0, 1.0, 16)

    def loss(m, x):
        return jnp.sum(m(x) ** 2)

    step = ox.filter_jit(eqx.filter_value_and_grad(loss), strategy=strategy)
    value, grads = step(mlp, x)
    expected, expected_grads = eqx.filter_jit(eqx.filter_value_and_grad(loss))(plain, x)
    np.testing.assert_allclose(value, expected, rtol=1e-6)
    np.testing.assert_allclose(grads.layers[1].weight, expected_grads.layers[1].weight, rtol=1e-6)
    host = strategy in ("annotated", "offload_params", "hybrid")
    kind = grads.layers[1].weight.sharding.memory_kind
    assert kind == ("pinned_host" if host else "device")
    ox.audit(step, mlp, x).assert_no_implicit()


def test_a_region_per_call_can_be_opted_out_of():
    mlp = ox.annotate(_mlp(), lambda m: m.layers[1], memory="pinned_host", region=False)
    mlp = ox.place(mlp)
    with pytest.raises(ox.HostUseError, match=r"`m.layers\[1\].weight`.*outside any"):
        ox.filter_jit(lambda m, x: m(x))(mlp, jnp.ones(16))


@jaxtyped(typechecker=beartype)
def _dropout_loss(model: "DropoutNet", x: Float[Array, "batch 16"], key: jax.Array) -> Array:
    keys = jax.random.split(key, x.shape[0])
    return jnp.mean(jax.vmap(model)(x, keys) ** 2)


class DropoutNet(eqx.Module):
    linear: eqx.nn.Linear
    dropout: eqx.nn.Dropout

    def __call__(self, x, key):
        return self.dropout(self.linear(x), key=key)


def test_typed_prng_keys_plan_compile_and_place():
    net = DropoutNet(eqx.nn.Linear(16, 16, key=jax.random.key(0)), eqx.nn.Dropout(0.5))
    net = ox.annotate(net, lambda m: m.linear, memory="device")
    x = jnp.ones((4, 16))
    key = jax.random.key(1)  # a typed key, as eqx.nn.Dropout users pass
    for strategy in ("annotated", "hybrid"):
        step = ox.filter_jit(eqx.filter_value_and_grad(_dropout_loss), strategy=strategy)
        value, _ = step(ox.place(net, strategy), x, key)
        expected, _ = eqx.filter_jit(eqx.filter_value_and_grad(_dropout_loss))(net, x, key)
        np.testing.assert_allclose(value, expected, rtol=1e-6)
    plan = ox.filter_jit(_dropout_loss).plan(net, x, key)
    assert [(leaf.path, str(leaf.dtype), leaf.nbytes) for leaf in plan.leaves][-1] == (
        "key",
        "key<fry>",
        8,
    )
    assert ox.place({"k": key})["k"].dtype == key.dtype


def test_donate_all_except_first_keeps_the_first_argument_however_passed():
    step = ox.filter_jit(
        lambda model, state: (jax.tree.map(lambda a: a + 1, model), {"s": state["s"] * 2}),
        donate="all-except-first",
    )
    model = {"w": jnp.ones(3)}
    state = {"s": jnp.ones(3)}
    step(model=model, state=state)
    assert not model["w"].is_deleted()
    assert state["s"].is_deleted()  # the rest is donated


def test_the_same_array_in_two_donated_arguments_is_copied_for_the_call():
    """It was refused before running; XLA takes a donated buffer once, so the second
    occurrence is now a copy made for the call (issue 25)."""
    step = ox.filter_jit(lambda a, b: ({"w": a["w"] + 1}, {"w": b["w"] * 3}), donate="all")
    x = jnp.ones(3)
    a, b = step({"w": x}, {"w": x})
    np.testing.assert_array_equal(a["w"], 2 * np.ones(3))
    np.testing.assert_array_equal(b["w"], 3 * np.ones(3))
    assert x.is_deleted()  # donated, once


def test_block_output_names_are_offloaded_at_the_next_region():
    """A block that names its own output (what users write) is offloaded where that
    value is saved: at the input of the next region."""

    class Block(eqx.Module):
        w: jax.Array

        def __call__(self, x):
            return ox.name(jnp.tanh(x @ self.w), "h")

    class Blocks(eqx.Module):
        blocks: list
        activations: ox.Activations = ox.activations(h="offload")

        def __call__(self, x):
            for block in self.blocks:
                x = ox.checkpoint(block, x)
            return x

    keys = jax.random.split(jax.random.key(0), 3)
    model = Blocks([Block(jax.random.normal(k, (16, 16)) * 0.3) for k in keys])
    x = jnp.ones((4, 16))
    step = ox.filter_jit(eqx.filter_grad(lambda m, x: jnp.sum(m(x) ** 2)))
    report = ox.audit(step, model, x)
    down = report.select(direction="device-to-host", kind="activation")
    assert [t.what for t in down] == ["h", "h"] and report.total("device-to-host") == 2 * 256
    expected = eqx.filter_jit(eqx.filter_grad(lambda m, x: jnp.sum(m(x) ** 2)))(model, x)
    for got, want in zip(jax.tree.leaves(step(model, x)), jax.tree.leaves(expected)):
        np.testing.assert_allclose(got, want, rtol=1e-6)


def test_hybrid_without_activation_names_offloads_parameters_and_state():
    mlp = ox.place(ox.annotate(_mlp(), lambda m: m.layers, memory="device"), "hybrid")
    opt = ox.offload_optimizer(optax.adam(1e-3))
    state = opt.init(mlp)

    @ox.filter_jit(strategy="hybrid")
    def step(model, state, x):
        grads = eqx.filter_grad(lambda m: jnp.sum(m(x) ** 2))(model)
        updates, state = opt.update(grads, state, model)
        return ox.apply_updates(model, updates), state

    model, state = step(mlp, state, jnp.ones(16))
    assert model.layers[0].weight.sharding.memory_kind == "pinned_host"
    with pytest.raises(ValueError, match=r"Strategy 'offload_activations' offloads activations"):
        ox.filter_jit(lambda m, x: m(x), strategy="offload_activations")(mlp, jnp.ones(16))


def test_jax_vmap_of_a_host_module_in_a_region_names_the_fix():
    class Layer(eqx.Module):
        w: jax.Array = ox.field(memory="pinned_host")

        def __call__(self, x):
            return jnp.tanh(x @ self.w)

    layer = ox.place(Layer(jnp.ones((8, 8)) * 0.1))
    x = jnp.ones((4, 8))
    bad = ox.filter_jit(lambda m, x: ox.checkpoint(jax.vmap(m), x))
    with pytest.raises(TypeError, match=r"hides in a closure.*eqx.filter_vmap\(block\)"):
        bad(layer, x)
    good = ox.filter_jit(lambda m, x: ox.checkpoint(eqx.filter_vmap(m), x))
    np.testing.assert_allclose(good(layer, x), jnp.tanh(x @ jnp.ones((8, 8)) * 0.1), rtol=1e-6)


def test_the_cache_key_holds_shapes_and_warns_when_statics_keep_changing():
    step = ox.filter_jit(lambda x, scale: x * scale)
    step(jnp.ones(3), 2.0)
    step(jnp.ones(4), 2.0)  # a new shape is a new entry, validated like the first
    assert step.compilations == 2
    np.testing.assert_array_equal(step(jnp.ones(3), 2.0), 2 * jnp.ones(3))  # both kept
    np.testing.assert_array_equal(step(jnp.ones(4), 2.0), 2 * jnp.ones(4))
    assert step.compilations == 2
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(CACHE_WARNING):
            step(jnp.ones(3), float(i))
    messages = [str(w.message) for w in caught]
    assert any("compiled 32 versions" in m and "`scale` (" in m for m in messages), messages


def test_a_new_batch_size_per_call_warns_when_programs_pile_up():
    """40 batch sizes kept 40 programs with no warning: only new static values were
    counted (issue 26, item 13)."""
    step = ox.filter_jit(lambda x: x * 2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for size in range(1, CACHE_WARNING + 1):
            step(jnp.ones(size))
    messages = [str(w.message) for w in caught]
    assert step.compilations == CACHE_WARNING
    assert len(messages) == 1, messages
    assert "compiled 32 versions" in messages[0]
    assert "32 of them differ only in the shapes" in messages[0]
    assert "pad or bucket" in messages[0]


def test_under_audit_a_changing_static_leaf_is_an_error():
    step = ox.filter_jit(lambda x, scales: x * scales[0], audit=True)
    x = jnp.ones(3)
    step(x, [1.0])
    with pytest.raises(ox.ImplicitTransferError, match=r"`scales\[0\]` \(1.0 -> 2.0\)"):
        step(x, [2.0])


def test_a_nested_step_keeps_its_own_plan_and_checks():
    class Named(eqx.Module):
        w: jax.Array
        activations: ox.Activations = ox.activations(missing="offload")

        def __call__(self, x):
            return x @ self.w

    inner = ox.filter_jit(lambda m, x: ox.checkpoint(m, x))
    outer = ox.filter_jit(lambda m, x: inner(m, x))
    with pytest.raises(ValueError, match="'missing' is declared 'offload'.*never produces"):
        outer(Named(jnp.ones((3, 3))), jnp.ones(3))


def test_a_numpy_leaf_under_the_guard_is_named_by_its_path():
    linear = eqx.nn.Linear(3, 2, key=jax.random.key(0))
    linear = eqx.tree_at(lambda m: m.bias, linear, np.zeros(2, np.float32))
    step = ox.filter_jit(lambda lin, x: lin(x))
    x = jnp.ones(3)
    with pytest.raises(ox.ImplicitTransferError, match=r"`lin.bias` is a numpy.ndarray"):
        with ox.no_implicit_transfers():
            step(linear, x)


def test_donated_buffers_survive_trace_errors_but_not_run_time_errors():
    """What the README says of donation and errors."""

    def fail(x):
        raise RuntimeError("boom")

    def step(model, x):
        bad = jax.pure_callback(fail, jax.ShapeDtypeStruct((3,), jnp.float32), x)
        return {"w": model["w"] + bad}, x

    model, x = {"w": jnp.ones(3)}, jnp.ones(3)
    with pytest.raises(TypeError):  # at trace time: nothing runs, nothing is donated
        ox.filter_jit(lambda m, x: ({"w": m["w"] @ jnp.ones((4, 4))}, x), donate="all")(model, x)
    assert not model["w"].is_deleted()
    # A step that can raise while it runs donates nothing (issue 26, item 14): the model
    # survives the error, and training can resume from it.
    with pytest.warns(UserWarning, match=r"can raise while it runs.*donate_on_error=True"):
        checked = ox.filter_jit(step, donate="all")
        with pytest.raises(Exception, match="pure_callback failed|boom"):
            jax.block_until_ready(checked(model, x))  # raised when the program has run
    assert not model["w"].is_deleted() and not x.is_deleted()
    np.testing.assert_array_equal(model["w"], jnp.ones(3))
    # Opted in: the model, whose new value the step returns, is donated and lost.
    with pytest.raises(Exception, match="pure_callback failed|boom"):
        jax.block_until_ready(ox.filter_jit(step, donate="all", donate_on_error=True)(model, x))
    assert model["w"].is_deleted() and not x.is_deleted()


def test_a_name_the_backward_pass_never_reads_is_refused_alike_by_jit_and_audit():
    class Residual(eqx.Module):
        w: jax.Array

        def __call__(self, x):
            return x + ox.name(jax.nn.relu(x @ self.w), "act")  # relu's backward reads x @ w

    class Model(eqx.Module):
        block: Residual
        activations: ox.Activations = ox.activations(act="offload")

        def __call__(self, x):
            return ox.checkpoint(self.block, x)

    model, x = Model(Residual(jnp.ones((4, 4)))), jnp.ones((2, 4))
    grad = eqx.filter_grad(lambda m, x: jnp.sum(m(x)))
    message = r"'act' is declared 'offload'.*never reads it.*nothing to offload.*'remat'"
    with pytest.raises(ox.ContractError, match=message):
        ox.filter_jit(grad)(model, x)
    with pytest.raises(ox.ContractError, match=message):
        ox.audit(ox.filter_jit(grad), model, x)
    # Without a backward pass nothing is saved anyway: a forward step is fine.
    assert ox.filter_jit(lambda m, x: m(x))(model, x).shape == (2, 4)


@pytest.mark.parametrize("strategy", ["annotated", "baseline", "offload_params", "hybrid"])
def test_a_module_using_its_own_host_field_brings_its_own_region(strategy):
    class Dense(eqx.Module):
        w: jax.Array = ox.field(memory="pinned_host")

        def __call__(self, x):
            return jnp.tanh(x @ self.w)

    class Outer(eqx.Module):
        dense: Dense
        bias: jax.Array

        def __call__(self, x):
            return self.dense(x) + self.bias

    model = Outer(Dense(jnp.eye(4) * 0.5), jnp.ones(4))
    loss = eqx.filter_value_and_grad(lambda m, x: jnp.sum(m(x) ** 2))
    value, grads = ox.filter_jit(loss, strategy=strategy)(ox.place(model, strategy), jnp.ones(4))
    expected, expected_grads = eqx.filter_jit(loss)(model, jnp.ones(4))
    np.testing.assert_allclose(value, expected, rtol=1e-6)
    np.testing.assert_allclose(grads.dense.w, expected_grads.dense.w, rtol=1e-6)
    assert type(grads.dense) is Dense  # the class is the user's, not a subclass
    host = strategy != "baseline"
    assert grads.dense.w.sharding.memory_kind == ("pinned_host" if host else "device")
