"""`ox.filter_jit`: eqx.filter_jit semantics plus shardings, donation and a compile cache."""

import gc

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import make_optimizer, make_step, scanned_model

import offload_eqx as ox


def test_both_decorator_forms_and_static_arguments():
    calls = []

    @ox.filter_jit
    def scale(x, factor, activation):
        calls.append(1)
        return activation(x * factor)

    @ox.filter_jit(donate="none")
    def scale2(x, factor):
        return x * factor

    x = jnp.arange(3.0)
    np.testing.assert_allclose(scale(x, 2.0, jax.nn.relu), jnp.arange(3.0) * 2)
    np.testing.assert_allclose(scale2(x, 3.0), jnp.arange(3.0) * 3)
    traces = len(calls)  # the first call traces for the output types, then compiles
    scale(x + 1, 2.0, jax.nn.relu)  # same static part: cached, not retraced
    assert len(calls) == traces
    scale(x, 5.0, jax.nn.relu)  # Python floats are static, as in eqx.filter_jit
    assert len(calls) > traces


def test_non_array_outputs_and_modules_with_functions():
    mlp = eqx.nn.MLP(3, 2, 4, 1, key=jax.random.key(0))

    @ox.filter_jit
    def forward(mlp, x):
        return mlp(x), "tag", mlp

    y, tag, same = forward(mlp, jnp.ones(3))
    assert tag == "tag" and same.activation is mlp.activation
    np.testing.assert_allclose(y, mlp(jnp.ones(3)), rtol=1e-6)


def test_methods_and_lower():
    class Model(eqx.Module):
        w: jax.Array

        @ox.filter_jit
        def __call__(self, x):
            return x @ self.w

    model = Model(jnp.eye(3))
    np.testing.assert_allclose(model(jnp.ones(3)), jnp.ones(3))
    step = ox.filter_jit(lambda model, x: model.w @ x)
    lowered = step.lower(model, jax.ShapeDtypeStruct((3,), jnp.float32))
    assert "stablehlo" in lowered.as_text() or "func.func" in lowered.as_text()


def test_host_outputs_and_in_shardings_from_the_plan():
    model = ox.place(scanned_model(jax.random.key(0)))
    opt = make_optimizer()
    opt_state = opt.init(model)
    step = make_step(opt, None)
    compilation, _ = step.compilation(model, opt_state, jnp.ones((8, 16)))
    kinds = [s.memory_kind for s in compilation.in_shardings]
    assert kinds[:2] == ["pinned_host", "pinned_host"]  # model.layers.w1, w2
    assert kinds[2] == "device"  # Adam's count: a scalar stays on the device
    assert set(kinds[3:7]) == {"pinned_host"}  # mu, nu
    assert compilation.out_memories[:2] == ("pinned_host", "pinned_host")
    assert compilation.output_paths()[:2] == ["output[0].layers.w1", "output[0].layers.w2"]


def test_donation_is_per_leaf_and_never_crosses_memory_kinds():
    model = ox.place(scanned_model(jax.random.key(0)))
    opt = make_optimizer()
    opt_state = opt.init(model)
    step = make_step(opt, "offload_params", donate="all")
    x = jnp.ones((8, 16))
    model_h = ox.place(model, "offload_params")
    compilation, _ = step.compilation(model_h, opt_state, x)
    # x (no output of its shape) is not donated; every other leaf is.
    assert compilation.donate_argnums == tuple(range(len(compilation.plan.leaves) - 1))
    new_model, new_state, _ = step(model_h, opt_state, x)
    assert model_h.layers.w1.is_deleted()  # donated
    assert not x.is_deleted()
    assert new_model.layers.w1.sharding.memory_kind == "pinned_host"

    except_first = make_step(opt, "offload_params", donate="all-except-first")
    compilation, _ = except_first.compilation(new_model, new_state, x)
    assert 0 not in compilation.donate_argnums and 1 not in compilation.donate_argnums


