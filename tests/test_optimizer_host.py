"""`ox.offload_optimizer(update_on="host")`: the optax update as a host computation.

Equal to plain optax under every strategy, for the chains users write; the state (all of
it) in host memory before and after; the audit lists only gradients going down and
updates coming back (nothing with host-resident parameters), names the host computation,
and never an optimizer-state transfer; bad options and targets that cannot compute on the
host are refused with errors that say what to do.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
import pytest
from beartype import beartype
from helpers import (
    HostSquare,
    HostStack,
    assert_close_to_scale,
    loss_fn,
    rotated,
    scanned_model,
)
from jaxtyping import Array, Float, jaxtyped

import offload_eqx as ox
from offload_eqx._optimizer.state import HostUpdatedState


def _not_bias(model):
    return jax.tree_util.tree_map(lambda x: x.ndim > 1, eqx.filter(model, eqx.is_array))


CHAINS = {
    "adam": lambda: optax.adam(1e-2),
    "adamw_mask": lambda: optax.adamw(1e-2, weight_decay=0.1, mask=_not_bias),
    "clip_adamw": lambda: optax.chain(
        optax.clip_by_global_norm(0.5), optax.adamw(1e-2, weight_decay=0.1)
    ),
    "inject_hyperparams": lambda: optax.inject_hyperparams(optax.adam)(learning_rate=1e-2),
    "multisteps": lambda: optax.MultiSteps(optax.adam(1e-2), every_k_schedule=2),
}

STRATEGIES = list(ox.STRATEGIES)


def _batch() -> Float[Array, "8 16"]:
    return jax.random.normal(jax.random.key(1), (8, 16))


def _reference(transform, steps=3):
    model, x = scanned_model(jax.random.key(0)), _batch()
    state = transform.init(model)
    for _ in range(steps):
        grads = jax.grad(loss_fn)(model, x)
        updates, state = transform.update(grads, state, model)
        model = eqx.apply_updates(model, updates)
    return model


def _train(opt, strategy, *, apply="update_and_apply", steps=3):
    model = ox.place(scanned_model(jax.random.key(0)), strategy)
    state = opt.init(model)

    @ox.filter_jit(strategy=strategy, donate="all")
    def step(model, state, x):
        grads = eqx.filter_grad(loss_fn)(model, x)
        if apply == "update_and_apply":
            return ox.update_and_apply(opt, grads, state, model)
        updates, state = opt.update(grads, state, model)
        return ox.apply_updates(model, updates), state

    x = _batch()
    for _ in range(steps):
        model, state = step(model, state, x)
    return model, state, step, x


@jaxtyped(typechecker=beartype)
def _assert_equal(ours: eqx.Module, reference: eqx.Module) -> None:
    assert_close_to_scale(ours, reference)


# Each chain under the two strategies that keep its state on the host and one of the others
# in turn (all with `--full`).
@pytest.mark.parametrize(
    "name, strategy", rotated(CHAINS, STRATEGIES, ("offload_optimizer", "hybrid"))
)
def test_matches_plain_optax_under_every_strategy(name, strategy):
    reference = _reference(CHAINS[name]())
    opt = ox.offload_optimizer(CHAINS[name](), update_on="host")
    model, state, _, _ = _train(opt, strategy)
    _assert_equal(model, reference)
    assert isinstance(state, HostUpdatedState)
    # All of the state, scalars too, in host memory and typed so, after three steps;
    # a strategy that keeps the optimizer on the device ("baseline") updates it there
    # (issue 26, item 9: it ran the update on the host).
    on_device = ox.STRATEGIES[strategy].optimizer == "device"
    kind, space = ("device", "Device") if on_device else ("pinned_host", "Host")
    for leaf in jax.tree_util.tree_leaves(state):
        assert leaf.sharding.memory_kind == kind
        assert jax.typeof(leaf).memory_space == getattr(jax.memory.Space, space)
    # Parameters stay where the strategy put them.
    placed = ox.plan(scanned_model(jax.random.key(0)), strategy)
    for leaf, leaf_plan in zip(jax.tree_util.tree_leaves(model), placed.leaves):
        assert leaf.sharding.memory_kind == (leaf_plan.memory or "device"), leaf_plan.path


def test_the_optimizer_guide_states_where_each_preset_runs_the_update():
    # Issue 37, item 17: one page said `update_on="host"` keeps all the state on the host,
    # another that a strategy overrides it. The guide's table follows the plan's rule.
    import pathlib

    guide = pathlib.Path(__file__).resolve().parents[1] / "docs" / "guides" / "optimizer.md"
    table = guide.read_text().split("### Who decides where the update runs")[1]
    rows = [line for line in table.splitlines() if line.startswith("| ")]
    on_device = next(r for r in rows if r.startswith("| keeps the optimizer state on the device"))
    declared = next(r for r in rows if r.startswith("| any other"))
    for name, strategy in ox.STRATEGIES.items():
        row = on_device if strategy.update_of("host") == "device" else declared
        assert f'`"{name}"`' in row, name
    # First: a strategy's own `update=` decides for every optimizer.
    assert rows[1].startswith('| `ox.Strategy(..., update="host")` or `update="device"`')
    assert ox.Strategy("s", "device", "device", update="device").update_of("host") == "device"
    assert ox.Strategy("s", optimizer="pinned_host", update="host").update_of("device") == "host"


@pytest.mark.parametrize("strategy", ["offload_optimizer", "hybrid"])
def test_update_then_apply_updates_matches_update_and_apply(strategy):
    opt = ox.offload_optimizer(CHAINS["clip_adamw"](), update_on="host")
    a, _, _, _ = _train(opt, strategy, apply="update_and_apply")
    b, _, _, _ = _train(opt, strategy, apply="apply_updates")
    _assert_equal(a, b)


def test_a_strategy_moves_a_device_update_to_the_host():
    """`Strategy(update="host")` runs an `update_on="device"` optimizer on the host: the
    placement of every state leaf and where the update runs are the plan's decision."""
    strategy = ox.Strategy("host_update", optimizer="pinned_host", update="host")
    opt = ox.offload_optimizer(CHAINS["clip_adamw"]())
    model, state, step, x = _train(opt, strategy)
    _assert_equal(model, _reference(CHAINS["clip_adamw"]()))
    assert {leaf.sharding.memory_kind for leaf in jax.tree_util.tree_leaves(state)} == {
        "pinned_host"
    }
    report = ox.audit(step, model, state, x)
    # The model's fields are declared in host memory: the sum runs there too, in the same
    # host computation as the update (`ox.update_and_apply`).
    assert [h.name for h in report.host_computations] == ["optimizer update and apply"]
    assert not report.select(kind="optimizer")


