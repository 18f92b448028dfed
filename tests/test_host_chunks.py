"""A split host update's large groups computed a slice at a time (`host_chunks`): the
results written into the state they replace, slice by slice, so XLA:GPU holds no second
copy of a stacked weight's master, moments and value (Llama-2-70B's feed-forward
weights: 263 GB of them)."""

from typing import Any, Literal

import equinox as eqx
import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import offload_eqx as ox
import offload_eqx._optimizer.host as host_update
from offload_eqx._host import chunks as host_chunks
from offload_eqx._host.compute import (
    host_computations,
    on_host,
    traced_for,
    writes_in_place,
)
from offload_eqx._host.split import group_program, result_groups
from offload_eqx._sharding.memory_space import is_host_typed


class Pair(eqx.Module):
    a: Any  # arrays, or their shapes
    b: Any


@pytest.fixture
def small_slices(monkeypatch):
    """Slices of at most 4 KiB of results, so that test-sized groups are sliced."""
    monkeypatch.setattr(host_chunks, "CHUNK_BYTES", 4096)


def _params():
    return Pair(jnp.linspace(-1, 1, 64 * 32).reshape(64, 32), jnp.linspace(0, 2, 16))


def _grads(params):
    return jax.tree_util.tree_map(lambda p: jnp.cos(p * 3.0), params)


def _program(transform, params):
    """The jaxpr of the group computing `params.a`'s new value and state."""

    def update(g, s, p):
        u, s = transform.update(g, s, p)
        return optax.apply_updates(p, u), s

    return jax.make_jaxpr(update)(_grads(params), transform.init(params), params)


@pytest.mark.parametrize(
    "transform, sliced",
    [
        (optax.adamw(1e-2, weight_decay=0.1), True),
        (optax.lion(1e-3), True),
        (optax.sgd(1e-2, momentum=0.9), True),
        (optax.chain(optax.scale_by_trust_ratio(), optax.adam(1e-2)), False),  # a norm
        (optax.adafactor(1e-2), False),  # factored moments: reductions over rows
    ],
    ids=["adamw", "lion", "sgd_momentum", "trust_ratio", "adafactor"],
)
def test_only_an_elementwise_group_over_one_element_order_is_sliced(transform, sliced):
    params = Pair(jnp.linspace(-1, 1, 64 * 32).reshape(64, 32), None)
    closed = _program(transform, params)
    large = [j for j, v in enumerate(closed.out_avals) if np.prod(v.shape) > 1]
    assert len(result_groups(closed)) == 1  # one parameter: one group
    program, _ = group_program(closed, large)
    chunks = host_chunks.chunk_count(program, bound=4096)
    assert (chunks > 1) == sliced, chunks
    assert host_chunks.chunk_count(program, bound=1 << 30) == 1  # within the bound: whole
    if sliced:
        held = sum(np.prod(v.shape) * v.dtype.itemsize for v in program.out_avals)
        assert held / chunks <= 4096 and 64 * 32 % chunks == 0


@pytest.mark.parametrize(
    "transform, loops",
    [
        (optax.adamw(1e-2, weight_decay=0.1), 1),  # `a` sliced, `b` (16 elements) whole
        (optax.chain(optax.clip_by_global_norm(0.5), optax.adam(1e-2)), 0),  # one group
        (optax.MultiSteps(optax.adam(1e-2), every_k_schedule=2), 1),  # its cond, sliced
    ],
    ids=["adamw", "clip_adam", "multi_steps"],
)
def test_a_sliced_update_equals_one_call_step_after_step(small_slices, transform, loops):
    params = _params()
    state = transform.init(params)

    def update(grads, state, params):
        updates, new_state = transform.update(grads, state, params)
        return optax.apply_updates(params, updates), new_state

    def run(split, reuse):
        def step(grads, state, params):
            return on_host(
                update, grads, state, params, name="update", split=split, sliced=split,
                reuse=reuse,
            )  # fmt: skip

        return step

    sliced = jax.make_jaxpr(run(True, {0: 2, 1: 1}))(_grads(params), state, params)
    assert _count_loops(sliced) == loops
    # Written over the state (`reuse`) or into fresh host buffers (none given): the same.
    for _ in range(3):
        whole = jax.jit(run(False, None))(_grads(params), state, params)
        for reuse in ({0: 2, 1: 1}, None):
            split = jax.jit(run(True, reuse))(_grads(params), state, params)
            for x, y in zip(jax.tree_util.tree_leaves(whole), jax.tree_util.tree_leaves(split)):
                assert is_host_typed(y)
                # XLA:CPU fuses the slices apart: a few ulp of the terms (order 1e-2),
                # relative 2e-6 where a new value cancels to 1e-3.
                np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-6, atol=1e-8)
        params, state = whole


