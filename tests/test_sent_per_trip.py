"""A stack a loop builds only to send it to host memory is sent a slice per trip
(`_jit/sent_per_trip`): the gradients of scanned layers updated on the host reach host
memory trip by trip, and the device never holds them all."""

import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.core import eval_jaxpr
from jax.extend.core import check_jaxpr

import offload_eqx as ox
from offload_eqx._inspect.memory_report import compiled_report, program_of_step
from offload_eqx._jit import compile as compile_module, sent_per_trip as sent_per_trip_module
from offload_eqx._jit.sent_per_trip import sent_per_trip
from offload_eqx._targets.targets import get_target

HOST = jax.memory.Space.Host


def _scan(w):
    def body(carry, wi):
        return carry + jnp.sum(wi), wi * 2.0

    return jax.lax.scan(body, 0.0, w)


def _sends(jaxpr, space=HOST):
    return [
        e for e in jaxpr.eqns if e.primitive.name == "device_put" and space in e.params["devices"]
    ]


def _scan_eqn(closed):
    return next(e for e in closed.jaxpr.eqns if e.primitive.name == "scan")


def _same(closed, rewritten, *args):
    check_jaxpr(rewritten.jaxpr)
    want = eval_jaxpr(closed.jaxpr, closed.consts, *args)
    got = eval_jaxpr(rewritten.jaxpr, rewritten.consts, *args)
    for a, b in zip(want, got):
        assert jax.typeof(a) == jax.typeof(b)
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_stack_only_sent_to_host_is_sent_by_each_trip():
    def f(w):
        total, stacked = _scan(w)
        return total, jax.device_put(stacked, HOST)

    w = jnp.arange(24.0).reshape(4, 6)
    closed = jax.make_jaxpr(f)(w)
    rewritten = sent_per_trip(closed)
    assert rewritten is not closed
    assert not _sends(rewritten.jaxpr)  # no send after the loop
    scan = _scan_eqn(rewritten)
    assert len(_sends(scan.params["jaxpr"].jaxpr)) == 1  # one in its body
    assert str(scan.outvars[1].aval) == "float32<host>[4,6]"
    _same(closed, rewritten, w)


def test_sends_of_several_stacks_in_one_put_lose_only_those():
    def f(w, v):
        _, a = _scan(w)
        _, b = _scan(w + 1.0)
        return jax.device_put((a, v, b), HOST)

    w, v = jnp.ones((3, 2)), jnp.arange(5.0)
    closed = jax.make_jaxpr(f)(w, v)
    assert len(_sends(closed.jaxpr)) == 1  # one put of three operands
    rewritten = sent_per_trip(closed)
    (left,) = _sends(rewritten.jaxpr)
    assert [str(x.aval) for x in left.invars] == ["float32[5]"]
    _same(closed, rewritten, w, v)


def test_an_unrolled_loop_keeps_its_send_after():
    """XLA:GPU fails to compile an unrolled loop's stack in host memory."""

    def f(w):
        _, stacked = jax.lax.scan(lambda c, wi: (c, wi * 2.0), 0.0, w, unroll=2)
        return jax.device_put(stacked, HOST)

    closed = jax.make_jaxpr(f)(jnp.ones((4, 2)))
    assert sent_per_trip(closed) is closed


@pytest.mark.parametrize("other", ["read_again", "to_device", "returned"])
def test_a_stack_used_otherwise_is_left_as_it_is(other):
    def f(w):
        _, stacked = _scan(w)
        if other == "to_device":
            return jax.device_put(stacked, jax.memory.Space.Device)
        sent = jax.device_put(stacked, HOST)
        return (sent, stacked * 3.0) if other == "read_again" else (sent, stacked)

    closed = jax.make_jaxpr(f)(jnp.ones((3, 2)))
    assert sent_per_trip(closed) is closed


class Layer(eqx.Module):
    w: jax.Array

    def __call__(self, x):
        return jnp.tanh(x @ self.w)


class Stack(eqx.Module):
    layers: Layer

    def __call__(self, x):
        return ox.scan(self.layers, x)