def _model_bytes(model) -> dict[str, int]:
    return {
        jax.tree_util.keystr(path): leaf.nbytes
        for path, leaf in jax.tree_util.tree_leaves_with_path(eqx.filter(model, eqx.is_array))
    }


def test_audit_lists_gradients_down_and_updates_up_only():
    opt = ox.offload_optimizer(CHAINS["clip_adamw"](), update_on="host")
    model, state, step, x = _train(opt, "offload_optimizer", steps=1)
    report = ox.audit(step, model, state, x)
    sizes = _model_bytes(model)
    grads = {t.what: t.bytes for t in report.select("device-to-host", kind="gradient")}
    updates = {t.what: t.bytes for t in report.select("host-to-device", kind="update")}
    assert grads == {"grads" + p: b for p, b in sizes.items()}
    assert updates == {"updates" + p: b for p, b in sizes.items()}
    # adamw reads the parameters (weight decay): they are sent once too, nothing else.
    sent_params = {t.what for t in report.select("device-to-host", kind="parameter")}
    assert sent_params == {"model" + p for p in sizes}
    assert not report.select(kind="optimizer")
    assert report.total("host-to-device") == sum(sizes.values())
    assert report.total("device-to-host") == 2 * sum(sizes.values())
    (host,) = report.host_computations
    assert host.name == "optimizer update and apply" and host.phase == "update"
    state_bytes = sum(leaf.nbytes for leaf in jax.tree_util.tree_leaves(state))
    assert host.operand_bytes >= state_bytes + 2 * sum(sizes.values())
    assert not report.violations
    assert "on the host: optimizer update and apply" in report.table()