def test_the_optimizer_update_with_masters_sliced_equals_it_whole(small_slices, monkeypatch):
    """`ox.update_and_apply` with float32 masters for bfloat16 parameters, half of them in
    host memory, updated on the host split and sliced (`update="host_sliced"`, split as
    for XLA:GPU), against the same update in one host computation (`update="host"`),
    both traced as for XLA:GPU and run here."""
    adamw = optax.adamw(1e-3, weight_decay=0.1)
    opt = ox.offload_optimizer(adamw, update_on="host", master_dtype=jnp.float32)
    host = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host")
    wide = _params()
    model = Pair(jax.device_put(wide.a.astype(jnp.bfloat16), host), wide.b.astype(jnp.bfloat16))
    init: Any = opt.init  # optax types its parameters as arrays and containers
    state = init(wide)

    # Gradients given, not computed in the step: XLA:CPU may keep a bfloat16 gradient
    # computed beside its use in float32 (excess precision), differently in each program.
    grads = jax.tree_util.tree_map(lambda p: jnp.cos(p * 3.0).astype(jnp.bfloat16), wide)

    def run(split: bool):
        strategy = ox.Strategy("sliced", update="host_sliced" if split else "host")

        @ox.filter_jit(strategy=strategy)  # a function of its own: JAX caches traces by it
        def step(grads, model, state):
            return ox.update_and_apply(opt, grads, state, model)

        monkeypatch.setattr(host_update, "_split_calls", lambda delayed: split)
        with traced_for("cuda"):  # optax's arithmetic, not this machine's fused kernel
            jaxpr = jax.make_jaxpr(step)(grads, model, state)
            out = step(grads, model, state)
        names = [n for n in host_computations(jaxpr) if n == "optimizer update and apply"]
        return out, names, _count_loops(jaxpr)

    (whole, whole_state), names, loops = run(False)
    assert len(names) == 1 and loops == 0
    (split, split_state), names, loops = run(True)
    assert len(names) == 3 and loops == 1  # a: sliced; b (and the count): one call
    assert jax.typeof(split.a).memory_space == jax.memory.Space.Host
    for x, y in zip(jax.tree_util.tree_leaves((whole, whole_state)),
                    jax.tree_util.tree_leaves((split, split_state))):  # fmt: skip
        assert jax.typeof(x) == jax.typeof(y)
        np.testing.assert_allclose(
            np.asarray(x, np.float32), np.asarray(y, np.float32), rtol=1e-6, atol=1e-12
        )


def _count_loops(jaxpr) -> int:
    found = 0
    for eqn in jaxpr.jaxpr.eqns:
        if eqn.primitive.name in ("scan", "while"):
            found += 1
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            found += _count_loops(jax.extend.core.ClosedJaxpr(sub, ()))
    return found


def _h100_step(update: Literal["host", "host_sliced"]):
    """Two 256x1024 bfloat16 parameters in host memory, float32 masters and moments, the
    update on the host under a strategy with `update=update`, the state donated."""
    opt = ox.offload_optimizer(optax.adamw(1e-4), update_on="host", master_dtype=jnp.float32)
    strategy = ox.Strategy(update, update=update)

    @ox.filter_jit(donate="all-except-first", strategy=strategy)
    def step(grads, model, state):
        return ox.update_and_apply(opt, grads, state, model)

    shape = (256, 1024)
    wide = Pair(*(jax.ShapeDtypeStruct(shape, jnp.float32) for _ in range(2)))
    narrow = Pair(*(jax.ShapeDtypeStruct(shape, jnp.bfloat16) for _ in range(2)))
    host = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host")
    model = jax.tree_util.tree_map(
        lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=host), narrow
    )
    return step, (narrow, model, eqx.filter_eval_shape(opt.init, wide))


def _bytes(tree):
    return sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(tree))


