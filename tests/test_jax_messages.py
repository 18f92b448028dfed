"""The few conditions JAX reports only as text, recognised in one place (`_errors`) and
pinned here against JAX's own messages: a JAX upgrade that rewords them fails here."""

import jax
import jax.numpy as jnp
import pytest

from offload_eqx._base.errors import (
    is_host_cotangent_mismatch,
    is_placement_mismatch,
    mixes_memory_spaces,
)
from offload_eqx._jit.call_errors import is_deleted_buffer


def test_mixed_memory_spaces_is_recognised():
    host = jax.device_put(jnp.ones((2, 2)), jax.memory.Space.Host)
    with pytest.raises(ValueError) as caught:
        jax.jit(lambda a, b: a @ b).trace(host, jnp.ones((2, 2)))
    assert mixes_memory_spaces(caught.value)
    assert not mixes_memory_spaces(ValueError("another error"))


def test_argument_in_another_memory_than_in_shardings_is_recognised():
    device = jax.devices()[0]
    host = jax.sharding.SingleDeviceSharding(device, memory_kind="pinned_host")
    f = jax.jit(lambda x: x, in_shardings=host, out_shardings=host)
    with pytest.raises(ValueError) as caught:
        f(jnp.ones(3))  # in device memory
    assert is_placement_mismatch(caught.value)
    assert not is_placement_mismatch(ValueError("another error"))


def test_a_host_value_differentiated_outside_a_region_is_recognised():
    """A scalar computed on host memory turns device-typed in the next scalar operation,
    and the backward pass then fails on the cotangent's memory."""
    host = jax.device_put(jnp.ones((2, 2)), jax.memory.Space.Host)
    with pytest.raises(ValueError) as caught:
        jax.jit(jax.grad(lambda w: 1e-3 * jnp.sum(w**2))).trace(host)
    assert is_host_cotangent_mismatch(caught.value)
    assert not is_host_cotangent_mismatch(ValueError("Expected cotangent type float32[2]"))


def test_a_deleted_argument_is_recognised():
    x = jnp.ones(3)
    f = jax.jit(lambda x: x + 1)
    x.delete()
    with pytest.raises((ValueError, RuntimeError)) as caught:
        f(x)
    assert is_deleted_buffer(caught.value)
    assert not is_deleted_buffer(ValueError("another error"))


def test_a_closed_over_host_value_fetched_in_a_loop_body_fails_in_jax():
    """Why `ox.scan`/`ox.checkpoint` fetch a host leaf that a loop body closes over outside
    the loop (`_memory_space.fetch_outside`): JAX 0.10.2 cannot transpose the fetch inside
    the body. When this starts passing, the workaround can go."""
    host = jax.device_put(jnp.ones((4, 4)) * 0.1, jax.memory.Space.Host)

    def loss(w, x):
        def body(c, _):
            return jnp.tanh(c @ jax.device_put(w, jax.memory.Space.Device)), None

        return jnp.sum(jax.lax.scan(body, x, length=3)[0])

    with pytest.raises(ValueError, match="Expected cotangent type float32<host>"):
        jax.jit(jax.grad(loss)).trace(host, jnp.ones(4))
