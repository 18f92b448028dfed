"""The device update of offloaded state in slices: each large weight's update (and, with
`ox.update_and_apply`, its new value) computed a slice at a time where its state lives,
under `stream=None` (`whole_slices`) and `stream="leaf"` (`slices`). The same training as
plain optax, and never more device memory than keeping everything on the device."""

import os
import re
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import offload_eqx as ox
from offload_eqx._inspect.memory_report import compiled_report, program_of_step
from offload_eqx._optimizer import slices
from offload_eqx._optimizer.fused_adamw import optax_only
from offload_eqx._optimizer.slices import Slices, weight_slices
from offload_eqx._targets.targets import get_target


@pytest.fixture
def small_slices(monkeypatch):
    """Slices of a few hundred bytes, so that small test weights are sliced."""
    monkeypatch.setattr(slices, "SLICE_BYTES", 512)


def _mlp() -> Any:
    # Unmodified Equinox layers: weights of 32 x 16 and 8 x 32, biases of 32 and 8.
    return eqx.nn.MLP(16, 8, 32, depth=1, key=jax.random.key(0))


def _step(opt, fused: bool):
    def step(model, state, x):
        grads = eqx.filter_grad(lambda m: jnp.mean(jax.vmap(m)(x) ** 2))(model)
        if fused:
            return ox.update_and_apply(opt, grads, state, model)
        updates, state = opt.update(grads, state, eqx.filter(model, eqx.is_array))
        return ox.apply_updates(model, updates), state

    return step


def _reference(tx, model, x, steps):
    def step(model, state, x):
        grads = eqx.filter_grad(lambda m: jnp.mean(jax.vmap(m)(x) ** 2))(model)
        updates, state = tx.update(grads, state, eqx.filter(model, eqx.is_array))
        return eqx.apply_updates(model, updates), state

    step = eqx.filter_jit(step)
    state = tx.init(eqx.filter(model, eqx.is_array))
    for _ in range(steps):
        model, state = step(model, state, x)
    return model


def _loops(fn, *args) -> int:
    """The number of loops (`fori_loop`: `scan` or `while`) in the traced program of `fn` (the slices' loops)."""
    closed, _, _ = eqx.filter_make_jaxpr(fn)(*args)
    text = str(closed)
    return text.count("while[") + text.count("scan[")


TRANSFORMS = {
    "adam": lambda: optax.adam(0.05),
    "adamw": lambda: optax.adamw(0.05, weight_decay=0.1),  # reads the parameters
    "sgd_momentum": lambda: optax.sgd(0.05, momentum=0.9),
    "adam_bf16_moments": lambda: optax.adam(0.05, mu_dtype=jnp.bfloat16),
    "lamb": lambda: optax.lamb(0.05),  # a norm per leaf: not elementwise, updated whole
    "clip_adam": lambda: optax.chain(optax.clip_by_global_norm(0.1), optax.adam(0.05)),
}


@pytest.mark.parametrize("fused", [False, True], ids=["update", "update_and_apply"])
@pytest.mark.parametrize("stream", [None, "leaf"], ids=["whole", "leaf"])
@pytest.mark.parametrize("name", sorted(TRANSFORMS))
def test_sliced_updates_match_optax(small_slices, name, stream, fused):
    if stream == "leaf" and name == "clip_adam":
        pytest.skip("a stream takes global transformations as `global_transform`")
    model, x = _mlp(), jax.random.normal(jax.random.key(1), (4, 16))
    opt = ox.offload_optimizer(TRANSFORMS[name](), stream=stream)
    step = ox.filter_jit(_step(opt, fused), strategy="offload_optimizer", donate="all")
    ours = jax.tree.map(lambda v: jnp.copy(v) if eqx.is_array(v) else v, model)
    state = opt.init(ours)
    for _ in range(3):
        ours, state = step(ours, state, x)
    expected = _reference(TRANSFORMS[name](), model, x, 3)
    arrays = [eqx.filter(tree, eqx.is_array) for tree in (ours, expected)]
    for a, b in zip(*map(jax.tree.leaves, arrays)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-6, atol=1e-7)
    # The state stays where it was declared, typed as it is placed.
    for leaf in jax.tree.leaves(state):
        if np.ndim(leaf) > 0:
            assert leaf.sharding.memory_kind == "pinned_host"
            assert jax.typeof(leaf).memory_space == jax.memory.Space.Host


