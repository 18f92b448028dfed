"""An ordered host callback in a step that uses host memory (issue 61, validation).

JAX cannot lower a program with an ordered effect and a memory kind other than the
device's (`safe_zip() argument 1 has length 9 but argument 0 has length 8`, from its
lowering, at the first call and in every `ox.memory_report`). `ox.filter_jit` refuses it
before anything is compiled or run, naming the callback and the leaves; unordered, or
with every array on the device, the step runs as under `eqx.filter_jit`."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.experimental import io_callback

import offload_eqx as ox


class Model(eqx.Module):
    b: jax.Array
    w: jax.Array = ox.field(memory="pinned_host")

    def __call__(self, x):
        return x @ self.w + self.b


def _record(seen):
    def log(value):
        seen.append(float(value))
        return np.asarray(value, np.float32)

    return log


def _step(opt, log, ordered, **options):
    def step(model, state, x):
        loss, grads = eqx.filter_value_and_grad(lambda m: jnp.sum(jax.vmap(m)(x) ** 2))(model)
        io_callback(log, jax.ShapeDtypeStruct((), jnp.float32), loss, ordered=ordered)
        model, state = ox.update_and_apply(opt, grads, state, model)
        return model, state, loss

    return ox.filter_jit(step, **options)


def _args(opt):
    model = Model(jnp.zeros(4), jnp.ones((4, 4)))
    return model, opt.init(model), jnp.ones((2, 4))


def test_an_ordered_callback_with_host_leaves_is_refused_before_anything_runs():
    seen = []
    opt = ox.offload_optimizer(optax.adam(1e-3))
    model, state, x = _args(opt)
    step = _step(opt, _record(seen), True, donate="all", donate_on_error=True)
    expected = (
        r"ordered host callback \(`io_callback` of .*log\) and leaves in host memory \(`model.w`"
    )
    with pytest.raises(ValueError, match=expected + r".*Nothing was compiled or run"):
        step(model, state, x)
    assert seen == [] and not model.w.is_deleted()  # nothing donated, nothing called
    for target in ("cpu", "h100"):
        with pytest.raises(ValueError, match=expected):
            ox.memory_report(step, model, state, x, target=target)


def test_unordered_or_on_the_device_it_runs_as_under_eqx_filter_jit():
    opt = ox.offload_optimizer(optax.adam(1e-3))
    model, state, x = _args(opt)
    seen = []
    _, _, loss = _step(opt, _record(seen), False)(model, state, x)
    baseline = []
    _, _, on_device = _step(opt, _record(baseline), True, strategy="baseline")(model, state, x)
    plain = optax.adam(1e-3)

    @eqx.filter_jit
    def reference(model, state, x):
        loss, grads = eqx.filter_value_and_grad(lambda m: jnp.sum(jax.vmap(m)(x) ** 2))(model)
        io_callback(_record([]), jax.ShapeDtypeStruct((), jnp.float32), loss, ordered=True)
        updates, state = plain.update(grads, state)
        return eqx.apply_updates(model, updates), state, loss

    _, _, expected = reference(model, plain.init(eqx.filter(model, eqx.is_array)), x)  # pyright: ignore[reportArgumentType]
    assert float(loss) == float(on_device) == float(expected) == seen[0] == baseline[0]
