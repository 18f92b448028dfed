"""`ox.offload_optimizer(tx, master_dtype=jnp.float32)`: float32 masters of a bfloat16 model.

Equal to the definition written in plain JAX + optax (float32 masters, the bfloat16 model
cast from them, AdamW on the masters) at a learning rate whose updates are below
bfloat16's resolution, where bfloat16-only AdamW visibly differs: for the host update, the
delayed host update and the device update streamed by layer, under three strategies. The
masters live where the plan puts optimizer state (typed `<host>` there); the host update
moves only the gradients down and the new parameters back, in bfloat16 (4 bytes per
parameter), and no optimizer state.
"""

import functools
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import loss_fn, masters_reference, scanned_model, to_bf16

import offload_eqx as ox
from offload_eqx._optimizer import slices
from offload_eqx._optimizer.masters import Masters

LR = 1e-4  # Adam's steps of ~1e-4 are below bfloat16's half-spacing (~1e-3) at weights ~0.3
STEPS = 6
MODES = {
    "host": {"update_on": "host"},
    "delayed_host": {"update_on": "host", "delay": 1},
    "layer_stream": {"stream": "layer", "layers": 3},
}
STRATEGIES = ("annotated", "baseline", "hybrid")


def _x():
    return jax.random.normal(jax.random.key(1), (8, 16)).astype(jnp.bfloat16)


def _model32():
    return scanned_model(jax.random.key(0))


def _start():
    """The masters `opt.init` makes from the bfloat16 model: its weights, widened."""
    return jax.tree_util.tree_map(
        lambda x: x.astype(jnp.float32) if eqx.is_inexact_array(x) else x, to_bf16(_model32())
    )


@functools.cache
def _reference(delay: bool):
    masters = masters_reference(_start(), loss_fn, _x(), optax.adamw(LR), STEPS, delay)
    return jax.tree_util.tree_map(np.asarray, masters)


def _masters(state) -> Masters:
    """The `Masters` in a state: whole-state, delayed or streamed (per leaf)."""
    found = [
        x
        for x in jax.tree_util.tree_leaves(state, is_leaf=lambda x: isinstance(x, Masters))
        if isinstance(x, Masters)
    ]
    return found[0] if len(found) == 1 else found  # type: ignore[return-value]


def _master_leaves(state) -> list:
    found = _masters(state)
    tree = [m.master for m in found] if isinstance(found, list) else found.master
    return jax.tree_util.tree_leaves(tree)


def _train(opt, strategy, steps=STEPS, init_from=None):
    model = ox.place(to_bf16(_model32()), strategy)
    state = opt.init(model if init_from is None else init_from)

    @ox.filter_jit(strategy=strategy, donate="all")
    def step(model, state, x):
        grads = eqx.filter_grad(loss_fn)(model, x)
        return ox.update_and_apply(opt, grads, state, model)

    x = _x()
    for _ in range(steps):
        model, state = step(model, state, x)
    return model, state, step


def _assert_equal_to_reference(model, state, reference):
    masters = jax.tree_util.tree_leaves(reference)
    for ours, want in zip(_master_leaves(state), masters):
        scale = float(np.max(np.abs(want)))
        assert float(np.max(np.abs(np.asarray(ours) - want))) <= 1e-6 * scale
    for param, want in zip(jax.tree_util.tree_leaves(eqx.filter(model, eqx.is_array)), masters):
        assert param.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(param), np.asarray(want.astype(jnp.bfloat16)))


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("mode", list(MODES))
def test_masters_equal_the_definition(mode, strategy):
    options = MODES[mode]
    opt = ox.offload_optimizer(optax.adamw(LR), master_dtype=jnp.float32, **options)
    model, state, _ = _train(opt, strategy)
    if options.get("delay"):
        apply = ox.filter_jit(lambda m, s: ox.apply_pending(opt, s, m), strategy=strategy)
        model, state = apply(model, state)
    _assert_equal_to_reference(model, state, _reference(bool(options.get("delay"))))


def test_bfloat16_only_adamw_differs_from_the_definition():
    """The learning rate makes the comparison above able to fail: AdamW on the bfloat16
    parameters themselves rounds its updates away and ends elsewhere."""
    opt = ox.offload_optimizer(optax.adamw(LR))
    model, _, _ = _train(opt, "annotated")
    want = [
        np.asarray(m.astype(jnp.bfloat16)) for m in jax.tree_util.tree_leaves(_reference(False))
    ]
    got = [np.asarray(p) for p in jax.tree_util.tree_leaves(eqx.filter(model, eqx.is_array))]
    differ = np.mean(np.concatenate([(a != b).ravel() for a, b in zip(got, want)]))
    assert differ > 0.05


