"""Placement per layer and per leaf (issue 19, item 1): a name's policy in the first `k`
layers of a scan and another in the rest, and parameters or optimizer state placed leaf
by leaf, give the gradients and updates of the unsplit program bit for bit on the CPU."""

import pathlib
import sys

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import loss_fn, make_optimizer, make_step, rotated, scanned_model

import offload_eqx as ox

BENCHMARKS = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
try:
    import layer_split  # pyright: ignore[reportMissingImports]
finally:
    sys.path.remove(str(BENCHMARKS))

X = jax.random.normal(jax.random.key(1), (8, 16))


def _run(strategy, steps=2):
    """Gradients of the first step, and the parameters and optimizer state after
    `steps` full training steps, as numpy arrays."""
    opt = make_optimizer()
    model = ox.place(scanned_model(jax.random.key(0), depth=6), strategy)
    opt_state = ox.place(opt.init(model), strategy)
    grads = ox.filter_jit(eqx.filter_grad(loss_fn), strategy=strategy)(model, X)
    step = make_step(opt, strategy, donate="all")
    for _ in range(steps):
        model, opt_state, _ = step(model, opt_state, X)
    return [np.asarray(x) for x in jax.tree.leaves((grads, model, opt_state))]


def _with(preset: str, **changes) -> ox.Strategy:
    base = ox.STRATEGIES[preset]
    fields = dict(
        params=base.params,
        optimizer=base.optimizer,
        activations=base.activations,
        names=dict(base.names),
    )
    return ox.Strategy(f"{preset}+", **(fields | changes))


SPLITS = [("save", 2, "offload"), ("offload", 4, "remat"), ("remat", 1, "save")]


# Each split under "annotated", "hybrid" and one other strategy in turn (all with `--full`).
@pytest.mark.parametrize(
    "split, preset",
    rotated(
        SPLITS, list(ox.STRATEGIES), ("annotated", "hybrid"), lambda s: f"split{SPLITS.index(s)}"
    ),
)
def test_a_name_split_by_layers_equals_the_unsplit_program_bitwise(split, preset):
    """The scan runs as segments, each with its own remat policy: the arithmetic is the
    same, so the results are the same bits."""
    first, _, rest = split
    try:
        _run(_with(preset, names={"x": first}), steps=1)
        theirs = _run(_with(preset, names={"x": rest}))
    except ox.ContractError:  # offloading the carry where nothing is rematerialised
        with pytest.raises(ox.ContractError, match="is the carry of `ox.scan`"):
            _run(_with(preset, names={"x": split}))
        return
    ours = _run(_with(preset, names={"x": split}))
    for a, b in zip(ours, theirs, strict=True):
        np.testing.assert_array_equal(a, b)


def test_a_split_offloads_only_in_its_layers():
    step = ox.filter_jit(
        eqx.filter_value_and_grad(loss_fn),
        strategy=_with("remat", names={"x": ("save", 2, "offload")}),
    )
    model = ox.place(scanned_model(jax.random.key(0), depth=6), "remat")
    report = ox.audit(step, model, X)
    (offloaded,) = report.select("device-to-host", "x", kind="activation")
    assert offloaded.count == 4  # layers 2 to 5 of 6
    unsplit = ox.filter_jit(
        eqx.filter_value_and_grad(loss_fn), strategy=_with("remat", names={"x": "offload"})
    )
    (all_layers,) = ox.audit(unsplit, model, X).select("device-to-host", "x", kind="activation")
    assert all_layers.count == 6


@pytest.mark.parametrize("preset", ["annotated", "hybrid", "remat"])
def test_leaves_placed_one_by_one_equal_every_leaf_placed_alike(preset):
    leafwise = _with(
        preset,
        params={"*.w1": "pinned_host", "*": "device"},
        optimizer={"*.w2": "pinned_host", "*": "device"},
    )
    model = scanned_model(jax.random.key(0))
    plan = ox.plan((model, make_optimizer().init(eqx.filter(model, eqx.is_array))), leafwise)
    memories = {leaf.path: leaf.memory for leaf in plan.leaves}
    assert memories["tree[0].layers.w1"] == "pinned_host"
    assert memories["tree[0].layers.w2"] == "device"
    assert memories["tree[1].inner[1][0].mu.layers.w1"] == "device"
    assert memories["tree[1].inner[1][0].mu.layers.w2"] == "pinned_host"
    for a, b in zip(_run(leafwise), _run(preset), strict=True):
        np.testing.assert_array_equal(a, b)