@pytest.mark.parametrize("stream", [None, "leaf"], ids=["whole", "leaf"])
def test_elementwise_weights_are_sliced_and_others_are_not(small_slices, stream):
    """The loops are there for an elementwise transformation and absent for one with a
    norm per leaf (lamb) or a global norm (clipping in the chain)."""
    model, x = _mlp(), jnp.ones((4, 16))
    for tx, sliced in [(optax.adam(0.1), True), (optax.lamb(0.1), False)]:
        opt = ox.offload_optimizer(tx, stream=stream)
        state = opt.init(model)
        step = _step(opt, fused=True)
        # Two weights (32 x 16, 8 x 32) of 2 KiB and 1 KiB: sliced; biases: not.
        assert (_loops(step, model, state, x) >= 2) == sliced, (tx, stream)
    if stream is None:
        clipped = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(0.1))
        opt = ox.offload_optimizer(clipped)
        assert _loops(_step(opt, fused=True), model, opt.init(model), x) == 0


def test_large_weights_are_not_sliced_by_default():
    """Without the fixture, weights below the slice size are updated whole."""
    model, x = _mlp(), jnp.ones((4, 16))
    opt = ox.offload_optimizer(optax.adam(0.1))
    assert _loops(_step(opt, fused=True), model, opt.init(model), x) == 0


ADAM = 12  # bytes of results an element of Adam's update of a float32 weight: u, mu, nu


def _cut(shape, sharded=()) -> Slices:
    cut = weight_slices(shape, ADAM, sharded)
    assert cut is not None, shape
    return cut


def test_weight_slices_choose_a_free_axis_and_a_divisor():
    assert weight_slices((512, 512), ADAM, ()) is None  # 3 MiB of results: whole
    cut = _cut((2048, 2048))
    assert cut == Slices(axis=0, size=256, count=8, squeeze=False)  # 6 MiB of results a trip
    assert cut.count * cut.size == 2048 and 2048 * cut.size * ADAM <= slices.SLICE_BYTES
    # An axis the mesh shards is never cut.
    assert _cut((2048, 2048), (True, False)).axis == 1
    assert weight_slices((2048, 2048), ADAM, (True, True)) is None
    # A prime first axis: the second is cut.
    assert _cut((4099, 1024)).axis == 1
    # No divisor reaches the target: the most slices up to MAX_SLICES.
    big = weight_slices((4099, 4099), ADAM, ())
    assert big is None or big.count <= slices.MAX_SLICES
    assert _cut((32768, 1024)).size * 1024 * ADAM <= slices.SLICE_BYTES


def _trips(opt) -> list[int]:
    """The trip counts of the loops (`fori_loop` as `scan`) in one update of a 2048 x 2048
    float32 weight."""
    model = eqx.nn.Linear(2048, 2048, use_bias=False, key=jax.random.key(0))
    x = jnp.ones((4, 2048))
    closed, _, _ = eqx.filter_make_jaxpr(_step(opt, fused=False))(model, opt.init(model), x)
    return [int(n) for n in re.findall(r"length=(\d+)", str(closed))]


def test_a_stream_and_stream_none_slice_a_weight_by_one_rule():
    """One rule for every device update in slices: a trip computes at most
    `slices.SLICE_BYTES` of results. Adam's update of a 2048 x 2048 float32 weight (the
    update and both moments: 48 MiB) runs in 8 trips of 6 MiB under `stream=None` and
    `stream="leaf"` alike (a stream cut it by 4 MiB of each state leaf: 4 trips of 12 MiB,
    where `stream=None` made 8)."""
    for stream in (None, "leaf"):
        assert _trips(ox.offload_optimizer(optax.adam(1e-3), stream=stream)) == [8], stream