@pytest.mark.parametrize("mode", ["host", "delayed_host", "device", "layer_stream", "leaf"])
def test_masters_live_in_the_optimizers_memory_typed_host(mode):
    options = MODES.get(mode, {"stream": "leaf"} if mode == "leaf" else {})
    opt = ox.offload_optimizer(optax.adam(LR), master_dtype=jnp.float32, **options)
    _, state, _ = _train(opt, "annotated", steps=2)
    leaves = _master_leaves(state)
    assert leaves
    for leaf in leaves:
        assert leaf.dtype == jnp.float32
        assert leaf.sharding.memory_kind == "pinned_host"
        assert jax.typeof(leaf).memory_space == jax.memory.Space.Host
    inner = _masters(state)
    for moments in inner if isinstance(inner, list) else [inner]:
        for leaf in jax.tree_util.tree_leaves(moments.state):
            if np.ndim(leaf):  # Adam's moments: float32, on the host; its count a scalar
                assert leaf.dtype == jnp.float32
                assert jax.typeof(leaf).memory_space == jax.memory.Space.Host


@pytest.mark.parametrize("delay", [0, 1])
def test_host_update_moves_four_bytes_a_parameter_and_no_state(delay):
    """Parameters on the device, masters and moments on the host: the gradients go down
    and the new parameters come back, each in bfloat16, named by leaf path."""
    opt = ox.offload_optimizer(
        optax.adamw(LR), master_dtype=jnp.float32, update_on="host", delay=delay
    )
    model, state, step = _train(opt, "offload_optimizer", steps=1)
    report = ox.audit(step, model, state, _x())
    parameters = sum(x.size for x in jax.tree_util.tree_leaves(eqx.filter(model, eqx.is_array)))
    assert not [t for t in report.transfers if t.kind == "optimizer"]
    assert report.total() <= 4 * parameters
    moved = {(t.direction, t.kind, t.what, t.dtype) for t in report.transfers}
    assert moved == {
        ("device-to-host", "gradient", "grads.layers.w1", "bfloat16"),
        ("device-to-host", "gradient", "grads.layers.w2", "bfloat16"),
        ("host-to-device", "parameter", "params.layers.w1", "bfloat16"),
        ("host-to-device", "parameter", "params.layers.w2", "bfloat16"),
    }


def test_float32_initialisation_keeps_full_precision_masters():
    """`opt.init(model32)` before casting the model: the masters are the float32 weights
    themselves, not their bfloat16 rounding."""
    opt = ox.offload_optimizer(optax.adamw(LR), master_dtype=jnp.float32, update_on="host")
    model32 = _model32()
    _, state, _ = _train(opt, "annotated", steps=0, init_from=model32)
    for ours, want in zip(
        _master_leaves(state), jax.tree_util.tree_leaves(eqx.filter(model32, eqx.is_array))
    ):
        np.testing.assert_array_equal(np.asarray(ours), np.asarray(want))


def test_only_what_is_trained_gets_a_master():
    """LoRA-style: `eqx.partition` into what is trained and what is frozen; only the
    trained part has masters, and the frozen part is left as it is."""
    model = to_bf16(_model32())
    trained_filter = eqx.tree_at(
        lambda m: m.layers.w1, jax.tree_util.tree_map(lambda _: False, model), True
    )
    trained, frozen = eqx.partition(model, trained_filter)
    opt = ox.offload_optimizer(optax.adamw(LR), master_dtype=jnp.float32, update_on="host")
    state = opt.init(trained)
    masters = _masters(state).master
    assert masters.layers.w1.dtype == jnp.float32 and masters.layers.w2 is None

    @ox.filter_jit(donate="all-except-first")
    def step(frozen, trained, state, x):
        loss = lambda t: loss_fn(eqx.combine(t, frozen), x)  # noqa: E731
        grads = eqx.filter_grad(loss)(trained)
        return ox.update_and_apply(opt, grads, state, trained)

    new, state = step(frozen, trained, state, _x())
    assert new.layers.w2 is None and new.layers.w1.dtype == jnp.bfloat16


