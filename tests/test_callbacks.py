"""Host callbacks in a step compiled for a GPU target without a GPU (`_targets/callbacks`):
`eqx.error_if` (megalodon-jax and diffrax check their inputs with it), `jax.debug.print`
and `io_callback`s compile for `target="h100"` (JAX alone refuses: "Unknown
backend: 'gpu' requested"), and the step run on this machine still runs them."""

import equinox as eqx
import jax
import jax.numpy as jnp
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