@pytest.mark.deviceless
def test_the_h100_host_update_in_slices_holds_no_second_copy(monkeypatch):
    """Split by parameter (`update="host"`), the host holds one parameter's results
    beside the state (3.5 MiB); in slices of 256 KiB (`update="host_sliced"`), nothing
    but the gradients sent to it (1 MiB), every result written over its donated buffer,
    and a slice's results in device memory, crossing the link both ways. Within the
    slices' bound, the two compile alike."""
    monkeypatch.setattr(host_chunks, "CHUNK_BYTES", 1 << 18)
    step, args = _h100_step("host")
    grads, model, state = args
    held = _bytes(model) + _bytes(state)
    split = ox.memory_report(step, *args, target="h100")
    assert split.host["alias"] == held and split.host["temp"] > held // 2 - 64, dict(split.host)
    step, args = _h100_step("host_sliced")
    sliced = ox.memory_report(step, *args, target="h100")
    assert sliced.host["alias"] == held, dict(sliced.host)
    assert sliced.host["temp"] <= _bytes(grads) + 1024, dict(sliced.host)
    assert 0 < sliced.device["temp"] <= 2 * (1 << 18), dict(sliced.device)
    # The price, as the schedule has it: every result (new masters, moments and values,
    # 7 MiB) comes down to the device as part of its host call and goes back to the host.
    speeds = ox.TARGETS["h100"].speeds
    assert speeds is not None
    results = held - 4  # but Adam's count
    times = [
        ox.estimate(_h100_step(u)[0], *args, target="h100").simulation
        for u in ("host", "host_sliced")
    ]
    assert times[0] is not None and times[1] is not None
    down, up = results / speeds.h2d_bandwidth, results / speeds.d2h_bandwidth
    assert times[1].busy["host"] >= times[0].busy["host"] + 0.99 * down, (times, down)
    assert times[1].busy["d2h"] >= up, (times, up)
    monkeypatch.setattr(host_chunks, "CHUNK_BYTES", 1 << 30)
    whole = ox.memory_report(_h100_step("host_sliced")[0], *args, target="h100")
    assert dict(whole.host) == dict(split.host)


class Block(eqx.Module):
    w_in: Any = ox.field(memory="pinned_host")  # arrays, or their shapes
    w_out: Any = ox.field(memory="pinned_host")

    def __call__(self, x):
        h = ox.name(jax.nn.gelu(x @ self.w_in), "h")
        return x + h @ self.w_out


class Stack(eqx.Module):
    blocks: Block
    activations: ox.Activations = ox.activations(h="remat")

    def __call__(self, x):
        return ox.scan(self.blocks, x)


def _stack_step_and_args():
    """The README's block stack at 4 layers of 128 x 512 (256K parameters a weight: 3.5
    MiB of master, moments and value), AdamW with float32 masters on the host."""
    opt = ox.offload_optimizer(optax.adamw(1e-4), update_on="host", master_dtype=jnp.float32)

    def train_step(model, opt_state, x):
        loss_fn = lambda m: jnp.mean(m(x).astype(jnp.float32) ** 2)  # noqa: E731
        grads = eqx.filter_grad(loss_fn)(model)
        return ox.update_and_apply(opt, grads, opt_state, model)

    shape = lambda a, b: jax.ShapeDtypeStruct((4, a, b), jnp.bfloat16)  # noqa: E731
    model = Stack(Block(shape(128, 512), shape(512, 128)))
    wide = jax.tree_util.tree_map(lambda s: jax.ShapeDtypeStruct(s.shape, jnp.float32), model)
    state = eqx.filter_eval_shape(opt.init, wide)
    x = jax.ShapeDtypeStruct((64, 128), jnp.bfloat16)
    return train_step, (model, state, x)


@pytest.mark.deviceless
def test_fit_plans_the_sliced_update_where_the_whole_one_is_over_the_host_budget(monkeypatch):
    monkeypatch.setattr(host_chunks, "CHUNK_BYTES", 1 << 20)
    train_step, args = _stack_step_and_args()

    def report(update: Literal["host", "host_sliced"]):
        strategy = ox.Strategy(update, "pinned_host", "pinned_host", "remat", update=update)
        step = ox.filter_jit(train_step, strategy=strategy, donate="all")
        return ox.memory_report(step, *args, target="h100")

    whole, sliced = report("host"), report("host_sliced")
    assert sliced.host_total < whole.host_total - (1 << 20), (whole.host_total, sliced.host_total)
    result = ox.fit(
        ox.filter_jit(train_step, donate="all"), *args, target="h100",
        device_budget=sliced.total + (1 << 16), host_budget=sliced.host_total, max_compiles=6,
    )  # fmt: skip
    assert result.strategy.update == "host_sliced", result.table()
    assert (result.estimate.host_bytes or 0) <= sliced.host_total
    # The same plan with the update whole: ruled out by the host budget (compiled, or
    # bounded by what a compiled plan of its placement needed).
    best = next(c for c in result.candidates if c.status == "best")
    twin = next(c for c in result.candidates if c.label == best.label.replace("_sliced", ""))
    assert "host" in twin.status and twin.status.startswith(("over", "not compiled: needs")), (
        twin.status
    )
    assert "host" in result.binds


