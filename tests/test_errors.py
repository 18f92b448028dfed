"""Bad input gets a clear error naming the path, the value, the allowed values and the fix;
the user's model and optimizer state stay usable afterwards."""

import subprocess
import sys

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import Layer, ScannedModel, make_optimizer, make_step, scanned_model

import offload_eqx as ox
from offload_eqx._base.options import checks_options


def test_unknown_memory():
    with pytest.raises(ValueError, match=r"memory 'gpu'; expected one of 'device', 'pinned_host'"):
        ox.field(memory="gpu")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"'hbm'.*'device', 'pinned_host'"):
        ox.annotate(scanned_model(jax.random.key(0)), lambda m: m.layers, memory="hbm")  # type: ignore[arg-type]


def test_unknown_policy():
    with pytest.raises(
        ValueError,
        match=r"activation 'x' the policy 'keep'; expected one of 'save', 'offload', 'remat'",
    ):
        ox.activations(x="keep")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"'q' the policy 'host'"):
        ox.annotate(scanned_model(jax.random.key(0)), lambda m: m, activations={"q": "host"})  # type: ignore[dict-item]


def test_unknown_strategy_and_donate():
    with pytest.raises(
        ValueError, match=r"Unknown strategy 'fast'; expected one of 'annotated', 'baseline'"
    ):
        ox.filter_jit(lambda m: m, strategy="fast")
    with pytest.raises(ValueError, match=r"donate='some'\): expected one of 'all'"):
        ox.filter_jit(lambda m: m, donate="some")  # type: ignore[arg-type]


def test_memory_on_a_static_field():
    with pytest.raises(
        ValueError, match=r"static=True.*cannot be placed in memory.*Drop `static=True`"
    ):
        ox.field(memory="pinned_host", static=True)


def test_memory_on_a_non_array_field():
    class Scaled(eqx.Module):
        w: jax.Array = ox.field(memory="pinned_host")
        scale: float = ox.field(memory="pinned_host")

    model = Scaled(w=jnp.ones(3), scale=2.0)
    with pytest.raises(
        ValueError,
        match=r"Field `tree.scale` is declared with `ox.field\(memory='pinned_host'\)` but holds 2.0 \(a float\)",
    ):
        ox.place(model)


def test_stacked_module_disagreeing_on_the_layer_axis():
    layers = Layer(w1=jnp.ones((3, 4, 8)), w2=jnp.ones((2, 8, 4)))
    with pytest.raises(
        ValueError,
        match=r"disagree on the length of the layer axis 0: length 2: `stacked.w2`; length 3: `stacked.w1`",
    ):
        ox.scan(layers, jnp.ones((2, 4)))


def test_host_resident_leaf_scanned_over_axis_1():
    model = ox.place(scanned_model(jax.random.key(0)))

    with pytest.raises(
        ValueError, match=r"axis=1\): `stacked.w1` is host-resident.*only be scanned over axis 0"
    ):
        ox.scan(model.layers, jnp.ones((8, 16)), axis=1)


class Named(eqx.Module):
    w: jax.Array = ox.field(memory="device")
    activations: ox.Activations = ox.activations(x="offload", y="offload")

    def __call__(self, x):
        return ox.name(x, "x") @ self.w


def test_declared_name_never_produced():
    model = Named(w=jnp.ones((4, 4)))

    @ox.filter_jit
    def loss(model, x):
        return jnp.sum(ox.checkpoint(model, x))

    with pytest.raises(
        ValueError,
        match=r"Activation 'y' is declared 'offload' by `model`, but the program never produces it \(names produced: \['x'\]\).*Fix the spelling",
    ):
        loss(model, jnp.ones((2, 4)))


def test_declared_name_produced_outside_regions():
    model = Named(w=jnp.ones((4, 4)))

    @ox.filter_jit
    def loss(model, x):
        return jnp.sum(ox.name(x, "y")) + jnp.sum(model(x))

    with pytest.raises(
        ValueError,
        match=r"Activation 'x' \(declared 'offload' by `model`\) is only produced outside",
    ):
        loss(model, jnp.ones((2, 4)))


