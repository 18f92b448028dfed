"""The static audit: exact transfers of the seed workload, and a catalog of contract breaches.

Everything here traces on `jax.ShapeDtypeStruct`s (or small arrays) and runs nothing.
"""

import pathlib

import equinox as eqx
import jax
import jax.extend as jex
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import seed_model
from jax import checkpoint_policies
from jax.experimental import io_callback
from jaxtyping import Array, Float

import offload_eqx as ox
from offload_eqx import ContractError, HostUseError, TransferReport, audit

MiB = 2**20
S = jax.ShapeDtypeStruct
# The models here are built from `ShapeDtypeStruct`s (nothing is allocated).
ArrayOrSpec = Array | jax.ShapeDtypeStruct
HOST = jax.memory.Space.Host
DEVICE = jax.memory.Space.Device


# -- the seed workload: 10 scanned layers, x 256x256, w1 10x256x1024, w2 10x1024x256 -------

SEED_MODEL = seed_model(layers=10, width=256, hidden=1024)  # pinned_host weights
SEED_X = S((256, 256), jnp.float32)
OPT = ox.offload_optimizer(optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3)))
SEED_OPT_STATE = eqx.filter_eval_shape(OPT.init, SEED_MODEL)


def seed_step(strategy: str):
    @ox.filter_jit(strategy=strategy)
    def step(model, opt_state, x):
        loss, grads = eqx.filter_value_and_grad(lambda m: jnp.sum(m(x) ** 2))(model)
        updates, opt_state = OPT.update(grads, opt_state, model)
        return ox.apply_updates(model, updates), opt_state, loss

    return step


def seed_report(strategy: str) -> TransferReport:
    return audit(seed_step(strategy), SEED_MODEL, SEED_OPT_STATE, SEED_X)


def test_offload_activation_x_moves_exactly_2_5_mib_each_way():
    # x is 256x256 float32 = 256 KiB per layer; the forward scan offloads it once per layer
    # and the backward scan fetches it back once per layer: 10 x 256 KiB = 2.5 MiB each way.
    report = seed_report("offload_activations")
    report.assert_only(("d2h", "x", 2.5 * MiB, "forward"), ("h2d", "x", 2.5 * MiB, "backward"))
    assert report.totals == {"device-to-host": 2.5 * MiB, "host-to-device": 2.5 * MiB}
    assert all(t.kind == "activation" and t.count == 10 for t in report.transfers)
    report.assert_no_implicit()


def test_parameter_offload_matches_hand_computation():
    # Strategy offload_params: w1, w2 in pinned_host, every other value in a region saved,
    # except fetched weights (the policy never saves them). Per layer w1[i] and w2[i] are
    # 256x1024 float32 = 1 MiB each, so one pass over the 10 layers fetches 20 MiB:
    #   forward  H2D: fetch w1[i], w2[i] in each layer            10 x 2 MiB = 20 MiB
    #   backward H2D: fetch them again inside the remat region    10 x 2 MiB = 20 MiB
    #   backward D2H: the transpose of each fetch sends the layer's gradient to host
    #                                                             10 x 2 MiB = 20 MiB
    #   update   H2D: ox.offload_optimizer fetches the host-typed gradients   20 MiB
    #   update   H2D + D2H: ox.apply_updates fetches each parameter, adds, sends it
    #                 back                                       20 MiB + 20 MiB
    # Total: 80 MiB host-to-device, 40 MiB device-to-host.
    report = seed_report("offload_params")
    report.assert_only(
        ("h2d", "model.layers.w*", 20 * MiB, "forward"),
        ("h2d", "model.layers.w*", 20 * MiB, "backward"),
        ("d2h", "model.layers.w*", 20 * MiB, "backward"),
        ("h2d", "model.layers.w*", 40 * MiB, "update"),
        ("d2h", "model.layers.w*", 20 * MiB, "update"),
    )
    assert report.total("d2h", kind="gradient") == 20 * MiB
    assert report.total("h2d", kind="gradient") == 20 * MiB
    assert report.total("h2d", "model.layers.w1", kind="parameter") == 30 * MiB
    assert report.totals == {"device-to-host": 40 * MiB, "host-to-device": 80 * MiB}


def test_optimizer_offload_matches_hand_computation():
    # Adam's mu and nu mirror the parameters: 2 x (10 MiB + 10 MiB) = 40 MiB in pinned_host
    # (the int32 count stays on the device). Each update fetches all of it and writes all
    # of it back: 40 MiB each way, nothing in the forward or backward pass.
    report = seed_report("offload_optimizer")
    report.assert_only(
        ("h2d", "opt_state.inner[[]1[]][[]0[]].*u.layers.w*", 40 * MiB, "update"),
        ("d2h", "opt_state.inner[[]1[]][[]0[]].*u.layers.w*", 40 * MiB, "update"),
    )
    assert {t.kind for t in report.transfers} == {"optimizer"}