def test_leaf_patterns_place_a_streamed_state_by_the_parameter_it_mirrors():
    """A streamed state's paths do not end with its parameter's
    (`inner.leaves.layers.w2[0].mu`): the pattern `*.w2` still selects it, through the
    parameter it mirrors, and the streamed update gives the same bits."""
    opt = ox.offload_optimizer(optax.adam(1e-2), stream="layer", layers=6)
    leafwise = _with("remat", optimizer={"*.w2": "pinned_host", "*": "device"})

    def run(strategy):
        model = ox.place(scanned_model(jax.random.key(0), depth=6), strategy)
        opt_state = ox.place(opt.init(model), strategy)

        @ox.filter_jit(strategy=strategy, donate="all")
        def step(model, opt_state, x):
            grads = eqx.filter_grad(loss_fn)(model, x)
            return ox.update_and_apply(opt, grads, opt_state, model)

        plan = step.plan(model, opt_state, X)
        for _ in range(2):
            model, opt_state = step(model, opt_state, X)
        return plan, [np.asarray(x) for x in jax.tree.leaves((model, opt_state))]

    plan, ours = run(leafwise)
    memories = {leaf.path: leaf.memory for leaf in plan.leaves if leaf.role == "optimizer"}
    on_host = sorted(path for path, memory in memories.items() if memory == "pinned_host")
    assert on_host and all(".w2[" in path for path in on_host), memories
    assert any(".w1[" in path for path, memory in memories.items() if memory == "device")
    _, theirs = run(_with("remat"))
    for a, b in zip(ours, theirs, strict=True):
        np.testing.assert_array_equal(a, b)


def test_a_strategy_and_its_plan_print_readably():
    strategy = ox.Strategy(
        "mine",
        params={"*.w1": "pinned_host"},
        activations="remat",
        names={"x": ("save", 2, "offload")},
    )
    assert strategy.describe() == (
        "mine (activations=remat; params=*.w1: pinned_host; optimizer=annotated; "
        "names=x=save[:2]+offload)"
    )
    assert dict(strategy.names)["x"] == ox.LayerSplit("save", 2, "offload")
    printed = str(ox.plan(scanned_model(jax.random.key(0)), strategy))
    assert "strategy: mine (activations=remat; params=*.w1: pinned_host" in printed
    assert "activations: x=save[:2]+offload" in printed


@pytest.mark.parametrize(
    "names, message",
    [
        (
            {"x": ("save", -1, "offload")},
            r"a policy split by layers is `\(policy in the first layers",
        ),
        ({"x": ("save", 2)}, r"a policy split by layers"),
        ({"x": ("keep", 2, "offload")}, r"the policy 'keep'; expected one of 'save', 'offload'"),
    ],
)
def test_a_bad_split_is_refused_when_the_strategy_is_made(names, message):
    with pytest.raises(ValueError, match=message):
        ox.Strategy("bad", names=names)


def test_a_bad_leaf_memory_is_refused_when_the_strategy_is_made():
    with pytest.raises(
        ValueError, match=r"params=\{'\*.w1': 'gpu'\}.*or a mapping of leaf-path patterns"
    ):
        ox.Strategy("bad", params={"*.w1": "gpu"})


def test_a_split_beyond_the_layers_is_the_first_policy_everywhere():
    """`k` at or past the scan's length: one segment, the first policy."""
    plan = ox.plan(
        scanned_model(jax.random.key(0), depth=3),
        _with("remat", names={"x": ("save", 8, "offload")}),
    )
    assert len(plan.segments(3)) == 1
    ours = _run(_with("remat", names={"x": ("save", 8, "offload")}))
    for a, b in zip(ours, _run(_with("remat", names={"x": "save"})), strict=True):
        np.testing.assert_array_equal(a, b)


class _ContextLayer(eqx.Module):
    w: jax.Array
    steps: jax.Array  # an integer leaf of the stack

    def __call__(self, carry, context):
        x, count = carry
        h = ox.name(jnp.tanh(x @ self.w + context), "h")
        return x + h, count + self.steps


class _ContextModel(eqx.Module):
    layers: _ContextLayer
    activations: ox.Activations = ox.activations(h="save")

    def __call__(self, x, context):
        return ox.scan(self.layers, (x, jnp.int32(0)), context)


def _context_loss(model, x, context):
    y, count = model(x, context)
    return jnp.sum(y**2) + count.astype(jnp.float32)