def _memory_step(opt, fused: bool):
    class Layer(eqx.Module):
        w: jax.Array = ox.field(memory="pinned_host")

        def __call__(self, x):
            return jnp.tanh(x @ self.w)

    def step(model, state, x):
        grads = eqx.filter_grad(lambda m: jnp.mean(m(x) ** 2))(model)
        if fused:
            return ox.update_and_apply(opt, grads, state, model)
        updates, state = opt.update(grads, state, model)
        return ox.apply_updates(model, updates), state

    return Layer, step


@pytest.mark.deviceless
def test_offloaded_device_update_needs_less_than_keeping_it_on_the_device():
    """One 2048 x 2048 float32 weight in host memory, batch 64, Adam, deviceless h100:
    every stream, `opt.update` or `ox.update_and_apply`, needs less device memory than
    plain Equinox + optax with everything on the device (65 MiB), where the whole fetch
    needed 96.5 MiB (`stream=None`) and 112.5 MiB (`stream="leaf"`) before."""
    pytest.importorskip("jax_plugins.xla_cuda12", reason="needs the 'cuda' extra")
    assert os.environ.get("JAX_PLATFORMS") == "cpu", "deviceless compiles need JAX_PLATFORMS=cpu"
    mib = 2**20
    w = jax.ShapeDtypeStruct((2048, 2048), jnp.float32)
    x = jax.ShapeDtypeStruct((64, 2048), jnp.float32)

    class Plain(eqx.Module):
        w: jax.Array

        def __call__(self, x):
            return jnp.tanh(x @ self.w)

    def plain_step(model, state, x):
        grads = eqx.filter_grad(lambda m: jnp.mean(m(x) ** 2))(model)
        updates, state = optax.adam(1e-3).update(grads, state, model)
        return eqx.apply_updates(model, updates), state

    model: Any = Plain(w)  # type: ignore[arg-type]  (abstract leaves)
    plain_state = eqx.filter_eval_shape(optax.adam(1e-3).init, model)
    plain = ox.memory_report(
        ox.filter_jit(plain_step, donate="all"), model, plain_state, x, target="h100"
    )
    assert plain.total <= 66 * mib
    bounds = {(None, False): 28, (None, True): 30, ("leaf", False): 26, ("leaf", True): 30}
    for (stream, fused), bound in bounds.items():
        opt = ox.offload_optimizer(optax.adam(1e-3), stream=stream)
        layer, step = _memory_step(opt, fused)
        model = layer(w)  # type: ignore[arg-type]
        state = eqx.filter_eval_shape(opt.init, model)
        report = ox.memory_report(ox.filter_jit(step, donate="all"), model, state, x, target="h100")
        assert report.host["argument"] >= 48 * mib  # the weight and both moments
        assert report.total < plain.total, (stream, fused, report.total / mib)
        assert report.total <= bound * mib, (stream, fused, report.total / mib)


def _compiled_text(step, *args) -> str:
    """The scheduled h100 program of an `ox.filter_jit` step (deviceless)."""
    _, compiled = compiled_report(program_of_step(step, args, {}), get_target("h100"), "step")
    return compiled.as_text()


@pytest.mark.deviceless
def test_the_whole_state_update_fetches_each_weight_once_per_pass_and_no_gradient():
    """`stream=None` on one host-resident 2048 x 2048 weight: the compiled program copies
    the whole weight to the device twice (the forward pass and the backward pass's
    recomputation) and nothing else whole: the gradient stays on the device where the
    update reads it (XLA drops the round trip JAX's types write), the state and the
    weight are read and written in slices."""
    pytest.importorskip("jax_plugins.xla_cuda12", reason="needs the 'cuda' extra")
    w = jax.ShapeDtypeStruct((2048, 2048), jnp.float32)
    x = jax.ShapeDtypeStruct((64, 2048), jnp.float32)
    opt = ox.offload_optimizer(optax.adam(1e-3))
    layer, step = _memory_step(opt, fused=True)
    model: Any = layer(w)  # type: ignore[arg-type]
    state = eqx.filter_eval_shape(opt.init, model)
    text = _compiled_text(ox.filter_jit(step, donate="all"), model, state, x)
    whole = [line for line in text.splitlines() if "copy-start(" in line]
    assert len(whole) == 2 and all("f32[2048,2048]" in line for line in whole)
    assert "dynamic-slice-start" in text and "dynamic-update-slice-start" in text