def test_same_name_two_policies():
    class Saver(eqx.Module):
        w: jax.Array
        activations: ox.Activations = ox.activations(x="save")

    class Both(eqx.Module):
        a: Named
        b: Saver

    model = Both(a=Named(w=jnp.ones((4, 4))), b=Saver(w=jnp.ones(4)))
    with pytest.raises(
        ValueError,
        match=r"Activation 'x' is given two policies: 'offload' by `tree.a` and 'save' by `tree.b`",
    ):
        ox.plan(model)


def test_strategy_that_would_offload_nothing():
    class Plain(eqx.Module):
        w: jax.Array

        def __call__(self, x):
            return x @ self.w

    @ox.filter_jit(strategy="offload_params")
    def loss(model, x):
        return jnp.sum(ox.checkpoint(model, x))

    with pytest.raises(
        ValueError, match=r"'offload_params' offloads parameters, but no array leaf is declared"
    ):
        loss(Plain(w=jnp.ones((4, 4))), jnp.ones((2, 4)))

    @ox.filter_jit(strategy="offload_activations")
    def loss2(model, x):
        return jnp.sum(ox.checkpoint(model, x))

    with pytest.raises(
        ValueError, match=r"'offload_activations' offloads activations, but no module declares"
    ):
        loss2(Plain(w=jnp.ones((4, 4))), jnp.ones((2, 4)))


def test_host_resident_leaf_outside_any_region_and_state_stays_usable():
    class Unregioned(eqx.Module):
        layers: Layer
        activations: ox.Activations = ox.activations(x="offload")

        def __call__(self, x):
            # Wrong: uses a host-resident stack directly instead of through ox.scan.
            return x @ self.layers.w1[0]

    good = ox.place(scanned_model(jax.random.key(0)))
    bad = Unregioned(layers=good.layers)
    opt = make_optimizer()
    opt_state = opt.init(good)
    step = make_step(opt, None, donate="all")
    x = jnp.ones((8, 16))
    with pytest.raises(
        ValueError,
        match=r"ox.filter_jit\(step\): `model.layers.w1` is host-resident \(pinned_host\).*used outside any `ox.scan`/`ox.checkpoint` region",
    ):
        step(bad, opt_state, x)
    # Nothing was donated or deleted: the same model and state still train.
    for leaf in jax.tree_util.tree_leaves((good, opt_state)):
        assert not leaf.is_deleted()
    model, opt_state, loss = step(good, opt_state, x)
    assert np.isfinite(float(loss))
    assert model.layers.w1.sharding.memory_kind == "pinned_host"


def test_mistyped_host_argument_is_compiled_by_its_plan():
    """An array in pinned_host whose type says device (made by a jit's out_shardings):
    `ox.filter_jit` traces on the planned type, not the array's, so the first and every
    later call compile and compute as for a correctly typed array (an earlier version
    refused it on the first call only)."""
    host = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host")
    w1 = jax.jit(lambda: jnp.ones((2, 4, 8)), out_shardings=host)()
    assert jax.typeof(w1).memory_space != jax.memory.Space.Host  # the trap itself
    w2 = jax.device_put(jnp.ones((2, 8, 4)), host)
    model = ScannedModel(layers=Layer(w1=w1, w2=w2))

    @ox.filter_jit
    def forward(model, x):
        return model(x)

    x = jnp.ones((3, 4))
    expected = forward(ox.place(model), x)
    assert jnp.array_equal(forward(model, x), expected)
    assert jnp.array_equal(forward(model, x), expected)  # a cached call too
    assert forward.plan(model, x).leaves[0].memory == "pinned_host"


def test_wrong_optimizer_state():
    opt = make_optimizer()
    model = ox.place(scanned_model(jax.random.key(0)))
    with pytest.raises(
        TypeError,
        match=r"the optimizer state is a builtins.tuple, not the state returned by this optimizer.s `init`",
    ):
        opt.update(model, (), model)


def test_annotate_needs_something_and_a_whole_field():
    model = scanned_model(jax.random.key(0))
    with pytest.raises(
        ValueError, match=r"none of `memory=`, `activations=`, `inputs=` or `outputs=`"
    ):
        ox.annotate(model, lambda m: m.layers)
    stacked = {"a": jnp.ones(3)}
    with pytest.raises(ValueError, match=r"not a field of a module"):
        ox.annotate(stacked, lambda t: t["a"], memory="pinned_host")


