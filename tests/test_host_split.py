"""The host update split into chained calls (`on_host(split=True)`), so that XLA:GPU
writes the optimizer state in place: one call per parameter, the state donated, the
host holding the state once plus one parameter's results (was: twice the state)."""

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import offload_eqx as ox
from offload_eqx._host.compute import host_computations, on_host


class Params(eqx.Module):
    a: Any  # arrays, or their shapes
    b: Any


def _adam_update(transform):
    def update(grads, state, params):
        updates, new_state = transform.update(grads, state, params)
        return optax.apply_updates(params, updates), new_state

    return update


def _calls(fn, *args):
    return [n for n in host_computations(jax.make_jaxpr(fn)(*args)) if n == "update"]


@pytest.mark.parametrize(
    "transform, calls",
    [
        (optax.adamw(1e-2, weight_decay=0.1), 2),  # one per parameter (the count joins one)
        (optax.chain(optax.clip_by_global_norm(0.5), optax.adam(1e-2)), 1),  # reads every one
        (optax.MultiSteps(optax.adam(1e-2), every_k_schedule=2), 2),  # a cond, per branch
    ],
    ids=["adamw", "clip_adam", "multi_steps"],
)
def test_a_split_update_is_one_call_per_group_and_bit_equal_to_one_call(transform, calls):
    params = Params(jnp.linspace(-1, 1, 64).reshape(8, 8), jnp.linspace(0, 2, 16))
    state = transform.init(params)
    grads = jax.tree_util.tree_map(lambda p: jnp.cos(p * 3.0), params)
    update = _adam_update(transform)

    def run(split):
        def step(grads, state, params):
            return on_host(update, grads, state, params, name="update", split=split)

        return step

    assert len(_calls(run(True), grads, state, params)) == calls
    assert len(_calls(run(False), grads, state, params)) == 1
    # The same arithmetic, compiled apart: XLA:CPU may fuse it differently (1 ulp seen),
    # within the masters' bound of 1e-6 relative, step after step (MultiSteps applies
    # every second).
    for _ in range(3):
        whole = jax.jit(run(False))(grads, state, params)
        split = jax.jit(run(True))(grads, state, params)
        for x, y in zip(jax.tree_util.tree_leaves(whole), jax.tree_util.tree_leaves(split)):
            np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-6, atol=1e-12)
        params, state = whole


def _step_and_args(delay, chain=False):
    adamw = optax.adamw(1e-4)
    tx = optax.chain(optax.clip_by_global_norm(1.0), adamw) if chain else adamw
    opt = ox.offload_optimizer(tx, update_on="host", master_dtype=jnp.float32, delay=delay)

    @ox.filter_jit(donate="all-except-first")
    def step(grads, model, state):
        return ox.update_and_apply(opt, grads, state, model)

    shape = (256, 1024)
    wide = Params(*(jax.ShapeDtypeStruct(shape, jnp.float32) for _ in range(2)))
    narrow = Params(*(jax.ShapeDtypeStruct(shape, jnp.bfloat16) for _ in range(2)))
    model = jax.tree_util.tree_map(
        lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=_host()), narrow
    )
    state = eqx.filter_eval_shape(opt.init, wide)
    return step, (narrow, model, state)


def _host():
    return jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host")


def _bytes(tree):
    return sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(tree))


@pytest.mark.deviceless
def test_the_h100_host_update_writes_the_state_in_place_holding_one_parameters_results():
    step, args = _step_and_args(delay=0)
    _, model, state = args
    report = ox.memory_report(step, *args, target="h100")
    held = _bytes(model) + _bytes(state)
    one = held // 2  # two parameters of one shape: one parameter's master, moments, value
    assert report.host["alias"] == held, dict(report.host)
    assert report.host_total - report.host["argument"] <= one + 64, dict(report.host)  # + count
    # A global norm reads every gradient for every result: one call, nothing donated,
    # the results beside the state (as every host update was before the split).
    step, args = _step_and_args(delay=0, chain=True)
    whole = ox.memory_report(step, *args, target="h100")
    assert whole.host["alias"] == 0 and whole.host["output"] >= held, dict(whole.host)


@pytest.mark.deviceless
def test_a_delayed_h100_host_update_is_written_in_slices_over_the_state():
    """The latency-hiding scheduler that overlaps a delayed update copies the results of
    whole calls into the state after the last one, holding them all at once: the
    delayed update is computed in slices instead (`on_host(slice_all=True)`), each
    written back over the donated state. Beside the state, the host holds a second copy
    of the pending gradients at most (for each leaf, the new ones are sent while the old
    ones are read: 3 MiB of 9 here, where one call held 9)."""
    step, args = _step_and_args(delay=1)
    grads, model, state = args
    report = ox.memory_report(step, *args, target="h100")
    held = _bytes(model) + _bytes(state)
    assert report.host["alias"] == held, dict(report.host)
    pending = _bytes(state.inner.pending)
    assert report.host["temp"] <= 2 * pending, dict(report.host)
