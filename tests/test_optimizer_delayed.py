"""`ox.offload_optimizer(..., delay=1)`: ZeRO-Offload's delayed parameter update.

Checked against a reference written from the definition (each step applies the previous
step's gradients, the first applies none) for the chains users write, with the update on
the host and on the device, under the strategies that place the state differently; the
first step changes nothing; `ox.apply_pending` applies the last gradients; a run restored
from a checkpoint continues exactly; the pending gradients live, and are typed, where the
plan puts the optimizer state; the audit lists each gradient sent once and no optimizer
state moved; bad options are refused. On the deviceless h100 the host computation spans
the forward and backward loops and no host buffer is copied after it.
"""

import functools
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import (
    HostSquare,
    HostStack,
    assert_close_to_scale,
    loss_fn,
    rotated,
    scanned_model,
    to_numpy,
)
from test_optimizer_host import CHAINS

import offload_eqx as ox
from offload_eqx._optimizer.delayed import Delayed
from offload_eqx._planning.hlo import arrays

STEPS = 4


def _batches(steps=STEPS) -> list:
    return [jax.random.normal(jax.random.key(10 + i), (8, 16)) for i in range(steps)]


@functools.cache
def _reference(name: str, steps: int = STEPS, apply_last: bool = False) -> tuple:
    """The definition, with chain `name` over `_batches(steps)`: `p_{t+1} = p_t +
    U(g_{t-1})`, `g_t` taken at `p_t`, nothing applied at the first step; `apply_last`
    then applies the last gradient. Returns `(parameters, pending gradient)`."""
    transform = CHAINS[name]()
    model = scanned_model(jax.random.key(0))
    state, pending = transform.init(model), None
    grad = eqx.filter_jit(jax.grad(loss_fn))

    @eqx.filter_jit
    def apply(model, grads, state):
        updates, state = transform.update(grads, state, model)
        return eqx.apply_updates(model, updates), state

    for x in _batches(steps):
        grads = grad(model, x)
        if pending is not None:
            model, state = apply(model, pending, state)
        pending = grads
    if apply_last:
        model, state = apply(model, pending, state)
    return model, pending


def _step(opt, strategy):
    @ox.filter_jit(strategy=strategy, donate="all")
    def step(model, state, x):
        grads = eqx.filter_grad(loss_fn)(model, x)
        return ox.update_and_apply(opt, grads, state, model)

    return step


def _train(opt, strategy, batches, model=None, state=None) -> tuple[Any, Any]:
    model = ox.place(scanned_model(jax.random.key(0)), strategy) if model is None else model
    state = opt.init(model) if state is None else state
    step = _step(opt, strategy)
    for x in batches:
        model, state = step(model, state, x)
    return model, state


# Where the update runs and where the state lives: on the host, state in host memory
# (hybrid, offload_optimizer); on the device, state fetched from host memory
# (offload_params keeps it on the host); declared on the host but moved to the device
# with the state by the strategy (baseline).
PLACES = {
    "host-hybrid": ("host", "hybrid"),
    "host-offload_optimizer": ("host", "offload_optimizer"),
    "device-offload_params": ("device", "offload_params"),
    "host-baseline": ("host", "baseline"),
}

# Each chain with the host update under hybrid and one other place in turn (all with
# `--full`).
CASES = [
    pytest.param(name, *PLACES[place], id=f"{name}-{place}", marks=marks)
    for name, place, marks in (
        (p.values[0], p.values[1], p.marks)
        for p in rotated(CHAINS, PLACES, ("host-hybrid",), group="delayed")
    )
]


@pytest.mark.parametrize("name, update_on, strategy", CASES)
def test_matches_the_definition(name, update_on, strategy):
    reference, last = _reference(name)
    opt = ox.offload_optimizer(CHAINS[name](), update_on=update_on, delay=1)
    model, state = _train(opt, strategy, _batches())
    assert_close_to_scale(model, reference)
    assert isinstance(state.inner, Delayed)
    # The pending gradients are the last step's, in the optimizer state's memory.
    assert_close_to_scale(state.inner.pending, eqx.filter(last, eqx.is_inexact_array))
    on_host = ox.STRATEGIES[strategy].optimizer != "device"
    space = jax.memory.Space.Host if on_host else jax.memory.Space.Device
    for leaf in jax.tree_util.tree_leaves(state.inner.pending):
        assert jax.typeof(leaf).memory_space == space
        assert leaf.sharding.memory_kind == ("pinned_host" if on_host else "device")