def test_scan_errors_name_the_argument_path_inside_filter_jit():
    model = ox.place(scanned_model(jax.random.key(0)))

    @ox.filter_jit
    def forward(model, x):
        return ox.scan(model.layers, x, axis=1)

    with pytest.raises(ValueError, match=r"axis=1\): `model.layers.w1` is host-resident"):
        forward(model, jnp.ones((8, 16)))


# -- the bad-input table (issue 10, item 10 and what was found beside it) ---------------
# Each case runs against a donated step's arguments and must fail before any work with a
# message naming the path or value and the fix; the model and optimizer state it was
# given must be intact afterwards (not donated, equal to before).


def _case_zero_d_scan(model, opt_state):
    class Scalars(eqx.Module):
        w: jax.Array

        def __call__(self, x):
            return x * self.w

    ox.filter_jit(lambda m, x: ox.scan(m, x), donate="all")(Scalars(jnp.float32(2.0)), model)


def _case_field_on_floats(model, opt_state):
    class Floats(eqx.Module):
        values: list = ox.field(memory="pinned_host")

    ox.plan(Floats([1.0, 2.0]))


def _case_duplicate_axis(model, opt_state):
    mesh = jax.make_mesh((1, 1), ("fsdp", "data"), devices=jax.devices()[:1])
    ox.shard(jnp.ones((2, 2)), jax.sharding.PartitionSpec("fsdp", "fsdp"), mesh)


def _case_scan_axis_string(model, opt_state):
    ox.scan(model.layers, jnp.ones((3, 16)), axis="0")  # type: ignore[arg-type]


def _case_checkpoint_array(model, opt_state):
    ox.checkpoint(jnp.ones(3), jnp.ones(3))  # type: ignore[arg-type]


def _case_shard_memory(model, opt_state):
    mesh = jax.make_mesh((1,), ("data",), devices=jax.devices()[:1])
    ox.shard(jnp.ones(2), jax.sharding.PartitionSpec("data"), mesh, memory="gpu")


def _case_shard_list(model, opt_state):
    mesh = jax.make_mesh((1,), ("data",), devices=jax.devices()[:1])
    ox.shard([1.0, 2.0], jax.sharding.PartitionSpec("data"), mesh)


def _case_audit_string(model, opt_state):
    ox.filter_jit(lambda m: m, audit="no")  # type: ignore[arg-type]


def _case_empty_name(model, opt_state):
    ox.activations(**{"": "save"})


def _case_factory(model, opt_state):
    ox.offload_optimizer(optax_adam_factory())


def _case_state_of_another_model(model, opt_state):
    other = ox.place(scanned_model(jax.random.key(1), width=8, hidden=8))
    step = make_step(make_optimizer(), "annotated", donate="all")
    step(other, opt_state, jnp.ones((3, 8)))


def _case_not_callable(model, opt_state):
    ox.filter_jit(model.layers.w1)


# The planners check their options before any work (issue 17, item 8): a step that fails when traced and a
# `make_args` that fails when called prove that nothing was traced or compiled.


def _never_traced(model, opt_state, x):
    raise AssertionError("the step was traced before the planner checked its options")


def _never_called(batch):
    raise AssertionError("make_args was called before the planner checked its options")


def _fit(model, opt_state, **options):
    step = ox.filter_jit(_never_traced, donate="all")
    ox.fit(step, model, opt_state, jnp.ones((3, 16)), target="h100", **options)


def _case_fit_negative_device_budget(model, opt_state):
    _fit(model, opt_state, device_budget=-1)


def _case_fit_zero_device_budget(model, opt_state):
    _fit(model, opt_state, device_budget=0)


def _case_fit_bool_device_budget(model, opt_state):
    _fit(model, opt_state, device_budget=True)


def _case_fit_float_device_budget(model, opt_state):
    _fit(model, opt_state, device_budget=80.0)


def _case_fit_large_float_device_budget(model, opt_state):
    _fit(model, opt_state, device_budget=80e9)


def _case_fit_string_device_budget(model, opt_state):
    _fit(model, opt_state, device_budget="80GB")


def _case_fit_negative_host_budget(model, opt_state):
    _fit(model, opt_state, host_budget=-5)


def _case_fit_zero_max_compiles(model, opt_state):
    _fit(model, opt_state, max_compiles=0)


def _case_max_batch_float_device_budget(model, opt_state):
    step = ox.filter_jit(_never_traced)
    ox.max_batch(step, _never_called, target="h100", device_budget=8e9)  # type: ignore[arg-type]