def test_hybrid_is_the_sum_of_its_parts():
    report = seed_report("hybrid")
    # activations 2.5 + parameters (40 as above) + optimizer 40 each way.
    assert report.totals == {
        "device-to-host": (2.5 + 20 + 20 + 40) * MiB,
        "host-to-device": (2.5 + 20 + 20 + 20 + 20 + 40) * MiB,
    }
    assert report.total("d2h", "x", phase="forward") == 2.5 * MiB
    assert report.total(kind="optimizer") == 80 * MiB
    assert report.select("h2d", "opt_state.inner[[]1[]][[]0[]].mu.layers.w1")[0].shape == (
        10,
        256,
        1024,
    )


@pytest.mark.parametrize("strategy", list(ox.STRATEGIES))
def test_no_false_alarm_on_any_strategy(strategy: str):
    report = seed_report(strategy)
    assert report.violations == []
    report.assert_no_implicit()
    if strategy in ("baseline", "remat"):
        report.assert_only()


def test_table_and_json():
    report = seed_report("hybrid")
    table = str(report)
    assert "device-to-host  activation  x" in table
    assert "total device-to-host: 82.50 MiB" in table
    data = report.as_dict()
    assert data["totals"]["host-to-device"] == 122.5 * MiB
    assert {"direction", "kind", "what", "shape", "dtype", "count", "bytes", "phase"} <= set(
        data["transfers"][0]
    )
    assert '"strategy": "hybrid"' in report.to_json()


def test_assert_only_reports_what_differs():
    report = seed_report("offload_activations")
    with pytest.raises(AssertionError, match=r"expected device-to-host 'x' to move 1.00 MiB"):
        report.assert_only(("d2h", "x", MiB), ("h2d", "x"))
    with pytest.raises(
        AssertionError, match=r"unexpected transfer: host-to-device of activation `x`"
    ):
        report.assert_only(("d2h", "x"))
    with pytest.raises(
        AssertionError, match=r"expected host-to-device 'model.\*', but no transfer"
    ):
        report.assert_only(("d2h", "x"), ("h2d", "x"), ("h2d", "model.*"))


# -- control flow: scan trip counts multiply, a cond counts its largest branch -------------


def test_nested_scans_multiply_and_cond_takes_the_largest_branch():
    def inner(carry, _):
        def offload(c):
            return jax.device_put(jax.device_put(c, HOST), DEVICE)

        def offload_twice(c):
            return offload(offload(c))

        return jax.lax.cond(carry[0] > 0, offload_twice, offload, carry), None

    def f(x: Float[Array, "64"]) -> Float[Array, "64"]:
        def outer(c, _):
            return jax.lax.scan(inner, c, None, length=3)[0], None

        return jax.lax.scan(outer, x, None, length=5)[0]

    report = audit(f, S((64,), jnp.float32))
    # 64 float32 = 256 B per move; 5 x 3 iterations; the larger branch moves it twice.
    report.assert_only(("d2h", "*", 2 * 15 * 256), ("h2d", "*", 2 * 15 * 256))
    assert {t.count for t in report.transfers} == {15}
    assert report.transfers[0].where.startswith("scan[5] > scan[3] > cond branch 1")


# -- catalog: contract breaches, each naming its path ----------------------------------------


class Dense(eqx.Module):
    w: Float[ArrayOrSpec, "d d"] = ox.field(memory="pinned_host")

    def __call__(self, x):
        return jnp.tanh(x @ self.w)


class NamedDense(eqx.Module):
    w: Float[ArrayOrSpec, "d d"] = ox.field(memory="pinned_host")

    def __call__(self, x):
        return jnp.tanh(ox.name(x * 2, "h") @ self.w)


def dense(d: int = 8) -> Dense:
    return Dense(S((d, d), jnp.float32))


X = S((4, 8), jnp.float32)


def grad_step(loss):
    @ox.filter_jit
    def step(model, x):
        return eqx.filter_grad(loss)(model, x)

    return step