@pytest.mark.parametrize(
    "chain",
    [
        lambda: optax.chain(optax.clip_by_global_norm(0.1), optax.adamw(LR)),
        lambda: optax.MultiSteps(optax.adamw(LR), every_k_schedule=2),
        lambda: optax.inject_hyperparams(optax.adamw)(learning_rate=LR),
        lambda: optax.adamw(
            LR,
            weight_decay=0.1,
            mask=lambda p: eqx.tree_at(
                lambda m: m.layers.w2, jax.tree_util.tree_map(lambda _: True, p), False
            ),
        ),
    ],
    ids=["clip_adamw", "multisteps", "inject_hyperparams", "adamw_mask"],
)
def test_masters_work_under_the_transformations_users_compose(chain):
    opt = ox.offload_optimizer(chain(), master_dtype=jnp.float32, update_on="host")
    model, state, _ = _train(opt, "hybrid")
    tx = chain()
    tx = tx.gradient_transformation() if isinstance(tx, optax.MultiSteps) else tx
    reference = masters_reference(_start(), loss_fn, _x(), tx, STEPS)
    _assert_equal_to_reference(model, state, jax.tree_util.tree_map(np.asarray, reference))


def test_a_streamed_global_transform_sees_the_gradients_in_the_masters_dtype():
    """`global_transform` of a streamed optimizer clips the gradients widened to float32,
    as the whole-state optimizer does (`optax.chain` inside the masters)."""
    clip = optax.clip_by_global_norm(0.1)
    streamed = ox.offload_optimizer(
        optax.adamw(LR), master_dtype=jnp.float32, stream="layer", layers=3, global_transform=clip
    )
    model, state, _ = _train(streamed, "annotated")
    tx = optax.chain(clip, optax.adamw(LR))
    reference = masters_reference(_start(), loss_fn, _x(), tx, STEPS)
    _assert_equal_to_reference(model, state, jax.tree_util.tree_map(np.asarray, reference))


STREAMS: dict[str, dict[str, Any]] = {
    "leaf": {"stream": "leaf"},
    "leaf_sliced": {"stream": "leaf"},  # each weight in slices of 4 KiB (32 per weight)
    "layer": {"stream": "layer", "layers": 3},
    "layer_clipped": {"stream": "layer", "layers": 3},  # `global_transform`: clipping
}


def _whole_update(clipped: bool) -> Any:
    """The definition compiled whole (`jax.jit` of optax's update of every master at
    once, as XLA rounds it), from the bfloat16 model and the gradients of each step."""
    tx = optax.adamw(LR)
    tx = optax.chain(optax.clip_by_global_norm(1e-3), tx) if clipped else tx

    @jax.jit
    def update(grads, state, masters):
        wide = jax.tree_util.tree_map(lambda g: g.astype(jnp.float32), grads)
        updates, state = tx.update(wide, state, masters)
        return optax.apply_updates(masters, updates), state

    return tx, update


@pytest.mark.parametrize("name", list(STREAMS))
def test_streams_write_the_whole_updates_masters_bit_for_bit(name, monkeypatch):
    """A stream updates one leaf (one layer, one slice) at a time, and its masters and
    bfloat16 parameters are those of the whole tree's update, bit for bit, step after
    step, given the same gradients: the host kernel rounds each leaf as XLA rounds the
    whole update (the bias corrections' divisions merged where they serve several
    leaves; a clipped gradient computed in the moments' loop). Before, each leaf rounded
    as a one-leaf update does: 1350 of 49,152 masters differed after one step."""
    if name == "leaf_sliced":
        monkeypatch.setattr(slices, "SLICE_BYTES", 4096)
    clipped = name == "layer_clipped"
    model = to_bf16(scanned_model(jax.random.key(0), depth=3, width=64, hidden=128))
    params = eqx.filter(model, eqx.is_array)
    extra: dict[str, Any] = {"global_transform": optax.clip_by_global_norm(1e-3)} if clipped else {}
    opt = ox.offload_optimizer(optax.adamw(LR), master_dtype=jnp.float32, **STREAMS[name], **extra)
    state = opt.init(ox.place(model, "annotated"))
    step = ox.filter_jit(
        lambda m, s, g: ox.update_and_apply(opt, g, s, m), strategy="annotated", donate="all"
    )
    tx, update = _whole_update(clipped)
    masters = jax.tree_util.tree_map(lambda p: p.astype(jnp.float32), params)
    whole_state = tx.init(masters)
    placed = ox.place(model, "annotated")
    leaves, treedef = jax.tree_util.tree_flatten(params)
    for k in range(3):
        keys = jax.random.split(jax.random.key(10 + k), len(leaves))
        grads = jax.tree_util.tree_unflatten(
            treedef,
            [
                (jax.random.normal(key, x.shape) * 1e-3).astype(jnp.bfloat16)
                for key, x in zip(keys, leaves)
            ],
        )
        placed, state = step(placed, state, grads)
        masters, whole_state = update(grads, whole_state, masters)
        for ours, want in zip(_master_leaves(state), jax.tree_util.tree_leaves(masters)):
            np.testing.assert_array_equal(np.asarray(ours), np.asarray(want), f"step {k}")
        for ours, want in zip(
            jax.tree_util.tree_leaves(eqx.filter(placed, eqx.is_array)),
            jax.tree_util.tree_leaves(masters),
        ):
            np.testing.assert_array_equal(np.asarray(ours), np.asarray(want.astype(ours.dtype)))