def _case_max_batch_string_device_budget(model, opt_state):
    step = ox.filter_jit(_never_traced)
    ox.max_batch(step, _never_called, target="h100", device_budget="8GiB")  # type: ignore[arg-type]


def _case_estimate_string_compile(model, opt_state):
    step = ox.filter_jit(_never_traced, donate="all")
    ox.estimate(step, model, opt_state, jnp.ones((3, 16)), target="h100", compile="no")  # type: ignore[arg-type]


def _case_donated_model_reused(model, opt_state):
    # Issue 17, item 7: the second call passes inputs the first one donated (copies, so
    # that the table's own model survives).
    copies = jax.tree.map(jnp.copy, (model, opt_state))
    step = make_step(make_optimizer(), "annotated", donate="all")
    step(*copies, jnp.ones((3, 16)))
    step(*copies, jnp.ones((3, 16)))


def _case_donated_model_reused_by_a_compiled_step(model, opt_state):
    # Issue 37, item 11: the compiled step names the consumed leaves as the step does.
    copies = jax.tree.map(jnp.copy, (model, opt_state))
    compiled = _ahead_of_time(*copies)
    compiled(*copies, jnp.ones((3, 16)))
    compiled(*copies, jnp.ones((3, 16)))


def _case_updates_of_another_model(model, opt_state):
    ox.apply_updates(model, scanned_model(jax.random.key(1), width=8, hidden=8))


# Issue 26, items 7-10: strategies, targets and planners given odd input.


def _case_strategy_pattern_matching_nothing(model, opt_state):
    strategy = ox.Strategy("typo", params={"*.w_1": "pinned_host"})
    step = make_step(make_optimizer(), strategy, donate="all")
    step(model, opt_state, jnp.ones((3, 16)))


def _case_target_unknown_platform(model, opt_state):
    ox.Target("my-gpu", "gpu")  # type: ignore[arg-type]


def _case_target_gpu_topology(model, opt_state):
    ox.Target("my-gpu", "cuda", "8", "h100.txtpb")


def _case_target_negative_capacity(model, opt_state):
    ox.Target("small", "cpu", capacity=-5)


def _case_speeds_zero_flops(model, opt_state):
    ox.Speeds(0.0, 0.5, 1e12, 1e10, 1e10, 1e12, 1e11, 2**40)


def _case_speeds_efficiency_above_one(model, opt_state):
    ox.Speeds(1e15, 50.0, 1e12, 1e10, 1e10, 1e12, 1e11, 2**40)


def _case_layer_split_float_count(model, opt_state):
    ox.Strategy("split", names={"h": ("save", 2.5, "offload")})


def _case_host_update_estimated_for_a_tpu(model, opt_state):
    opt = ox.offload_optimizer(optax.adam(1e-3), update_on="host")
    step = make_step(opt, "annotated", donate="all")
    ox.estimate(step, model, opt.init(model), jnp.ones((3, 16)), target="tpu-v5p", compile=False)


# Issue 37, item 12: a step compiled ahead of time holds no plan to trace.


def _ahead_of_time(model, opt_state, compile=True):
    step = make_step(make_optimizer(), "annotated", donate="all")
    lowered = step.lower(model, opt_state, jnp.ones((3, 16)))
    return lowered.compile() if compile else lowered


def _case_estimate_of_a_compiled_step(model, opt_state):
    compiled = _ahead_of_time(model, opt_state)
    ox.estimate(compiled, model, opt_state, jnp.ones((3, 16)), target="cpu", compile=False)


def _case_audit_of_a_compiled_step(model, opt_state):
    ox.audit(_ahead_of_time(model, opt_state), model, opt_state, jnp.ones((3, 16)))


def _case_memory_report_of_a_compiled_step(model, opt_state):
    compiled = _ahead_of_time(model, opt_state)
    ox.memory_report(compiled, model, opt_state, jnp.ones((3, 16)))


def _case_filter_jit_of_a_lowered_step(model, opt_state):
    ox.filter_jit(_ahead_of_time(model, opt_state, compile=False))


def _case_fit_of_a_compiled_step(model, opt_state):
    compiled = _ahead_of_time(model, opt_state)
    ox.fit(compiled, model, opt_state, jnp.ones((3, 16)), target="h100")