def test_adam_does_not_send_the_parameters():
    opt = ox.offload_optimizer(optax.adam(1e-2), update_on="host")
    model, state, step, x = _train(opt, "offload_optimizer", steps=1)
    report = ox.audit(step, model, state, x)
    assert not report.select(kind="parameter")
    assert report.total("device-to-host") == sum(_model_bytes(model).values())


def test_with_host_parameters_only_the_gradients_move_in_the_update():
    """Under `hybrid` the parameters are in host memory: their gradients come out of the
    backward pass host-typed, and the update and the sum both run on the host."""
    opt = ox.offload_optimizer(CHAINS["clip_adamw"](), update_on="host")
    model, state, step, x = _train(opt, "hybrid", steps=1)
    report = ox.audit(step, model, state, x)
    assert not report.select("host-to-device", phase="update")
    assert not report.select(kind="optimizer")
    assert not report.select(kind="update")
    assert [h.name for h in report.host_computations] == ["optimizer update and apply"]
    assert not report.violations
    # `opt.update` then `ox.apply_updates`: two host computations, the same transfers.
    _, _, apart, _ = _train(opt, "hybrid", apply="apply_updates", steps=1)
    separate = ox.audit(apart, model, state, x)
    assert [h.name for h in separate.host_computations] == ["optimizer update", "apply updates"]
    assert separate.total("host-to-device") == report.total("host-to-device")
    assert separate.total("device-to-host") == report.total("device-to-host")


@pytest.mark.parametrize(
    "options, match",
    [
        (dict(update_on="cpu"), r"update_on=\.\.\.\) is 'cpu'; expected 'device'"),
        (dict(update_on="host", stream="leaf"), r"update_on='host', stream='leaf'"),
        (dict(update_on="host", memory="device"), r"keeps the state in host memory"),
    ],
)
def test_bad_options_are_refused_when_wrapping(options, match):
    with pytest.raises(ValueError, match=match):
        ox.offload_optimizer(optax.adam(1e-2), **options)


def test_a_strategy_with_a_host_update_and_device_state_is_refused():
    with pytest.raises(ValueError, match=r"update='host' and optimizer='device'"):
        ox.Strategy("s", optimizer="device", update="host")


@pytest.mark.parametrize("stream", ["leaf", "layer"])
@pytest.mark.parametrize("params", ["device", "pinned_host"])
@pytest.mark.parametrize("apply", ["update_and_apply", "apply_updates"])
def test_a_streamed_optimizer_updates_on_the_host_under_a_host_update_strategy(
    stream, params, apply
):
    """One optimizer serves both kinds of plan: streamed to the device by default, one
    host computation under `update="host"` (`ox.fit` searches both with one step). The
    global transform runs on the host too; the results equal plain optax."""
    strategy = ox.Strategy(
        "host_update", params=params, optimizer="pinned_host", activations="remat", update="host"
    )
    layers = {"layer": 3, "leaf": None}[stream]  # `scanned_model` has 3 layers
    opt = ox.offload_optimizer(
        optax.adamw(1e-2, weight_decay=0.1),
        stream=stream,
        layers=layers,
        global_transform=optax.clip_by_global_norm(0.5),
    )
    model, state, step, x = _train(opt, strategy, apply=apply)
    reference = optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(1e-2, weight_decay=0.1))
    _assert_equal(model, _reference(reference))
    for leaf in jax.tree_util.tree_leaves(state):
        assert leaf.sharding.memory_kind == "pinned_host"
    report = ox.audit(step, model, state, x)
    assert not report.select(kind="optimizer")
    names = [h.name for h in report.host_computations]
    expected = {
        "update_and_apply": ["optimizer update and apply"],
        "apply_updates": ["optimizer update"] + (["apply updates"] if params != "device" else []),
    }
    assert names == expected[apply]