def test_host_leaf_used_outside_a_region_names_only_that_leaf():
    class Two(eqx.Module):
        first: Dense
        second: Dense

        def __call__(self, x):
            h = x @ self.first.w  # outside any region
            return ox.checkpoint(self.second, h)

    step = grad_step(lambda m, x: jnp.sum(m(x)))
    # Found while tracing: a typed error, the same from `ox.filter_jit` and `ox.audit`.
    with pytest.raises(HostUseError, match=r"`model\.first\.w` is host-resident") as info:
        audit(step, Two(dense(), dense()), X)
    assert "model.second.w" not in str(info.value)
    assert info.value.paths == ("model.first.w",)
    assert [v.path for v in info.value.violations] == ["model.first.w"]


def test_explicit_fetch_outside_a_region_is_a_residual():
    def loss(model, x):
        w = jax.device_put(model.w, DEVICE)  # fetched once, outside a region
        return jnp.sum(jnp.tanh(x @ w) @ w)  # the backward pass needs w again

    with pytest.raises(ContractError, match=r"`model\.w` is host-resident, but its device copy"):
        audit(grad_step(loss), dense(), X)
    # Inside a region the same model is clean: the copy is fetched again for the backward.
    audit(grad_step(lambda m, x: jnp.sum(ox.checkpoint(m, x) ** 2)), dense(), X)


def test_arithmetic_on_host_typed_values_unless_asked_for():
    @ox.filter_jit
    def decay(model):
        return eqx.tree_at(lambda m: m.w, model, model.w * 0.5)

    with pytest.raises(
        ContractError, match=r"`mul` computes on `model\.w` \(float32<host>\[8,8\]\)"
    ):
        audit(decay, dense())

    @ox.filter_jit
    def decay_on_host(model):
        with ox.host_compute():
            return eqx.tree_at(lambda m: m.w, model, model.w * 0.5)

    assert audit(decay_on_host, dense()).transfers == []


def test_host_typed_gradients_fed_to_clipping():
    clip = optax.clip_by_global_norm(1.0)  # not wrapped in ox.offload_optimizer

    @ox.filter_jit
    def step(model, x):
        grads = eqx.filter_grad(lambda m: jnp.sum(ox.checkpoint(m, x) ** 2))(model)
        updates, _ = clip.update(grads, clip.init(grads))
        return updates

    # The trace fails where the host-typed norm meets a device value; the audit retraces to
    # find which host-resident leaf is responsible.
    with pytest.raises(ContractError, match=r"`model\.w` is host-resident.*its gradient") as info:
        audit(step, dense(), X)
    assert "ox.offload_optimizer" in str(info.value)
    assert [v.path for v in info.value.violations] == ["model.w"]


def test_host_typed_gradients_reduced_on_host():
    @ox.filter_jit
    def step(model, x):
        grads = eqx.filter_grad(lambda m: jnp.sum(ox.checkpoint(m, x) ** 2))(model)
        return jnp.sum(grads.w**2)  # a global norm computed on host-typed gradients

    with pytest.raises(ContractError, match=r"gradient of `model\.w` is host-typed"):
        audit(step, dense(), X)


def test_unwrapped_optax_state_meets_host_typed_gradients():
    # A raw optax state mirrors the model but is not the model: the plan leaves it on the
    # device. The host-typed gradients of `model.w` then meet it in Adam's update.
    adam = optax.adam(1e-3)

    @ox.filter_jit
    def step(model, state, x):
        grads = eqx.filter_grad(lambda m: jnp.sum(ox.checkpoint(m, x) ** 2))(model)
        return adam.update(grads, state)

    state = jax.eval_shape(adam.init, Dense(jnp.zeros((8, 8))))
    assert all(leaf.memory is None for leaf in step.plan(dense(), state, X).leaves[1:-1])
    with pytest.raises(
        ContractError, match=r"`model\.w` is host-resident.*its gradient.*ox.offload_optimizer"
    ):
        audit(step, dense(), state, X)


def test_output_returned_in_the_wrong_memory_kind():
    @ox.filter_jit
    def step(model, x):
        grads = eqx.filter_grad(lambda m: jnp.sum(ox.checkpoint(m, x) ** 2))(model)
        w = jax.device_put(model.w, DEVICE) - 0.1 * jax.device_put(grads.w, DEVICE)
        return eqx.tree_at(lambda m: m.w, model, w), x  # w left on the device

    with pytest.raises(
        ContractError,
        match=r"Output `output\[0\]\.w` is returned in 'device' memory, but it is "
        r"the new value of `model\.w`, which the plan puts in 'pinned_host'",
    ):
        audit(step, dense(), X)


def test_annotated_name_never_produced():
    class Misspelled(eqx.Module):
        inner: NamedDense
        activations: ox.Activations = ox.activations(hh="offload")

        def __call__(self, x):
            return ox.checkpoint(self.inner, x)

    step = grad_step(lambda m, x: jnp.sum(m(x)))
    with pytest.raises(ValueError, match=r"Activation 'hh' is declared 'offload' by `model`"):
        audit(step, Misspelled(NamedDense(S((8, 8), jnp.float32))), X)