def _case_max_batch_of_a_compiled_step(model, opt_state):
    compiled = _ahead_of_time(model, opt_state)
    ox.max_batch(compiled, _never_called, target="h100")


def _case_compare_memory_targets_by_label(model, opt_state):
    ox.compare_memory({}, target={"gpu": "h100"})


# Issue 37, item 10: keys declared in host memory, abstract arguments to a real call, an
# argument whose type names another memory than its sharding.


class _Dropout(eqx.Module):
    w: jax.Array = ox.field(memory="pinned_host")
    key: jax.Array = ox.field(memory="pinned_host")


def _dropout_step(model, x):
    keep, key = jax.random.split(model.key)
    kept = jnp.where(jax.random.bernoulli(keep, 0.5, x.shape), x, 0.0)
    return jnp.sum(kept * jnp.sum(ox.fetch(model.w))), eqx.tree_at(lambda m: m.key, model, key)


def _case_key_declared_in_host_memory(model, opt_state):
    dropout = _Dropout(jnp.ones(3), jax.random.key(0))
    ox.filter_jit(_dropout_step, donate="all")(dropout, jnp.ones(4))


def _case_abstract_model_in_a_real_call(model, opt_state):
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), model)
    make_step(make_optimizer(), "annotated", donate="all")(abstract, opt_state, jnp.ones((3, 16)))


def _case_abstract_batch_in_a_real_call(model, opt_state):
    step = make_step(make_optimizer(), "annotated", donate="all")
    copies = jax.tree.map(jnp.copy, (model, opt_state))
    copies = step(*copies, jnp.ones((3, 16)))[:2]  # compiled and cached for arrays
    step(*copies, jax.ShapeDtypeStruct((3, 16), jnp.float32))


def test_a_host_array_typed_as_device_memory_is_retyped_and_trains():
    """An array in pinned_host whose type says device (a jit's `out_shardings`, or Orbax
    restoring into single-device shardings): the step retypes it where it lies, without
    a copy, and computes what it computes for a correctly typed one (it raised an empty
    `Misplaced`, then an error naming the leaf)."""
    model = ox.place(scanned_model(jax.random.key(0)))
    host = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host")
    w = jax.jit(lambda w: w * 1, out_shardings=host)(jnp.ones(3))
    assert jax.typeof(w).memory_space != jax.memory.Space.Host  # the trap itself
    step = ox.filter_jit(lambda m, x: jnp.sum(ox.fetch(m.layers.w1)) * x, donate="all")
    typed = jax.device_put(jnp.ones(3), host)
    expected = step(eqx.tree_at(lambda m: m.layers.w1, model, typed), jnp.ones(2))
    got = step(eqx.tree_at(lambda m: m.layers.w1, model, w), jnp.ones(2))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(expected))


def optax_adam_factory():
    import optax

    return optax.adam  # the factory, not a transformation


