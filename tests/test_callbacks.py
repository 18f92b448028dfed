"""A step compiled for a GPU or TPU target without the hardware, whatever JAX or Equinox
feature it uses. Host callbacks (`_targets/callbacks`): `eqx.error_if` (megalodon-jax and
diffrax check their inputs with it), `jax.debug.print` and `io_callback`s compile for
`target="h100"` (JAX alone refuses: "Unknown backend: 'gpu' requested"), and the step run
on this machine still runs them. Values made while traced (`jax.ensure_compile_time_eval`,
`eqx.nn.RotaryPositionalEmbedding`'s tables) are computed on this machine for a GPU
target too (`_targets/deviceless`; JAX ran them on the compile-only devices: "'Executable'
object has no attribute 'local_devices'"). A family of small steps, one feature each,
compiles for the H100 and a TPU."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.experimental import io_callback

import offload_eqx as ox


class Block(eqx.Module):
    linear: eqx.nn.Linear

    def __call__(self, x):
        x = eqx.error_if(x, jnp.any(jnp.isnan(x)), "the block's input has a NaN")
        return jax.nn.relu(self.linear(x))


def _model():
    return Block(eqx.nn.Linear(16, 16, key=jax.random.key(0)))


def _step(opt):
    @ox.filter_jit(donate="all")
    def step(model, state, x):
        def loss(m):
            y = jax.vmap(m)(x)
            jax.debug.print("loss {}", jnp.mean(y))
            return jnp.mean(y**2)

        grads = eqx.filter_grad(loss)(model)
        io_callback(lambda v: None, None, jnp.sum(x))
        return ox.update_and_apply(opt, grads, state, model)

    return step


def _args(opt):
    model = _model()
    return model, opt.init(eqx.filter(model, eqx.is_array)), jnp.ones((4, 16))


@pytest.mark.deviceless
def test_a_step_with_error_if_and_debug_prints_compiles_for_the_h100():
    opt = ox.offload_optimizer(optax.adam(1e-3))
    report = ox.memory_report(_step(opt), *_args(opt), target="h100")
    assert report.device["argument"] > 0
    estimate = ox.estimate(_step(opt), *_args(opt), target="h100")
    assert estimate.seconds > 0


@pytest.mark.deviceless
def test_a_plain_eqx_filter_jit_step_with_error_if_compiles_for_the_h100():
    @eqx.filter_jit
    def forward(model, x):
        return jax.vmap(model)(x)

    report = ox.memory_report(forward, _model(), jnp.ones((4, 16)), target="h100")
    assert report.device["output"] == 4 * 16 * 4


def test_on_this_machine_the_callbacks_still_run(capfd):
    """The CPU's program is lowered as JAX lowers it: the print prints, the check
    raises, after a GPU target was compiled in the same process."""
    opt = ox.offload_optimizer(optax.adam(1e-3))
    step = _step(opt)
    model, state, x = _args(opt)
    model, state = step(model, state, x)
    jax.effects_barrier()
    assert "loss" in capfd.readouterr().out
    with pytest.raises(Exception, match="the block's input has a NaN"):
        step(model, state, jnp.full((4, 16), jnp.nan))


# -- every JAX or Equinox feature a step uses compiles for every target ------------------
# A step that compiles for this machine's CPU compiles for each deviceless target, whatever
# it uses: values it evaluates while traced (`jax.ensure_compile_time_eval`, as
# `eqx.nn.RotaryPositionalEmbedding` builds its tables and diffrax checks its result),
# `eqx.error_if` and other host callbacks, fields that hold functions, attention, loops.


class Features(eqx.Module):
    """A small model whose forward pass uses one feature (`feature`) around a linear
    layer, so that every case also has a gradient to compute."""

    feature: str = eqx.field(static=True)
    linear: eqx.nn.Linear
    mlp: eqx.nn.MLP  # its `activation` field holds a function
    rope: eqx.nn.RotaryPositionalEmbedding
    attention: eqx.nn.MultiheadAttention

    def __call__(self, x):  # x: (8, 16)
        x = jax.vmap(self.linear)(x)
        if self.feature == "trace-time constant":
            with jax.ensure_compile_time_eval():
                table = jnp.arange(8.0)
            return x + table[:, None]
        if self.feature == "error_if":
            return eqx.error_if(x, jnp.any(jnp.isnan(x)), "the input has a NaN")
        if self.feature == "host callbacks":
            value = jax.lax.stop_gradient(x)  # callbacks have no derivative
            sign = jax.pure_callback(np.sign, jax.ShapeDtypeStruct(x.shape, x.dtype), value)
            jax.debug.print("mean {}", jnp.mean(x))
            io_callback(lambda v: None, None, jnp.sum(value))
            return x * sign
        if self.feature == "function-valued fields":
            return jax.vmap(self.mlp)(x)
        if self.feature == "RotaryPositionalEmbedding":
            # The second call slices the tables the first made, while traced.
            return self.rope(x) + jnp.tile(self.rope(x[:4]), (2, 1))
        if self.feature == "MultiheadAttention":
            return self.attention(x, x, x)
        if self.feature == "dot_product_attention":
            heads = x.reshape(1, 8, 2, 8)  # batch, sequence, heads, head size
            return jax.nn.dot_product_attention(heads, heads, heads, is_causal=True).reshape(8, 16)
        if self.feature == "while_loop":
            return eqx.internal.while_loop(
                lambda carry: carry[0] < 3,
                lambda carry: (carry[0] + 1, jnp.tanh(carry[1])),
                (0, x),
                max_steps=3,
                kind="checkpointed",
            )[1]
        if self.feature == "scan":
            return jax.lax.scan(lambda h, _: (jnp.tanh(h), None), x, length=3)[0]
        raise ValueError(f"unknown feature {self.feature!r}")


FEATURES = [
    "trace-time constant",
    "error_if",
    "host callbacks",
    "function-valued fields",
    "RotaryPositionalEmbedding",
    "MultiheadAttention",
    "dot_product_attention",
    "while_loop",
    "scan",
]


def _features(feature):
    keys = jax.random.split(jax.random.key(0), 3)
    return Features(
        feature=feature,
        linear=eqx.nn.Linear(16, 16, key=keys[0]),
        mlp=eqx.nn.MLP(16, 16, 16, 1, activation=jax.nn.gelu, key=keys[1]),
        rope=eqx.nn.RotaryPositionalEmbedding(16),
        attention=eqx.nn.MultiheadAttention(2, 16, key=keys[2]),
    )


@ox.filter_jit
def _gradient(model, x):
    return eqx.filter_value_and_grad(lambda m: jnp.mean(m(x) ** 2))(model)


@pytest.mark.deviceless
@pytest.mark.parametrize("target", ["h100", "tpu-v5p"])
@pytest.mark.parametrize("feature", FEATURES)
def test_a_step_that_compiles_for_the_cpu_compiles_for_every_target(feature, target):
    """The gradient of a step using `feature` compiles for the target: a memory report
    and an estimate (0.2-2.8 s each here)."""
    model, x = _features(feature), jnp.ones((8, 16))
    report = ox.memory_report(_gradient, model, x, target=target)
    assert report.device["argument"] > 0
    assert ox.estimate(_gradient, model, x, target=target).seconds > 0