def test_name_both_saved_and_offloaded():
    class A(eqx.Module):
        d: Dense
        activations: ox.Activations = ox.activations(h="save")

    class B(eqx.Module):
        d: Dense
        activations: ox.Activations = ox.activations(h="offload")

    class Both(eqx.Module):
        a: A
        b: B

        def __call__(self, x):
            return self.b.d(self.a.d(x))

    with pytest.raises(ValueError, match=r"'save' by `model\.a` and 'offload' by `model\.b`"):
        audit(grad_step(lambda m, x: jnp.sum(m(x))), Both(A(dense()), B(dense())), X)


def test_offload_declared_name_outside_a_region():
    class Outside(eqx.Module):
        inner: Dense
        activations: ox.Activations = ox.activations(h="offload")

        def __call__(self, x):
            return ox.checkpoint(self.inner, ox.name(x * 2, "h"))

    with pytest.raises(ValueError, match=r"Activation 'h' \(declared 'offload' by `model`\)"):
        audit(grad_step(lambda m, x: jnp.sum(m(x))), Outside(dense()), X)


def test_strategy_saves_but_a_hand_written_policy_offloads():
    offload_h = checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=[],
        names_which_can_be_offloaded=["h"],
        offload_src="device",
        offload_dst="pinned_host",
    )

    class HandRemat(eqx.Module):
        w: Float[ArrayOrSpec, "d d"] = ox.field(memory="pinned_host")
        activations: ox.Activations = ox.activations(h="offload")

        def __call__(self, x):
            def body(x, w):
                return jnp.sin(ox.name(x @ w, "h"))

            return jnp.tanh(jax.checkpoint(body, policy=offload_h)(x, self.w) @ self.w)

    # "baseline" keeps every activation on the device (effective policy 'save'), but the
    # hand-written jax.checkpoint policy still offloads 'h'.
    @ox.filter_jit(strategy="baseline")
    def step(model, x):
        return eqx.filter_grad(lambda m: jnp.sum(m(x) ** 2))(model)

    with pytest.raises(
        ContractError,
        match=r"Activation 'h' is declared 'save' \(effective policy\) by `model`.*moves it",
    ):
        audit(step, HandRemat(S((8, 8), jnp.float32)), X)


def test_host_resident_leaf_scanned_over_axis_1():
    class Stacked(eqx.Module):
        layers: Dense

        def __call__(self, x):
            return ox.scan(self.layers, x, axis=1)

    model = Stacked(Dense(S((8, 3, 8), jnp.float32)))
    # Under `jax.grad` the layers are the argument's tangent tracers: named by its path.
    with pytest.raises(ValueError, match=r"`model\.layers\.w` is host-resident.*axis 0"):
        audit(grad_step(lambda m, x: jnp.sum(m(x))), model, X)


def test_array_whose_sharding_says_host_but_type_says_device_is_audited_by_its_plan():
    """The plan types the trace, so the array is compiled as the host memory it is in:
    no contract breach and no implicit copy (plain `jax.jit` would treat it as device)."""
    host = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host")
    mistyped = Dense(jax.jit(lambda: jnp.eye(8), out_shardings=host)())
    step = grad_step(lambda m, x: jnp.sum(ox.checkpoint(m, x)))
    report = audit(step, mistyped, jnp.ones((4, 8)))
    report.assert_no_implicit()
    assert report.select(direction="host-to-device", kind="parameter")


def test_numpy_argument_is_an_implicit_upload():
    step = grad_step(lambda m, x: jnp.sum(ox.checkpoint(m, x)))
    model = ox.place(Dense(jnp.eye(8)))
    report = audit(step, model, np.ones((4, 8), np.float32))
    assert [(t.what, t.phase, t.implicit) for t in report.implicit] == [("x", "call", True)]
    with pytest.raises(AssertionError, match=r"host-to-device of input `x` \(float32\[4x8\]"):
        report.assert_no_implicit()


def test_argument_not_where_the_plan_puts_it_is_moved_every_call():
    step = grad_step(lambda m, x: jnp.sum(ox.checkpoint(m, x)))
    unplaced = Dense(jnp.eye(8))  # on the device, declared pinned_host
    report = audit(step, unplaced, jnp.ones((4, 8)))
    with pytest.raises(AssertionError, match=r"device-to-host of parameter `model\.w`"):
        report.assert_no_implicit()
    audit(step, ox.place(unplaced), jnp.ones((4, 8))).assert_no_implicit()