BAD_INPUTS = [
    (_case_zero_d_scan, ValueError, r"`m.w` \(shape \(\)\).*eqx.filter_vmap"),
    (_case_field_on_floats, ValueError, r"`tree.values`.*\[1.0, 2.0\].*only arrays have a memory"),
    (_case_duplicate_axis, ValueError, r"uses the mesh axis 'fsdp' twice.*at most once"),
    (_case_scan_axis_string, TypeError, r"axis='0'.*non-negative int"),
    (_case_checkpoint_array, TypeError, r"ox.checkpoint was given .* not callable.*\(block, x\)"),
    (_case_shard_memory, ValueError, r"ox.shard\(memory=...\) has memory 'gpu'; expected one of"),
    (_case_shard_list, TypeError, r"`x\[0\]` is 1.0 \(a float\), not an array.*jnp.asarray"),
    (_case_audit_string, TypeError, r"audit='no'.*expected True or False"),
    (_case_empty_name, ValueError, r"activation name ''.*non-empty string"),
    (_case_factory, TypeError, r"optax.adam\(1e-3\)"),
    (
        _case_state_of_another_model,
        ValueError,
        r"state.inner\[1\]\[0\].mu.layers.w1` has shape.*opt.init\(model\)",
    ),
    (_case_not_callable, TypeError, r"not callable.*Pass the function"),
    (
        _case_donated_model_reused,
        ValueError,
        r"ox.filter_jit\(step\): `model.layers.w1`, .* donated to an earlier call "
        r"\(donate='all'\).*Pass the step's outputs, not the donated inputs",
    ),
    (
        _case_donated_model_reused_by_a_compiled_step,
        ValueError,
        r"ox.filter_jit\(step\): `model.layers.w1`, .* donated to an earlier call "
        r"\(donate='all'\).*Pass the step's outputs, not the donated inputs",
    ),
    (
        _case_updates_of_another_model,
        ValueError,
        r"`updates.layers.w1` has shape \(3, 8, 8\) but `model.layers.w1` has shape "
        r"\(3, 16, 32\), so the updates were made for another model",
    ),
    (
        _case_fit_negative_device_budget,
        ValueError,
        r"ox.fit\(device_budget=-1\): expected a positive number of bytes \(1 or more\).*"
        r"`device_budget=80 \* 2\*\*30` for 80 GiB, or None for the target's device memory",
    ),
    (_case_fit_zero_device_budget, ValueError, r"device_budget=0\): expected a positive number"),
    (_case_fit_bool_device_budget, TypeError, r"device_budget=True\): expected an int .*a bool"),
    (
        _case_fit_float_device_budget,
        TypeError,
        r"device_budget=80.0\): expected an int number of bytes, got a float. As bytes it is "
        r"80 B: pass `device_budget=80`; for 80 GiB, pass `device_budget=80 \* 2\*\*30`",
    ),
    (
        _case_fit_large_float_device_budget,
        TypeError,
        r"device_budget=80000000000.0\).*74.51 GiB: pass `device_budget=80_000_000_000`",
    ),
    (
        _case_fit_string_device_budget,
        TypeError,
        r"device_budget='80GB'\).*strings are not parsed. '80GB' reads as 80 GB, "
        r"80_000_000_000 bytes \(74.51 GiB\): pass `device_budget=80 \* 10\*\*9`, or "
        r"`device_budget=80 \* 2\*\*30` for 80 GiB",
    ),
    (
        _case_fit_negative_host_budget,
        ValueError,
        r"ox.fit\(host_budget=-5\): expected 0 or more bytes \(0: nothing in host memory\)",
    ),
    (
        _case_fit_zero_max_compiles,
        ValueError,
        r"ox.fit\(max_compiles=0\): expected a positive int \(1 or more\)",
    ),
    (
        _case_max_batch_float_device_budget,
        TypeError,
        r"ox.max_batch\(device_budget=8000000000.0\).*pass `device_budget=8_000_000_000`",
    ),
    (
        _case_max_batch_string_device_budget,
        TypeError,
        r"'8GiB' reads as 8 GiB, 8_589_934_592 bytes: pass `device_budget=8 \* 2\*\*30`",
    ),
    (
        _case_strategy_pattern_matching_nothing,
        ValueError,
        r"Strategy 'typo' has params patterns that match no managed parameter leaf: "
        r"'\*.w_1'.*`model.layers.w1`.*fix the pattern, or drop it",
    ),
    (_case_target_unknown_platform, ValueError, r"unknown platform 'gpu'; expected one of"),
    (_case_target_gpu_topology, ValueError, r"topology '8'.*'1x1x8'"),
    (_case_target_negative_capacity, ValueError, r"capacity=-5; expected the device's memory"),
    (_case_speeds_zero_flops, ValueError, r"ox.Speeds\(flops=0.0\): expected a number > 0"),
    (
        _case_speeds_efficiency_above_one,
        ValueError,
        r"ox.Speeds\(efficiency=50.0\): expected a fraction in \(0, 1\]",
    ),
    (_case_layer_split_float_count, ValueError, r"how many layers \(an integer, 0 or more\)"),
    (
        _case_host_update_estimated_for_a_tpu,
        ValueError,
        r"computes on the host.*target 'tpu-v5p' does not support.*update='device'",
    ),
    *(
        (
            case,
            TypeError,
            rf"{entry} was given `step.lower\(...\){built}` of "
            r"ox.filter_jit\(step\): a program built ahead of time.*Pass the step itself "
            rf"\(the `ox.filter_jit` object\): `{entry}\(step, \*args\)`",
        )
        for case, entry, built in [
            (_case_estimate_of_a_compiled_step, "ox.estimate", r"\.compile\(\)"),
            (_case_audit_of_a_compiled_step, "ox.audit", r"\.compile\(\)"),
            (_case_memory_report_of_a_compiled_step, "ox.memory_report", r"\.compile\(\)"),
            (_case_fit_of_a_compiled_step, "ox.fit", r"\.compile\(\)"),
            (_case_max_batch_of_a_compiled_step, "ox.max_batch", r"\.compile\(\)"),
        ]
    ),  # fmt: skip
    (
        _case_filter_jit_of_a_lowered_step,
        TypeError,
        r"ox.filter_jit was given `step.lower\(...\)` of ox.filter_jit\(step\).*Pass the step "
        r"itself \(the `ox.filter_jit` object\): `ox.filter_jit\(f\)`, `f` the function lowered",
    ),
    (
        _case_key_declared_in_host_memory,
        ValueError,
        r"`model.key` is a PRNG key array \(dtype key<fry>\) declared `memory='pinned_host'`, "
        r"but JAX cannot keep a typed key in host memory.*Declare it `memory='device'`",
    ),
    *(
        (
            case,
            TypeError,
            rf"ox.filter_jit\(step\): {paths} `jax.ShapeDtypeStruct`.*a call "
            r"runs the step on arrays. Pass arrays.*`step.lower\(\*args\)`, "
            r"`ox.memory_report\(step, \*args\)`",
        )
        for case, paths in [
            (_case_abstract_model_in_a_real_call, r"`model.layers.w1`, `model.layers.w2` are"),
            (_case_abstract_batch_in_a_real_call, r"`x` is a"),
        ]
    ),  # fmt: skip
    (
        _case_compare_memory_targets_by_label,
        TypeError,
        r"ox.compare_memory\(target=\{'gpu': 'h100'\}\): expected a target name \('cpu', "
        r"'h100'.*got a dict.*not read as labels.*Pass `target=\['h100'\]`",
    ),
    (
        _case_estimate_string_compile,
        TypeError,
        r"ox.estimate\(compile='no'\): expected True or False, got a str",
    ),
]