def _training(layers, dim, dtype=jnp.float32):
    model = Stack(Layer(jnp.zeros((layers, dim, dim), dtype)))
    opt = ox.offload_optimizer(optax.adam(1e-2), update_on="host")

    @ox.filter_jit(strategy=ox.Strategy("device_params", "device", "pinned_host", update="host"))
    def step(model, state, x):
        grads = eqx.filter_grad(lambda m: jnp.mean(m(x).astype(jnp.float32) ** 2))(model)
        return ox.update_and_apply(opt, grads, state, model)

    return model, opt, step


def _h100(step, *args):
    """The step's memory report for the h100 and its compiled text."""
    program = program_of_step(step, args, {})
    report, compiled = compiled_report(program, get_target("h100"), "step")
    return report, compiled.as_text()


@pytest.mark.deviceless
def test_the_backward_loop_writes_each_gradient_into_host_memory_on_the_h100(monkeypatch):
    """8 layers of 2048² in bfloat16, updated on the host: the backward loop writes each
    layer's gradient into a stack in host memory (a `dynamic-update-slice` into memory
    space 5), where it sent the stack after the loop before, and the device needs less."""
    model, opt, step = _training(8, 2048, jnp.bfloat16)
    model = eqx.filter_eval_shape(lambda: model)
    args = (
        model,
        eqx.filter_eval_shape(opt.init, model),
        jax.ShapeDtypeStruct((512, 2048), jnp.bfloat16),
    )
    per_trip, text = _h100(step, *args)
    for module in (compile_module, sent_per_trip_module):
        monkeypatch.setattr(module, "sent_per_trip", lambda closed: closed)
    after, text_after = _h100(_training(8, 2048, jnp.bfloat16)[2], *args)
    into_host = re.compile(
        r"dynamic-update-slice-start.* = \(\(bf16\[8,2048,2048\]\{2,1,0:S\(5\)\}"
    )
    whole = re.compile(r"copy-start.* = \(bf16\[33554432\]\{0:S\(5\)\}")  # flattened
    assert into_host.search(text) and not into_host.search(text_after)
    assert whole.search(text_after) and not whole.search(text)
    # 16 MiB less here (the update fetched afterwards needs the stack's room); 13B: 24 GiB.
    assert per_trip.total <= after.total - 15 * 2**20, (per_trip.total, after.total)


def test_training_still_equals_plain_equinox_and_optax():
    """On this machine the rewritten step computes what `eqx.filter_jit` + optax does."""
    model, opt, step = _training(3, 16)
    model = eqx.tree_at(
        lambda m: m.layers.w, model, jax.random.normal(jax.random.key(0), (3, 16, 16)) / 4
    )
    x = jax.random.normal(jax.random.key(1), (8, 16))
    adam = optax.adam(1e-2)

    @eqx.filter_jit
    def plain(model, state, x):
        grads = eqx.filter_grad(lambda m: jnp.mean(m(x) ** 2))(model)
        updates, state = adam.update(grads, state, model)
        return eqx.apply_updates(model, updates), state

    ours, theirs = (model, opt.init(model)), (model, adam.init(model))
    for _ in range(3):
        ours, theirs = step(*ours, x), plain(*theirs, x)
    np.testing.assert_array_equal(ours[0].layers.w, theirs[0].layers.w)


class UnrolledStack(eqx.Module):
    layers: Layer

    def __call__(self, x):
        return ox.scan(self.layers, x, unroll=2)


@pytest.mark.deviceless
def test_an_unrolled_scan_updated_on_the_host_compiles_for_the_h100():
    """Its gradients stay sent after the loop (`test_an_unrolled_loop_keeps_its_send_after`):
    sent by each trip, XLA:GPU fails to compile the program."""
    model = eqx.filter_eval_shape(lambda: UnrolledStack(Layer(jnp.zeros((4, 64, 64)))))
    opt = ox.offload_optimizer(optax.adam(1e-2), update_on="host")

    @ox.filter_jit(strategy=ox.Strategy("device_params", "device", "pinned_host", update="host"))
    def step(model, state, x):
        grads = eqx.filter_grad(lambda m: jnp.mean(m(x) ** 2))(model)
        return ox.update_and_apply(opt, grads, state, model)

    args = (
        model,
        eqx.filter_eval_shape(opt.init, model),
        jax.ShapeDtypeStruct((8, 64), jnp.float32),
    )
    assert ox.memory_report(step, *args, target="h100").fits