@pytest.mark.deviceless
@pytest.mark.parametrize("params", ["device", {"*.w_in": "pinned_host", "*": "device"}])
def test_a_sliced_update_of_parameters_on_the_device_compiles_for_the_h100(monkeypatch, params):
    """The new values of parameters on the device replace no host operand: each slice is
    written into a fresh host buffer. Made by a host computation, that buffer aborted
    the process in jaxlib 0.12's XLA:GPU (`HostOffloader`, a shape without a layout),
    `ox.fit` included, which compiles such plans."""
    monkeypatch.setattr(host_chunks, "CHUNK_BYTES", 1 << 20)
    train_step, args = _stack_step_and_args()
    strategy = ox.Strategy("s", params, "pinned_host", "remat", update="host_sliced")
    step = ox.filter_jit(train_step, strategy=strategy, donate="all")
    report = ox.memory_report(step, *args, target="h100")
    state = sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(args[1]))
    assert state <= report.host_total <= 1.3 * state + (1 << 20), dict(report.host)


def test_a_sliced_update_on_the_host_needs_the_state_in_host_memory():
    with pytest.raises(ValueError, match=r"update='host_sliced' and optimizer='device'"):
        ox.Strategy("s", optimizer="device", update="host_sliced")


def test_a_lone_group_in_slices_still_writes_over_the_state(small_slices):
    """One parameter, no count (SGD): one group, one host call, in slices. It writes over
    the state all the same, so the step donates the state (`writes_in_place`)."""
    param = jnp.linspace(-1.0, 1.0, 64 * 32).reshape(64, 32)

    def traced(sliced: bool):
        def step(g, p):
            def update(g, p):
                return (p - 0.1 * g,)  # result 0 replaces argument 1 (`reuse`)

            return on_host(
                update, g, p, name="optimizer update", split=True, sliced=sliced,
                reuse={0: 1},
            )  # fmt: skip

        return jax.make_jaxpr(step)(jnp.cos(param), param)

    assert host_computations(traced(True)) == ["optimizer update"]
    assert _count_loops(traced(True)) == 1 and _count_loops(traced(False)) == 0
    assert writes_in_place(traced(True), "cuda")
    assert not writes_in_place(traced(False), "cuda")


def test_a_squeeze_keeps_the_order_and_a_large_constant_is_not_sliced():
    x = jnp.ones((64, 32))
    squeezed = jax.make_jaxpr(lambda g, p: [jnp.squeeze((p - g)[None], 0)])(x, x)
    assert "squeeze" in str(squeezed)
    assert host_chunks.chunk_count(squeezed, bound=4096) > 1
    table = jnp.arange(64 * 32, dtype=jnp.float32).reshape(64, 32)
    constant = jax.make_jaxpr(lambda g, p: [p - g * table])(x, x)
    assert constant.consts  # the table is a constant of the program, given whole
    assert host_chunks.chunk_count(constant, bound=4096) == 1


def test_our_kernel_and_a_delayed_updates_cond_computed_in_slices_equal_them_whole():
    """The delayed update's host computation: `cond(ready, kernel, keep)`. Sliced, the
    cond is taken on each slice and the kernel called on slices of its operands (its
    scalars whole): the same bits as the whole computation, whichever branch runs."""
    from offload_eqx._host.kernels.load import target
    from offload_eqx._optimizer.fused_adamw import _one_call

    name = target("adamw")
    if name is None:
        pytest.skip("the host kernel is not built here")
    n = 4096
    g = jnp.cos(jnp.arange(n, dtype=jnp.float32)).astype(jnp.bfloat16)
    m, mu, nu = (jnp.sin(jnp.arange(n, dtype=jnp.float32) * k) for k in (1.0, 2.0, 3.0))
    nu = nu * nu
    s = jnp.asarray([0.1, 0.9, 0.001, 0.999, 0.1, 0.001, 0.0, 1e-8, 0.01, -1e-3, 0.0, 0.0])

    def program(ready, g, m, mu, nu):
        def full():
            return _one_call(name, [[g], [m], [mu], [nu], [g]], s, np.asarray([3], np.int8))[0]

        return jax.lax.cond(ready, full, lambda: (m, mu, nu, m.astype(jnp.bfloat16)))

    closed = jax.make_jaxpr(program)(True, g, m, mu, nu)
    run = jax.jit(host_chunks.slice_program(closed, 4))
    for ready in (True, False):
        whole = jax.jit(program)(ready, g, m, mu, nu)
        parts = [run(np.int32(k), ready, g, m, mu, nu) for k in range(4)]
        for j, expected in enumerate(whole):
            got = jnp.concatenate([part[j] for part in parts])
            np.testing.assert_array_equal(np.asarray(got), np.asarray(expected))
