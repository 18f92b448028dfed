"""The few conditions JAX reports only as text, recognised in one place (`_errors`) and
pinned here against JAX's own messages: a JAX upgrade that rewords them fails here."""

import jax
import jax.numpy as jnp
import pytest

from offload_eqx._errors import is_placement_mismatch, mixes_memory_spaces


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