def test_arguments_in_another_memory_are_moved_once_explicitly():
    model = scanned_model(jax.random.key(0))  # everything on the device
    step = ox.filter_jit(lambda model, x: model(x))
    assert model.layers.w1.sharding.memory_kind == "device"
    out = step(model, jnp.ones((8, 16)))  # annotations say pinned_host: moved for the call
    assert out.shape == (8, 16)
    placed = ox.place(model)
    np.testing.assert_array_equal(step(placed, jnp.ones((8, 16))), out)


def test_nested_inside_another_trace():
    inner = ox.filter_jit(lambda x: x * 2)

    @jax.jit
    def outer(x):
        return inner(x) + 1

    np.testing.assert_allclose(outer(jnp.ones(2)), 3 * jnp.ones(2))


def test_unhashable_static_argument():
    step = ox.filter_jit(lambda x, table: x * table["a"])
    with pytest.raises(TypeError, match=r"non-array argument is not hashable"):
        step(jnp.ones(2), {"a": {1.0}})


class DropoutModel(eqx.Module):
    w: jax.Array = ox.field(memory="pinned_host")
    key: jax.Array = ox.field(memory="device")


def dropout_step(model, x):
    keep, key = jax.random.split(model.key)
    kept = jnp.where(jax.random.bernoulli(keep, 0.5, x.shape), x, 0.0)
    return jnp.sum(kept * ox.fetch(model.w)), eqx.tree_at(lambda m: m.key, model, key)


@pytest.mark.parametrize("strategy", ["baseline", "annotated", "offload_params"])
def test_a_typed_key_trains_on_the_device_under_every_strategy(strategy):
    # JAX types no key as host memory: a strategy that moves parameters leaves it.
    model = DropoutModel(jnp.ones(4), jax.random.key(0))
    step = ox.filter_jit(dropout_step, strategy=strategy, donate="all")
    host = "device" if strategy == "baseline" else "pinned_host"
    assert ox.plan(model, strategy).memory_kinds() == [host, "device"]
    keys = []
    for _ in range(2):
        loss, model = step(model, jnp.ones(4))
        keys.append(jax.random.key_data(model.key))
    assert model.key.sharding.memory_kind == "device"
    assert model.w.sharding.memory_kind == host
    assert not np.array_equal(keys[0], keys[1])


def test_a_called_step_deepcopies_and_pickles_and_the_copy_runs():
    # Issue 37, item 9: a copy shares the function's compiled programs (they hold devices,
    # which cannot be copied); a pickled step compiles again.
    import copy
    import pickle

    model = ox.place(scanned_model(jax.random.key(0)))
    opt = make_optimizer()
    state = opt.init(model)
    step = make_step(opt, "annotated")
    x = jnp.ones((4, 16))
    expected = float(step(model, state, x)[2])
    copied = copy.deepcopy(step)
    assert float(copied(model, state, x)[2]) == expected
    assert copied.compilations == step.compilations == 1
    squares = ox.filter_jit(sum_of_squares)
    squares(jnp.ones(4))
    again = pickle.loads(pickle.dumps(squares))
    assert float(again(jnp.ones(4))) == 4.0


def sum_of_squares(x):
    return jnp.sum(x**2)


def test_a_fresh_audited_wrapper_is_not_judged_by_a_collected_one_of_the_same_id():
    """`ox.filter_jit(f, audit=True)` made afresh per call, each with its own static
    value, as `eqx.filter_jit(f)` is used in a loop: what a wrapper compiled goes with
    it, so a new wrapper that Python gives a collected one's `id` is not refused as a
    change of that one's static arguments (a flake of the third-party sampler tests)."""

    def f(x, kind):
        return x * (2.0 if kind.startswith("a") else 3.0)

    x = jnp.ones(3)
    for i in range(3):
        step = ox.filter_jit(f, audit=True)
        assert float(step(x, f"{'ab'[i % 2]}{i}")[0]) == (2.0 if i % 2 == 0 else 3.0)
        cache = step.cache
        del step
        gc.collect()
        assert cache.compiled_by == {}  # nothing a later wrapper of this id would inherit