def test_contract_error_carries_the_report():
    @ox.filter_jit
    def decay(model):
        return eqx.tree_at(lambda m: m.w, model, model.w * 0.5)

    with pytest.raises(ContractError) as info:
        audit(decay, dense())
    assert isinstance(info.value.report, TransferReport)
    assert [v.rule for v in info.value.violations] == ["arithmetic on host"]
    assert "violations (1)" in info.value.report.table()


def test_attribution_and_phases_through_a_nested_jit():
    @ox.filter_jit(strategy="hybrid")
    def step(model, opt_state, x):
        value_and_grad = eqx.filter_value_and_grad(lambda m: jnp.sum(m(x) ** 2))
        loss, grads = eqx.filter_jit(value_and_grad)(model)
        updates, opt_state = OPT.update(grads, opt_state, model)
        return ox.apply_updates(model, updates), opt_state, loss

    nested = audit(step, SEED_MODEL, SEED_OPT_STATE, SEED_X)
    flat = seed_report("hybrid")
    assert nested.totals == flat.totals
    for phase in ("forward", "backward", "update"):
        assert nested.total(phase=phase) == flat.total(phase=phase)
    assert nested.select("d2h", "x")[0].where == "jit > scan[10]"


# -- issue 10 item 4: moving data within host memory is not arithmetic ----------------------


class Stack(eqx.Module):
    w: Float[ArrayOrSpec, "layers d d"] = ox.field(memory="pinned_host")


def test_slicing_and_writing_back_host_layers_is_not_arithmetic():
    # The layer-streamed optimizer's pattern: slice one layer of a host-resident stack on
    # the host, fetch it, compute on the device, send it back and write it into the stack
    # with dynamic_update_slice; then reshape, transpose, concatenate and pad on the host.
    @ox.filter_jit
    def step(model):
        def body(i, w):
            layer = jax.lax.dynamic_slice_in_dim(w, i, 1)
            new = jax.device_put(jax.device_put(layer, DEVICE) * 0.5, HOST)
            return jax.lax.dynamic_update_slice_in_dim(w, new, i, 0)

        w = jax.lax.fori_loop(0, 3, body, model.w)
        w = jnp.concatenate([w[:1], w[1:]]).transpose(0, 2, 1).reshape(w.shape)
        w = jnp.pad(w, ((0, 0), (0, 0), (0, 0)))
        w = jnp.where(True, w, w)  # select_n on host values
        return eqx.tree_at(lambda m: m.w, model, w)

    report = audit(step, Stack(S((3, 8, 8), jnp.float32)))
    assert report.violations == []
    # One 8x8 float32 layer (256 B) fetched and sent back per iteration, 3 iterations;
    # the fetched slice is still attributed to the leaf it was cut from.
    report.assert_only(("h2d", "model.w", 3 * 256), ("d2h", "*", 3 * 256))


def test_arithmetic_next_to_data_movement_is_still_found():
    @ox.filter_jit
    def step(model):
        layer = jax.lax.dynamic_slice_in_dim(model.w, 0, 1)  # fine: a slice
        return layer * 2.0  # not fine: arithmetic in host memory

    with pytest.raises(ContractError, match=r"`mul` computes on `model\.w`"):
        audit(step, Stack(S((3, 8, 8), jnp.float32)))


class ViTBlock(eqx.Module):
    norm: eqx.nn.LayerNorm
    attention: eqx.nn.MultiheadAttention
    up: eqx.nn.Linear
    down: eqx.nn.Linear

    def __call__(self, x: Float[Array, "tokens width"]) -> Float[Array, "tokens width"]:
        h = jax.vmap(self.norm)(x)
        x = x + self.attention(h, h, h)
        h = ox.name(jax.vmap(self.up)(jax.vmap(self.norm)(x)), "mlp_hidden")
        return x + jax.vmap(self.down)(jax.nn.gelu(h))


class ViT(eqx.Module):
    """Conv2d patches, per image: the step `jax.vmap`s it over the batch."""

    patches: eqx.nn.Conv2d
    blocks: list[ViTBlock]
    head: eqx.nn.Linear
    activations: ox.Activations = ox.activations(mlp_hidden="offload")

    def __call__(self, image: Float[Array, "3 8 8"]) -> Float[Array, " 5"]:
        x = self.patches(image)
        x = x.reshape(x.shape[0], -1).T
        for block in self.blocks:
            x = ox.checkpoint(block, x)
        return self.head(jnp.mean(x, axis=0))