@pytest.mark.parametrize("update_on", ["host", "device"])
def test_the_first_step_changes_neither_parameters_nor_state(update_on):
    opt = ox.offload_optimizer(CHAINS["clip_adamw"](), update_on=update_on, delay=1)
    start = ox.place(scanned_model(jax.random.key(0)), "hybrid")
    before = to_numpy(start)
    initial: Any = opt.init(start)
    fresh = to_numpy(initial.inner.state)
    model, state = _train(opt, "hybrid", _batches(1), model=start)
    assert_close_to_scale(model, before)
    assert_close_to_scale(state.inner.state, fresh)  # Adam's count and moments untouched
    assert bool(np.asarray(state.inner.ready))


def test_apply_pending_applies_the_last_gradients_once():
    batches = _batches()
    opt = ox.offload_optimizer(CHAINS["adamw_mask"](), update_on="host", delay=1)
    model, state = _train(opt, "hybrid", batches)
    model, state = ox.filter_jit(lambda m, s: ox.apply_pending(opt, s, m), strategy="hybrid")(
        model, state
    )
    assert_close_to_scale(model, _reference("adamw_mask", apply_last=True)[0])
    assert not bool(np.asarray(state.inner.ready))
    # The next step applies nothing: it only keeps its gradients. (It donates the model,
    # host-resident parameters included, so the values are kept aside first.)
    before = jax.tree_util.tree_map(np.asarray, model)
    again, _ = _train(opt, "hybrid", _batches(1), model=model, state=state)
    assert_close_to_scale(again, before)


def test_apply_pending_refuses_a_state_without_pending_gradients():
    opt = ox.offload_optimizer(optax.adam(1e-2), update_on="host")
    model: Any = scanned_model(jax.random.key(0))
    with pytest.raises(TypeError, match=r"no pending gradients.*delay=1"):
        ox.apply_pending(opt, opt.init(model), model)


def test_a_restored_run_continues_exactly(tmp_path):
    """The pending gradient is part of the optimizer state: a run checkpointed after two
    steps and restored reproduces the uninterrupted one."""
    batches = _batches()
    opt = ox.offload_optimizer(CHAINS["clip_adamw"](), update_on="host", delay=1)
    whole, _ = _train(opt, "hybrid", batches)
    half = _train(opt, "hybrid", batches[:2])
    ox.save_checkpoint(tmp_path / "ckpt", half)
    fresh: Any = scanned_model(jax.random.key(0))
    like = (fresh, opt.init(fresh))
    model, state = ox.restore_checkpoint(tmp_path / "ckpt", like, "hybrid")
    assert bool(np.asarray(state.inner.ready))
    resumed, _ = _train(opt, "hybrid", batches[2:], model=model, state=state)
    assert_close_to_scale(resumed, whole)


@pytest.mark.parametrize(
    "options, match",
    [
        ({"delay": 2}, r"delay=\.\.\.\) is 2; expected 0 .* or 1"),
        ({"delay": True}, r"delay=\.\.\.\) is True"),
        ({"delay": 1, "stream": "leaf"}, r"delay=1, stream='leaf'.*Drop `stream`"),
    ],
)
def test_bad_delays_are_refused_when_wrapping(options, match):
    with pytest.raises(ValueError, match=match):
        ox.offload_optimizer(optax.adam(1e-2), **options)


def test_audit_lists_each_gradient_sent_once_and_no_optimizer_state():
    layers = 4
    opt = ox.offload_optimizer(CHAINS["clip_adamw"](), update_on="host", delay=1)
    model = ox.place(HostStack(HostSquare(jnp.full((layers, 32, 32), 0.01))), "hybrid")
    state = opt.init(model)

    @ox.filter_jit(strategy="hybrid", donate="all")
    def step(model, state, x):
        grads = eqx.filter_grad(lambda m: jnp.mean(m(x) ** 2))(model)
        return ox.update_and_apply(opt, grads, state, model)

    report = ox.audit(step, model, state, jnp.ones((4, 32)))
    assert not report.select(kind="optimizer")
    assert not report.select("host-to-device", phase="update")
    # The weight is host-resident: its gradient is made in host memory, layer by layer,
    # by the backward loop; nothing else is sent for the update.
    (sent,) = report.select("device-to-host", kind="gradient")
    assert sent.count == layers and sent.what == "model.layers.w"


def _state_bytes(state) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(state))