@pytest.mark.parametrize("value", [jnp.int32, "float33", 3, True])
def test_master_dtype_must_be_a_floating_point_dtype(value):
    with pytest.raises(ValueError, match=r"master_dtype=...\) is .*floating-point dtype"):
        ox.offload_optimizer(optax.adam(LR), master_dtype=value)


def test_plain_update_returns_the_difference_in_the_parameters_dtype():
    """`opt.update` + `ox.apply_updates` (for callers who apply updates themselves): the
    updates are bfloat16 and the parameters end within one bfloat16 step of the masters'."""
    opt = ox.offload_optimizer(optax.adamw(LR), master_dtype=jnp.float32)
    model = to_bf16(_model32())
    state = opt.init(model)

    @ox.filter_jit
    def step(model, state, x):
        grads = eqx.filter_grad(loss_fn)(model, x)
        updates, state = opt.update(grads, state, model)
        return ox.apply_updates(model, updates), state, updates

    for _ in range(STEPS):
        model, state, updates = step(model, state, _x())
    assert updates.layers.w1.dtype == jnp.bfloat16
    for param, master in zip(
        jax.tree_util.tree_leaves(eqx.filter(model, eqx.is_array)), _master_leaves(state)
    ):
        exact = np.asarray(master.astype(jnp.bfloat16)).astype(np.float32)
        spacing = np.abs(exact) * 2.0**-7 + 1e-30
        assert np.all(np.abs(np.asarray(param).astype(np.float32) - exact) <= spacing)


@pytest.mark.deviceless
def test_memory_report_places_masters_and_moments_on_the_host():
    """Compiled for an H100 from shapes: the state (masters and AdamW's moments, 12 bytes
    per parameter) is a host argument, the bfloat16 parameters a device one."""
    opt = ox.offload_optimizer(optax.adamw(LR), master_dtype=jnp.float32, update_on="host")
    model = to_bf16(_model32())
    state = opt.init(model)

    @ox.filter_jit(strategy="offload_optimizer", donate="all")
    def step(model, state, x):
        grads = eqx.filter_grad(loss_fn)(model, x)
        return ox.update_and_apply(opt, grads, state, model)

    report = ox.memory_report(step, model, state, _x(), target="h100")
    parameters = sum(x.size for x in jax.tree_util.tree_leaves(eqx.filter(model, eqx.is_array)))
    scalars = sum(
        x.nbytes for x in jax.tree_util.tree_leaves(state) if np.ndim(x) == 0
    )  # AdamW's count
    assert report.host["argument"] == 12 * parameters + scalars
    assert report.device["argument"] == 2 * parameters + _x().nbytes


def test_a_run_resumed_from_a_checkpoint_equals_the_uninterrupted_one(tmp_path):
    """The masters, moments and pending gradients are saved and restored where the plan
    puts them; the resumed run ends bit for bit where the uninterrupted one does."""
    opt = ox.offload_optimizer(optax.adamw(LR), master_dtype=jnp.float32, update_on="host", delay=1)
    whole_model, whole_state, step = _train(opt, "hybrid", steps=4)
    model, state, _ = _train(opt, "hybrid", steps=2)
    ox.save_checkpoint(tmp_path / "ckpt", (model, state))
    like = jax.eval_shape(lambda: (model, state))
    model, state = ox.restore_checkpoint(tmp_path / "ckpt", like, "hybrid")
    assert jax.typeof(_master_leaves(state)[0]).memory_space == jax.memory.Space.Host
    for _ in range(2):
        model, state = step(model, state, _x())
    for a, b in zip(
        jax.tree_util.tree_leaves(eqx.filter((model, state), eqx.is_array)),
        jax.tree_util.tree_leaves(eqx.filter((whole_model, whole_state), eqx.is_array)),
    ):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