def vit(key, width: int = 16) -> ViT:
    keys = jax.random.split(key, 8)
    blocks = [
        ViTBlock(
            eqx.nn.LayerNorm(width),
            eqx.nn.MultiheadAttention(2, width, key=keys[i]),
            eqx.nn.Linear(width, 32, key=keys[i + 2]),
            eqx.nn.Linear(32, width, key=keys[i + 4]),
        )
        for i in range(2)
    ]
    return ViT(
        eqx.nn.Conv2d(3, width, 4, stride=4, key=keys[6]),
        blocks,
        eqx.nn.Linear(width, 5, key=keys[7]),
    )


class EncoderBlock(eqx.Module):
    attention: eqx.nn.MultiheadAttention
    norm: eqx.nn.LayerNorm
    up: eqx.nn.Linear
    dropout: eqx.nn.Dropout

    def __call__(self, x, *, key):
        k1, k2 = jax.random.split(key)
        x = jax.vmap(self.norm)(x + self.dropout(self.attention(x, x, x), key=k1))
        h = ox.name(jax.vmap(self.up)(x), "ff")
        return jax.vmap(self.norm)(x + self.dropout(jax.nn.gelu(h), key=k2))


class Encoder(eqx.Module):
    """A Python list of blocks, each through `ox.checkpoint`, with dropout."""

    embedding: eqx.nn.Embedding
    blocks: list[EncoderBlock]
    activations: ox.Activations = ox.activations(ff="offload")

    def __call__(self, tokens, *, key):
        x = jax.vmap(self.embedding)(tokens)
        for block, k in zip(self.blocks, jax.random.split(key, len(self.blocks))):
            x = ox.checkpoint(block, x, key=k)
        return jnp.mean(x)


def encoder(key, width: int = 16) -> Encoder:
    keys = jax.random.split(key, 5)
    blocks = [
        EncoderBlock(
            eqx.nn.MultiheadAttention(2, width, key=keys[i]),
            eqx.nn.LayerNorm(width),
            eqx.nn.Linear(width, width, key=keys[i + 2]),
            eqx.nn.Dropout(0.1),
        )
        for i in range(2)
    ]
    return Encoder(eqx.nn.Embedding(32, width, key=keys[4]), blocks)


ADAM = optax.adam(1e-3)


def plain_optax_step(loss):
    @ox.filter_jit(strategy="offload_activations")
    def step(model, opt_state, batch, key):
        value, grads = eqx.filter_value_and_grad(loss)(model, batch, key)
        updates, opt_state = ADAM.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        return eqx.apply_updates(model, updates), opt_state, value

    return step


def test_vit_with_vmapped_conv_patches_is_not_flagged():
    key = jax.random.PRNGKey(0)
    model = vit(key)
    images = jnp.ones((2, 3, 8, 8))
    step = plain_optax_step(lambda m, images, _: jnp.mean(jax.vmap(m)(images) ** 2))
    report = audit(step, model, ADAM.init(eqx.filter(model, eqx.is_array)), images, key)
    # The named hidden (4 tokens x 32 float32 per image, 2 images, 2 blocks) goes to the
    # host in the forward pass and back in the backward pass; nothing else moves.
    report.assert_only(
        ("d2h", "mlp_hidden", 2 * 2 * 4 * 32 * 4), ("h2d", "mlp_hidden", 2 * 2 * 4 * 32 * 4)
    )


def test_encoder_with_dropout_and_a_list_of_blocks_is_not_flagged():
    key = jax.random.PRNGKey(0)  # a raw key: typed keys are issue 10 item 1 (the plan's)
    model = encoder(key)
    tokens = jnp.ones((2, 8), jnp.int32)

    def loss(m, tokens, key):
        return jnp.mean(jax.vmap(lambda t, k: m(t, key=k))(tokens, jax.random.split(key, 2)))

    step = plain_optax_step(loss)
    report = audit(step, model, ADAM.init(eqx.filter(model, eqx.is_array)), tokens, key)
    report.assert_only(("d2h", "ff", 2 * 2 * 8 * 16 * 4), ("h2d", "ff", 2 * 2 * 8 * 16 * 4))


# -- issue 10 item 5: host callbacks move data every call -----------------------------------


def host_sine(x):
    return np.sin(x)