@pytest.mark.parametrize("integer", [np.int64, np.int32])
def test_numpy_integer_options_are_passed_on_as_ints(integer):
    seen = {}

    @checks_options
    def planner(*, device_budget=None, host_budget=None, max_compiles=12, compile=True):
        seen.update(device_budget=device_budget, host_budget=host_budget, max=max_compiles)

    planner(device_budget=integer(2**30), host_budget=integer(0), max_compiles=integer(3))
    assert seen == {"device_budget": 2**30, "host_budget": 0, "max": 3}
    assert all(type(value) is int for value in seen.values())


@pytest.mark.parametrize(
    "case, error, message", BAD_INPUTS, ids=[c.__name__[len("_case_") :] for c, _, _ in BAD_INPUTS]
)
def test_bad_input_is_refused_before_any_work(case, error, message):
    opt = make_optimizer()
    model = ox.place(scanned_model(jax.random.key(0)))
    opt_state = opt.init(model)
    before = [np.asarray(x) for x in jax.tree.leaves((model, opt_state))]
    with pytest.raises(error, match=message):
        case(model, opt_state)
    after = jax.tree.leaves((model, opt_state))
    assert not any(x.is_deleted() for x in after)
    for x, y in zip(before, after):
        np.testing.assert_array_equal(x, np.asarray(y))


_FRACTIONAL_THREADS = """
import jax.numpy as jnp
import offload_eqx as ox
h100 = ox.TARGETS["h100"].speeds
for make in (
    lambda: ox.Speeds(**{**h100.__dict__, "host_threads": 1.5}),
    lambda: ox.estimate(
        ox.filter_jit(lambda x: x * 2), jnp.ones(4), target="cpu", compile=False
    ).with_speeds(host_threads=1.5),
):
    try:
        make()
    except ValueError as error:
        print(error)
"""


def test_a_fractional_thread_count_is_refused_with_the_fix():
    """Round six: `ox.Speeds(host_threads=1.5)` and `with_speeds(host_threads=1.5)` were
    accepted. In a process of its own: here the tests' runtime type checks refuse the
    float first, which a user's process does not run."""
    done = subprocess.run(
        [sys.executable, "-c", _FRACTIONAL_THREADS], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    messages = done.stdout.strip().splitlines()
    assert len(messages) == 2
    for message in messages:
        assert message.startswith("ox.Speeds(host_threads=1.5): expected a whole number of")
        assert "`ox.calibrate_host` counts them" in message