def test_update_without_parameters_for_weight_decay_is_refused():
    opt = ox.offload_optimizer(optax.adamw(1e-2, weight_decay=0.1), update_on="host")
    model = scanned_model(jax.random.key(0))
    state = opt.init(model)  # pyright: ignore[reportArgumentType]

    @ox.filter_jit(strategy="offload_optimizer")
    def step(model, state, x):
        grads = eqx.filter_grad(loss_fn)(model, x)
        return opt.update(grads, state)

    with pytest.raises(ValueError, match=r"reads the parameters .*opt.update\(grads, opt_state"):
        step(model, state, _batch())


# -- the real compilers ---------------------------------------------------------------


def _abstract_step(update_on):
    model = eqx.filter_eval_shape(scanned_model, jax.random.key(0), width=256, hidden=512)
    opt = ox.offload_optimizer(CHAINS["clip_adamw"](), update_on=update_on)
    state = eqx.filter_eval_shape(opt.init, model)

    @ox.filter_jit(strategy="offload_optimizer", donate="all")
    def step(model, state, x):
        grads = eqx.filter_grad(loss_fn)(model, x)
        return ox.update_and_apply(opt, grads, state, model)

    return step, (model, state, jax.ShapeDtypeStruct((64, 256), jnp.float32))


@pytest.mark.deviceless
def test_h100_host_update_holds_less_device_memory_than_the_device_update():
    host_step, args = _abstract_step("host")
    device_step, device_args = _abstract_step("device")
    host = ox.memory_report(host_step, *args, target="h100")
    device = ox.memory_report(device_step, *device_args, target="h100")
    assert host.total < device.total
    assert host.host["temp"] > device.host["temp"]  # the host computation's temporaries


def _stack_step(opt):
    @ox.filter_jit(strategy="hybrid", donate="all")
    def step(model, state, x):
        grads = eqx.filter_grad(lambda m: jnp.mean(m(x) ** 2))(model)
        return ox.update_and_apply(opt, grads, state, model)

    return step


@pytest.mark.deviceless
@pytest.mark.parametrize("chain", ["adam", "clip_adam"])
def test_h100_host_update_needs_no_more_device_memory_than_the_layer_streamed_one(chain):
    """Issue 21: under `hybrid` on a scanned model of 8 layers of 1024^2, the host update
    (update and sum in one host computation) needs at most 1.1x the device memory of the
    update streamed layer by layer on the device; before, the updates passed between two
    host computations through device memory (8.25P against 7.25P)."""
    make = {
        "adam": lambda: optax.adam(1e-3),
        "clip_adam": lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3)),
    }[chain]
    layers, dim = 8, 1024
    model = eqx.filter_eval_shape(lambda: HostStack(HostSquare(jnp.zeros((layers, dim, dim)))))
    x = jax.ShapeDtypeStruct((256, dim), jnp.float32)
    totals = {}
    for name, opt in {
        "host": ox.offload_optimizer(make(), update_on="host"),
        "layer": ox.offload_optimizer(optax.adam(1e-3), stream="layer", layers=layers),
    }.items():
        state = eqx.filter_eval_shape(opt.init, model)
        totals[name] = ox.memory_report(_stack_step(opt), model, state, x, target="h100").total
    assert totals["host"] <= 1.1 * totals["layer"], totals

    # On the CPU, the same step's audit: each gradient sent once, no optimizer state moved.
    opt = ox.offload_optimizer(make(), update_on="host")
    concrete = ox.place(HostStack(HostSquare(jnp.full((layers, 32, 32), 0.01))), "hybrid")
    state = opt.init(concrete)
    report = ox.audit(_stack_step(opt), concrete, state, jnp.ones((4, 32)))
    (sent,) = report.select("device-to-host", kind="gradient")
    assert sent.count == layers and sent.what == "model.layers.w"
    assert not report.select(kind="optimizer")
    assert not report.select("host-to-device", phase="update")


@pytest.mark.deviceless
def test_tpu_refuses_a_host_update_at_compile_time_naming_the_target():
    step, args = _abstract_step("host")
    with pytest.raises(ValueError, match=r"target 'tpu-v5p' does not support: XLA:TPU gains"):
        ox.memory_report(step, *args, target="tpu-v5p")