def test_callbacks_are_reported_as_transfers():
    seen = []

    def f(x: Float[Array, "64"]) -> Float[Array, "64"]:
        def body(c, _):
            y = jax.pure_callback(host_sine, jax.ShapeDtypeStruct(c.shape, c.dtype), c)
            jax.debug.print("y={y}", y=y[0])
            return y, None

        y = jax.lax.scan(body, x, None, length=3)[0]
        jax.debug.callback(seen.append, y)
        return io_callback(host_sine, jax.ShapeDtypeStruct(y.shape, y.dtype), y)

    report = audit(f, S((64,), jnp.float32))
    assert {t.kind for t in report.transfers} == {"callback"}
    # 64 float32 = 256 B each way per pure_callback, 3 scan iterations; the printed
    # scalar (4 B) goes down 3 times; debug.callback and io_callback once each.
    report.assert_only(
        ("d2h", "jax.pure_callback(host_sine)", 3 * 256),
        ("h2d", "jax.pure_callback(host_sine)", 3 * 256),
        ("d2h", "jax.debug.print('y={y}')", 3 * 4),
        ("d2h", "jax.debug.callback(list.append)", 256),
        ("d2h", "io_callback(host_sine)", 256),
        ("h2d", "io_callback(host_sine)", 256),
    )
    assert report.select("d2h", "jax.pure_callback*")[0].where == "scan[3]"
    assert "(no transfers)" not in str(report)


# -- issue 37 items 2 and 15: every transfer named by what it is, never by its shape --------


class PreNormBlock(eqx.Module):
    norm: eqx.nn.LayerNorm  # weight and bias of one shape
    linear: eqx.nn.Linear

    def __call__(self, x):
        return x + self.linear(jax.nn.gelu(self.norm(x)))


class ScannedBlocks(eqx.Module):
    """`eqx.filter_vmap`-stacked blocks under a plain `jax.lax.scan`, and a head."""

    blocks: PreNormBlock
    head: eqx.nn.Linear

    def __call__(self, x):
        dynamic, static = eqx.partition(self.blocks, eqx.is_array)

        def body(x, block):
            return eqx.combine(block, static)(x), None

        return self.head(jax.lax.scan(body, x, dynamic)[0])


def scanned_blocks() -> ScannedBlocks:
    keys = jax.random.split(jax.random.key(0), 4)
    blocks = eqx.filter_vmap(
        lambda key: PreNormBlock(eqx.nn.LayerNorm(4), eqx.nn.Linear(4, 4, key=key))
    )(keys[:3])
    model = ScannedBlocks(blocks, eqx.nn.Linear(4, 2, key=keys[3]))
    return ox.place(ox.annotate(model, lambda m: m.blocks, memory="pinned_host"))


def host_leaves(root: str, tree) -> dict[str, int]:
    """Each host-resident array of `tree` by its path under the argument name `root`."""
    return {
        root + jax.tree_util.keystr(path): leaf.nbytes
        for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]
        if eqx.is_array(leaf) and leaf.sharding.memory_kind == "pinned_host"
    }


def bytes_by_name(report: TransferReport, direction: str, phase: str) -> dict[str, int]:
    moved: dict[str, int] = {}
    for t in report.select(direction, phase=phase):
        moved[t.what] = moved.get(t.what, 0) + t.bytes
    return moved


@pytest.mark.parametrize(
    "options, steps",
    [
        (dict(stream="leaf"), 1),
        (dict(stream="leaf"), 3),
        (dict(stream="layer", layers=3), 1),
        ({}, 3),
    ],
)
def test_each_write_back_is_named_by_the_leaf_it_writes(options, steps):
    """The new `mu`/`nu` and the updated host weights were `a computed value` under
    `stream="leaf"`/`"layer"`, and under any optimizer inside a `jax.lax.scan` over steps."""
    model = scanned_blocks()
    opt = ox.offload_optimizer(optax.adamw(1e-3), **options)
    opt_state = ox.place(opt.init(eqx.filter(model, eqx.is_inexact_array)))
    x = jnp.ones(4)

    def train_step(model, opt_state):
        grads = eqx.filter_grad(lambda m: jnp.sum(m(x) ** 2))(model)
        return ox.update_and_apply(opt, grads, opt_state, model)

    @ox.filter_jit
    def train(model, opt_state):
        params, static = eqx.partition(model, eqx.is_array)

        def body(carry, _):
            model, opt_state = train_step(eqx.combine(carry[0], static), carry[1])
            return (eqx.filter(model, eqx.is_array), opt_state), None

        (params, opt_state), _ = jax.lax.scan(body, (params, opt_state), None, length=steps)
        return eqx.combine(params, static), opt_state

    report = audit(train_step if steps == 1 else train, model, opt_state)
    written = {**host_leaves("opt_state", opt_state), **host_leaves("model", model)}
    assert len(written) == 6 * 2 + 4  # mu and nu of the 6 parameters, the 4 host weights
    assert bytes_by_name(report, "d2h", "update") == {
        path: size * steps for path, size in written.items()
    }, report