@pytest.mark.deviceless
def test_a_layer_streamed_stack_needs_less_than_keeping_it_on_the_device():
    """Four stacked 1024 x 1024 weights in host memory under `ox.scan`, `stream="layer"`:
    less device memory than the same scan with everything on the device (77.5 MiB), and
    no stack copied whole."""
    pytest.importorskip("jax_plugins.xla_cuda12", reason="needs the 'cuda' extra")
    mib = 2**20
    w = jax.ShapeDtypeStruct((4, 1024, 1024), jnp.float32)
    x = jax.ShapeDtypeStruct((64, 1024), jnp.float32)

    class Plain(eqx.Module):
        w: jax.Array

        def __call__(self, x):
            return jax.lax.scan(lambda c, w: (jnp.tanh(c @ w), None), x, self.w)[0]

    class Stack(eqx.Module):
        layers: Any

        def __call__(self, x):
            return ox.scan(self.layers, x)

    def plain_step(model, state, x):
        grads = eqx.filter_grad(lambda m: jnp.mean(m(x) ** 2))(model)
        updates, state = optax.adam(1e-3).update(grads, state, model)
        return eqx.apply_updates(model, updates), state

    plain_model: Any = Plain(w)  # type: ignore[arg-type]
    plain_state = eqx.filter_eval_shape(optax.adam(1e-3).init, plain_model)
    plain = ox.memory_report(
        ox.filter_jit(plain_step, donate="all"), plain_model, plain_state, x, target="h100"
    )
    opt = ox.offload_optimizer(optax.adam(1e-3), stream="layer", layers=4)
    layer, step = _memory_step(opt, fused=True)
    model: Any = Stack(layer(w))  # type: ignore[arg-type]
    state = eqx.filter_eval_shape(opt.init, model)
    jitted = ox.filter_jit(step, donate="all")
    report = ox.memory_report(jitted, model, state, x, target="h100")
    assert report.total < plain.total and report.total <= 32 * mib, report.total / mib
    assert "copy-start(" not in _compiled_text(jitted, model, state, x)


@pytest.mark.parametrize("master_dtype", [None, jnp.float32], ids=["plain", "masters"])
@pytest.mark.parametrize("delay", [0, 1])
def test_delayed_and_master_updates_in_slices_equal_them_whole(monkeypatch, delay, master_dtype):
    """The delayed update (its `cond` on the pending flag) and masters (each parameter
    written from its new master), on the device: sliced or whole, the same training.
    Delayed with masters, `ox.update_and_apply` is computed whole (not sliced yet)."""
    model, x = _mlp(), jax.random.normal(jax.random.key(2), (4, 16))

    def train(slice_bytes: int) -> Any:
        monkeypatch.setattr(slices, "SLICE_BYTES", slice_bytes)
        # On this CPU masters are updated by the host kernel, one call for every leaf
        # (not split by parameter); a GPU's device update is optax's, as here.
        with optax_only():
            return _train(slice_bytes)

    def _train(slice_bytes: int) -> Any:
        opt = ox.offload_optimizer(optax.adam(0.05), delay=delay, master_dtype=master_dtype)
        step = ox.filter_jit(_step(opt, fused=True), strategy="offload_optimizer")
        trained = jax.tree.map(lambda v: jnp.copy(v) if eqx.is_array(v) else v, model)
        state = opt.init(trained)
        for _ in range(3):
            trained, state = step(trained, state, x)
        return trained, _loops(_step(opt, fused=True), model, opt.init(model), x)

    (whole, whole_loops), (sliced, sliced_loops) = train(2**30), train(512)
    assert whole_loops == 0 and (sliced_loops >= 2) == (not (delay and master_dtype))
    for a, b in zip(*(jax.tree.leaves(eqx.filter(t, eqx.is_array)) for t in (sliced, whole))):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-6, atol=1e-7)