@pytest.mark.parametrize("split", [("save", 2, "remat"), ("remat", 3, "offload")])
def test_a_split_scan_differentiates_its_arguments_and_integer_leaves_as_jax_does(split):
    """What every layer reads (an argument, here differentiated too) gets the sum of the
    layers' gradients; an integer leaf of the stack or of the carry gets none; the
    gradients are those of `jax.lax.scan` over the same layers, bit for bit."""
    depth, width = 5, 16
    w = jax.random.normal(jax.random.key(0), (depth, width, width)) / 4
    model = _ContextModel(_ContextLayer(w, jnp.arange(depth, dtype=jnp.int32)))
    context = jax.random.normal(jax.random.key(2), (width,))
    strategy = _with("remat", names={"h": split})
    grads = ox.filter_jit(eqx.filter_grad(_context_loss), strategy=strategy)
    ours = grads(model, X, context)
    by_argument = ox.filter_jit(
        jax.grad(lambda c, m, x: _context_loss(m, x, c)), strategy=strategy
    )(context, model, X)

    def plain(model, x, context):
        def step(carry, layer):
            return eqx.combine(layer, static)(carry, context), None

        dynamic, static = eqx.partition(model.layers, eqx.is_array)
        y, count = jax.lax.scan(step, (x, jnp.int32(0)), dynamic)[0]
        return jnp.sum(y**2) + count.astype(jnp.float32)

    theirs = jax.jit(jax.grad(plain, argnums=(0, 2), allow_int=True))(model, X, context)
    np.testing.assert_array_equal(ours.layers.w, theirs[0].layers.w)
    np.testing.assert_array_equal(by_argument, theirs[1])
    assert ours.layers.steps is None


@pytest.mark.deviceless
def test_fit_between_uniform_plans_is_as_fast_as_they_are_and_splits_lie_between():
    """The README's layer (4 layers, width 256), deviceless h100, a device budget halfway
    between saving `h` everywhere and recomputing it everywhere: `ox.fit`'s plan is as
    fast (compiled schedule) as every uniform plan that fits, and a split needs about
    the device memory between the uniform plans (never more than saving everywhere),
    growing with the layers that save: the segments' gradients of the stacked weights are written into one stacked gradient,
    never concatenated (issue 67; they were, and every split then needed more than
    saving everywhere). Saving `h` here recomputes as much as recomputing it (tanh's
    derivative reads tanh's own output, not the name), so the jaxpr count ranks no split
    ahead and `ox.fit` compiles none; `tests/test_fit_per_layer.py` has a model where a
    split pays."""
    pytest.importorskip("jax_plugins.xla_cuda12", reason="needs the 'cuda' extra")
    rows = layer_split.rows_of("README layer", layer_split.readme_problem(256, 1024, 4, 256))
    *plans, fitted = rows
    save, remat = plans[0]["device MiB"], plans[1]["device MiB"]
    budget = fitted["budget MiB"]
    uniform = plans[:2]
    fitting = [row for row in uniform if row["device MiB"] <= budget]
    assert fitting and fitted["device MiB"] <= budget
    assert fitted["sim ms"] <= min(row["sim ms"] for row in fitting) * 1.005
    splits = [row["device MiB"] for row in plans if row["plan"].startswith("save in the first")]
    # At most what saving everywhere needs (the last split, within its index arrays). The
    # first may need less than recomputing everywhere (1 MiB of `h` a layer: XLA's buffer
    # assignment moves totals by as much; 38.5 against 39.5 MiB on jax 0.12.0.1).
    assert len(splits) == 3 and remat - 1.5 < splits[0] < splits[1] < splits[2] <= save + 0.01


@pytest.mark.deviceless
def test_a_split_scan_compiles_one_stacked_gradient_and_no_concatenation():
    """The compiled h100 program of a split scan's step holds no concatenation of whole
    stacks (the stacked gradients are written in place, layer by layer)."""
    pytest.importorskip("jax_plugins.xla_cuda12", reason="needs the 'cuda' extra")
    from offload_eqx._inspect.memory_report import compiled_report
    from offload_eqx._targets.deviceless import program_of_step
    from offload_eqx._targets.targets import get_target

    make, args, _, layers = layer_split.readme_problem(256, 1024, 4, 256)
    split = ox.Strategy(
        "split", params="device", optimizer="device", activations="remat",
        names={"h": ("save", 2, "remat")},
    )  # fmt: skip
    program = program_of_step(make(split), args, {})
    _, compiled = compiled_report(program, get_target("h100"), "split")
    text = compiled.as_text() or ""
    stacks = [f"f32[{layers},256,1024]", f"f32[{layers},1024,256]"]
    concatenated = [
        line
        for line in text.splitlines()
        if " concatenate(" in line and any(s in line for s in stacks)
    ]
    assert not concatenated, concatenated[:2]