@pytest.mark.parametrize("frozen", [None, "norm.weight", "norm.bias"])
def test_gradients_under_a_plain_scan_are_named_by_their_leaf_not_their_shape(frozen):
    """The layer norm's weight and bias (and the linear layer's bias) have one shape; the
    rows were matched by shape: "one of model.blocks.norm.weight, ...", or a leaf held
    fixed named for another's gradient."""
    model = scanned_blocks()
    spec = jax.tree_util.tree_map(lambda _: True, model)
    if frozen is not None:
        names = frozen.split(".")
        spec = eqx.tree_at(lambda s: getattr(getattr(s.blocks, names[0]), names[1]), spec, False)

    @ox.filter_jit
    def gradients(model, x):
        trained, fixed = eqx.partition(model, spec)
        return eqx.filter_grad(lambda t: jnp.sum(eqx.combine(t, fixed)(x) ** 2))(trained)

    report = audit(gradients, model, jnp.ones(4))
    expected = {
        path: size
        for path, size in host_leaves("model", model).items()
        if frozen is None or not path.endswith(frozen)
    }
    assert bytes_by_name(report, "d2h", "backward") == expected, report
    assert {t.kind for t in report.select("d2h")} == {"gradient"}


def test_the_gradient_of_a_leaf_fetched_with_ox_fetch_is_named_by_the_leaf():
    """It was named by the output it is returned as (`output.first.weight`, kind
    `output`): a fetch differentiated where it is traced leaves its transpose no trace of
    the fetch but the label `ox.fetch` gives it."""

    class Pair(eqx.Module):
        first: eqx.nn.Linear
        second: eqx.nn.Linear

    keys = jax.random.split(jax.random.key(0))
    linears = [eqx.nn.Linear(4, 4, use_bias=False, key=key) for key in keys]
    model = ox.place(ox.annotate(Pair(*linears), lambda m: m, memory="pinned_host"))
    spec = eqx.tree_at(
        lambda m: m.second.weight, jax.tree_util.tree_map(lambda _: True, model), False
    )

    @ox.filter_jit
    def gradients(model):
        trained, fixed = eqx.partition(model, spec)

        def penalty(trained):
            fetched = ox.fetch(eqx.combine(trained, fixed))
            return sum(jnp.sum(w**2) for w in jax.tree_util.tree_leaves(fetched))

        return eqx.filter_grad(penalty)(trained)

    report = audit(gradients, model)
    assert [(t.kind, t.what) for t in report.select("d2h")] == [("gradient", "model.first.weight")]


def test_jax_gives_a_fetch_and_its_transpose_one_traceback():
    """What the audit pairs a gradient with its leaf by: an equation traced into a body
    first (a scan's, a remat region's) keeps its traceback object on every equation JAX
    derives from it, its transpose included."""

    def loss(w):
        def body(c, layer):
            return c * jax.device_put(layer, DEVICE), None

        return jnp.sum(jax.lax.scan(body, jnp.ones(4), w)[0])

    host = jax.device_put(jnp.ones((3, 4)), HOST)
    found = []

    def collect(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "device_put":
                found.append(eqn.source_info.traceback)
            for sub in jex.core.jaxprs_in_params(eqn.params):
                collect(getattr(sub, "jaxpr", sub))

    collect(jax.make_jaxpr(jax.grad(loss))(host).jaxpr)
    assert len(found) == 2 and found[0] is not None and found[0] is found[1]


def test_the_audit_guide_describes_every_row_it_can_print():
    """Every kind a row can have has a row of the guide's table of kinds, and every
    direction and phase is named there: a row of a kind the guide does not list
    (`device-to-host input model.w`, the host update's weight decay reading a
    device-resident weight) leaves a reader guessing what it costs."""
    from typing import get_args

    from offload_eqx._inspect.transfer_report import KINDS, Direction, Phase

    guide = (pathlib.Path(__file__).parents[1] / "docs" / "guides" / "audit.md").read_text()
    missing = [f"kind {k}" for k in KINDS if f"| `{k}` |" not in guide]
    missing += [f"`{w}`" for w in (*get_args(Direction), *get_args(Phase)) if f"`{w}`" not in guide]
    assert not missing, missing


def test_a_transfer_of_a_kind_the_guide_does_not_list_is_refused():
    with pytest.raises(ValueError, match="kind 'weights'; expected one of 'parameter'"):
        ox.Transfer("device-to-host", "weights", "model.w", (2,), "float32", 1, 8, "update", "")