class HostLayer(eqx.Module):
    w: jax.Array = ox.field(memory="pinned_host")
    b: jax.Array = ox.field(memory="pinned_host")

    def __call__(self, x):
        return jnp.tanh(x @ self.w + self.b)


@pytest.mark.parametrize("stream", [None, "leaf"], ids=["whole", "leaf"])
@pytest.mark.parametrize("fused", [False, True], ids=["update", "update_and_apply"])
def test_host_resident_weights_sliced_and_biases_whole_stay_on_the_host(
    small_slices, stream, fused
):
    """Host-resident parameters: the weights' update in slices, the biases' (too small to
    slice) whole; every new value returns to host memory (the audit's contract holds),
    and the training equals optax's."""
    keys = jax.random.split(jax.random.key(3), 4)
    model: Any = [
        HostLayer(jax.random.normal(keys[0], (16, 32)) * 0.2, jnp.zeros(32)),
        HostLayer(jax.random.normal(keys[1], (32, 16)) * 0.2, jnp.zeros(16)),
    ]
    x = jax.random.normal(keys[2], (4, 16))

    def apply(m, x):
        for layer in m:
            x = layer(x)
        return x

    def step(model, state, x):
        grads = eqx.filter_grad(lambda m: jnp.mean(apply(m, x) ** 2))(model)
        if fused:
            return ox.update_and_apply(opt, grads, state, model)
        updates, state = opt.update(grads, state, model)
        return ox.apply_updates(model, updates), state

    opt = ox.offload_optimizer(optax.adamw(0.05, weight_decay=0.1), stream=stream)
    jitted = ox.filter_jit(step, donate="all")
    ours = ox.place(jax.tree.map(jnp.copy, model))
    state = opt.init(ours)
    ox.audit(jitted, ours, state, x)  # raises where a new value returns to the device
    for _ in range(3):
        ours, state = jitted(ours, state, x)
    for layer in ours:
        for leaf in (layer.w, layer.b):
            assert leaf.sharding.memory_kind == "pinned_host"
            assert jax.typeof(leaf).memory_space == jax.memory.Space.Host

    tx = optax.adamw(0.05, weight_decay=0.1)

    @jax.jit
    def reference_step(model, state):
        grads = jax.grad(lambda m: jnp.mean(apply(m, x) ** 2))(model)
        updates, state = tx.update(grads, state, model)
        return optax.apply_updates(model, updates), state

    reference, ref_state = model, tx.init(model)
    for _ in range(3):
        reference, ref_state = reference_step(reference, ref_state)
    # Host-resident weights are fetched into regions, which XLA fuses otherwise than the
    # plain program: the gradients differ by about an ulp (2.4e-6 after three steps).
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(reference)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_an_update_too_small_to_slice_is_traced_once():
    """`stream=None` decides from the leaves' sizes that no group of a small model's
    update is large enough to slice, before tracing it (it traced the whole update to
    find out, then traced it again to compute it: twice the optimizer's trace time)."""
    calls = []
    adam = optax.adam(1e-3)

    def update(updates, state, params=None):
        calls.append(1)
        return adam.update(updates, state, params)

    opt = ox.offload_optimizer(optax.GradientTransformation(adam.init, update))
    params = eqx.filter(_mlp(), eqx.is_array)
    state = opt.init(params)

    @ox.filter_jit
    def step(params, state):
        grads = jax.tree_util.tree_map(jnp.ones_like, params)
        return opt.update(grads, state, params)

    step(params, state)
    assert len(calls) == 1