@pytest.mark.parametrize("delay", [0, 1])
def test_a_host_update_writes_its_state_in_place_on_the_cpu(delay):
    """Issue 49: on XLA:CPU, where the host computation is inlined in the step, the
    optimizer state in host memory is donated and written in place: the compiled program
    aliases every byte of it (one copy of the state, no fresh buffer per step), and the
    state passed in is consumed, as `donate="all"` says."""
    opt = ox.offload_optimizer(optax.adam(1e-2), update_on="host", delay=delay)
    model = ox.place(scanned_model(jax.random.key(0)), "hybrid")
    state = opt.init(model)
    x = _batches(1)[0]
    step = _step(opt, "hybrid")
    report = ox.memory_report(step, model, state, x, target="cpu")
    assert report.device["alias"] >= _state_bytes(state)
    host = [x for x in jax.tree_util.tree_leaves(state) if x.sharding.memory_kind == "pinned_host"]
    new_model, new_state = step(model, state, x)
    assert host and all(x.is_deleted() for x in host)
    for leaf in jax.tree_util.tree_leaves(new_state):  # still host memory, typed so
        assert leaf.sharding.memory_kind == "pinned_host"
        assert "<host>" in str(jax.typeof(leaf))


@pytest.mark.deviceless
def test_a_delayed_host_update_is_written_over_its_donated_state_for_the_h100():
    """Where the host computation is a host call of its own (XLA:GPU), its results get
    buffers of their own; a delayed update is computed in slices written back over the
    donated state (`_host.calls`), so the compile for the h100 aliases every host
    argument the update replaces."""
    opt = ox.offload_optimizer(optax.adam(1e-2), update_on="host", delay=1)
    model = ox.place(scanned_model(jax.random.key(0)), "hybrid")
    state = opt.init(model)
    report = ox.memory_report(_step(opt, "hybrid"), model, state, _batches(1)[0], target="h100")
    assert report.host["alias"] == report.host["argument"] > 0, dict(report.host)


# -- the real compiler ------------------------------------------------------------------


def _schedule(delay):
    layers, dim = 8, 1024
    model = eqx.filter_eval_shape(lambda: HostStack(HostSquare(jnp.zeros((layers, dim, dim)))))
    opt = ox.offload_optimizer(CHAINS["clip_adamw"](), update_on="host", delay=delay)
    state = eqx.filter_eval_shape(opt.init, model)

    @ox.filter_jit(strategy="hybrid", donate="all")
    def step(model, state, x):
        grads = eqx.filter_grad(lambda m: jnp.mean(m(x) ** 2))(model)
        return ox.update_and_apply(opt, grads, state, model)

    return ox.estimate(
        step, model, state, jax.ShapeDtypeStruct((256, dim), jnp.float32), target="h100"
    )


@pytest.mark.deviceless
def test_h100_delayed_host_update_spans_the_forward_and_backward_loops():
    """Issue 29: in the compiled schedule, the delayed host update starts before the
    forward loop and is waited for after the backward loop; the device hardly waits for
    it, no host buffer is copied after it, and the step is faster than without delay."""
    delayed, plain = _schedule(1), _schedule(0)
    assert delayed.simulation is not None and plain.simulation is not None
    program = delayed.simulation.program
    entry = program.computations[program.entry]
    order = [i.name for i in entry.instructions]
    kinds = {i.name: i for i in entry.instructions}
    whiles = [n for n in order if kinds[n].opcode == "while"]
    start = next(n for n in order if "call-start" in n and kinds[n].opcode != "get-tuple-element")
    done = next(n for n in order if "call-done" in n and kinds[n].opcode != "get-tuple-element")
    assert len(whiles) == 2
    assert order.index(start) < order.index(whiles[0]) < order.index(whiles[1]) < order.index(done)
    # The device waits for the host only for what the host work outlasts the loops by
    # (priced as XLA:CPU runs it, one loop per result, 5.2 ms of host work against 3 ms
    # of loops); without the delay, for all of it.
    waited, busy = delayed.simulation.waited.get("host", 0.0), delayed.simulation.busy["host"]
    assert waited < 0.5 * busy, delayed.simulation.waited
    assert plain.simulation.waited["host"] > 0.9 * plain.simulation.busy["host"]
    # No copy of a host buffer (the parameters, the moments) into the donated outputs.
    copies = [
        i.name
        for i in entry.instructions
        if i.opcode == "copy" and any(a.host and a.bytes > 2**20 for a in arrays(i.type))
    ]
    assert not copies
    # Delayed, the step lasts as long as its host work (the loops hide beside it);
    # undelayed, the loops and then the host work.
    assert delayed.seconds < 0.7 * plain.seconds, (delayed.seconds, plain.seconds)
