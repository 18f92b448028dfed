"""Beyond one device: placements with partition specs on an 8-device CPU mesh and across
two processes give the same losses, gradients and updates as one device.

The 8-device tests need `--xla_force_host_platform_device_count=8` before JAX starts, so
unless it is already set, the first of them runs this whole file once in a child pytest
with the flag (one xdist worker per core), and each test here reports its child's
outcome. The two-process test launches `_multiprocess_worker.py` twice itself.
"""

import functools
import json
import os
import socket
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ElementTree
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _multiprocess_worker import (
    BATCH,
    DATA,
    DEPTH,
    FSDP,
    HIDDEN,
    WIDTH,
    gather,
    loss_fn,
    make_batch,
    make_model,
    make_optimizer,
    make_step,
    train,
)
from helpers import masters_reference, splash_step, to_bf16
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import offload_eqx as ox

shard = ox.shard

pytestmark = pytest.mark.multidevice

HERE = Path(__file__).parent
EIGHT = "--xla_force_host_platform_device_count=8"
IN_CHILD = EIGHT in os.environ.get("XLA_FLAGS", "")
AXIS_TYPES = {"auto": AxisType.Auto, "explicit": AxisType.Explicit}
CHILD_TIMEOUT = 900  # seconds: generous, the 2 cores may be shared with other work
WORKER_TIMEOUT = 120


# -- running the 8-device tests in a child process -------------------------------------


@functools.cache
def _child_outcomes() -> dict[str, tuple[str, str]]:
    env = dict(os.environ, XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} {EIGHT}".strip())
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.xml"
        command = [
            sys.executable,
            "-m",
            "pytest",
            str(Path(__file__)),
            "-m",
            "multidevice",
            "-q",
            "-p",
            "no:cacheprovider",
            # Its tests compile for most of their time, one core each: one worker per core.
            "-n",
            "auto",
            "-k",
            "not two_processes",
            f"--junitxml={report}",
        ]
        try:
            done = subprocess.run(
                command,
                env=env,
                cwd=HERE.parent,
                capture_output=True,
                text=True,
                timeout=CHILD_TIMEOUT,
            )
        except subprocess.TimeoutExpired as e:
            pytest.fail(f"The 8-device child pytest took more than {CHILD_TIMEOUT} s:\n{e.stdout}")
        if not report.exists():
            pytest.fail(f"The 8-device child pytest wrote no report:\n{done.stdout}\n{done.stderr}")
        outcomes = {}
        for case in ElementTree.parse(report).iter("testcase"):
            problems = [c for c in case if c.tag in ("failure", "error", "skipped")]
            if problems:
                outcomes[case.get("name")] = (problems[0].tag, problems[0].text or "")
            else:
                outcomes[case.get("name")] = ("passed", "")
    return outcomes


def on_eight_devices(test):
    """Run the test on 8 CPU devices: here if JAX already has them, else in the child."""

    @functools.wraps(test)
    def wrapper(*args, **kwargs):
        if IN_CHILD:
            assert jax.device_count() == 8
            return test(*args, **kwargs)
        current = os.environ["PYTEST_CURRENT_TEST"].split("::")[-1].rsplit(" ", 1)[0]
        name = current.split("@")[0]  # xdist's loadgroup adds "@eight_devices"
        outcome, text = _child_outcomes().get(name, ("missing", "the child did not run it"))
        if outcome == "skipped":
            pytest.skip(text)
        if outcome != "passed":
            pytest.fail(f"On 8 devices ({outcome}):\n{text}", pytrace=False)

    # Under xdist, one worker asks the child for every 8-device outcome (one child, not
    # one per worker), while another runs the tests that start processes of their own.
    return pytest.mark.xdist_group("eight_devices")(wrapper)


# -- helpers -----------------------------------------------------------------------------


def _mesh(axis_type: str = "auto", shape=(2, 4)):
    return jax.make_mesh(shape, ("data", "fsdp"), axis_types=(AXIS_TYPES[axis_type],) * 2)


def _one_device_mesh():
    return jax.make_mesh((1, 1), ("data", "fsdp"), devices=jax.devices()[:1])


@functools.cache
def _reference():
    """Everything `train` computes on one device, under the all-device baseline."""
    run = train(_one_device_mesh(), "baseline")
    return {key: gather(run[key]) for key in ("grads", "model", "opt_state", "updates")} | {
        "losses": [float(loss) for loss in run["losses"]]
    }


def _assert_close(ours, reference, what):
    pairs = zip(
        jax.tree_util.tree_leaves_with_path(ours), jax.tree_util.tree_leaves_with_path(reference)
    )
    for (path, a), (_, b) in pairs:
        np.testing.assert_allclose(
            a, b, rtol=2e-5, atol=1e-6, err_msg=f"{what}{jax.tree_util.keystr(path)}"
        )


def _specs_and_memories(tree):
    return jax.tree_util.tree_map(
        lambda s: (s.spec, s.memory_kind), tree, is_leaf=lambda x: isinstance(x, NamedSharding)
    )


# -- 8 devices ---------------------------------------------------------------------------


@on_eight_devices
@pytest.mark.parametrize("params", ["device", "pinned_host"])
def test_a_layer_streamed_optimizer_updates_on_the_host_of_a_mesh(params):
    """A strategy with `update="host"` runs a layer-streamed optimizer as one host
    computation on a 2x4 mesh: each device's shard on its own host, the state sharded like
    its parameter in pinned_host, the results equal the one-device device update's."""
    strategy = ox.Strategy("host", params=params, optimizer="pinned_host", update="host")
    run = train(_mesh(), strategy, update_on="layer")
    reference = _reference()
    np.testing.assert_allclose([float(x) for x in run["losses"]], reference["losses"], rtol=2e-5)
    _assert_close(gather(run["model"]), reference["model"], "model")
    mu = run["opt_state"].inner.leaves.layers.w1[0].mu
    assert mu.sharding == NamedSharding(_mesh(), FSDP, memory_kind="pinned_host")
    for leaf in jax.tree_util.tree_leaves(run["opt_state"]):
        assert leaf.sharding.memory_kind == "pinned_host"


@on_eight_devices
@pytest.mark.parametrize("axis_type", ["auto", "explicit"])
def test_place_shards_parameters_and_optimizer_state(axis_type):
    mesh = _mesh(axis_type)
    model = ox.place(make_model(jax.random.key(0)), mesh=mesh)
    w1 = model.layers.w1
    assert w1.sharding == NamedSharding(mesh, FSDP, memory_kind="pinned_host")
    assert jax.typeof(w1).memory_space == jax.memory.Space.Host
    assert len(w1.addressable_shards) == 8 and w1.addressable_shards[0].data.shape == (
        DEPTH,
        WIDTH // 4,
        HIDDEN,
    )
    assert model.layers.bias.sharding == NamedSharding(mesh, P(), memory_kind="device")
    # Given once: the plan, the optimizer and later calls find the mesh on the arrays.
    assert ox.plan(model).mesh == mesh
    opt_state = make_optimizer().init(model)
    adam = opt_state.inner[1][0]  # pyright: ignore[reportAttributeAccessIssue]
    assert adam.mu.layers.w1.sharding == NamedSharding(mesh, FSDP, memory_kind="pinned_host")
    assert adam.nu.layers.w2.sharding == NamedSharding(mesh, FSDP, memory_kind="pinned_host")
    assert adam.count.sharding == NamedSharding(mesh, P(), memory_kind="device")
    assert adam.mu.layers.bias.sharding.spec == P()


@on_eight_devices
@pytest.mark.parametrize(
    "axis_type, strategy",
    [("auto", s) for s in ox.STRATEGIES] + [("explicit", "annotated"), ("explicit", "hybrid")],
)
def test_every_strategy_matches_one_device(axis_type, strategy):
    mesh = _mesh(axis_type)
    run = train(mesh, strategy)
    reference = _reference()
    np.testing.assert_allclose([float(x) for x in run["losses"]], reference["losses"], rtol=2e-5)
    for key in ("grads", "updates", "model", "opt_state"):
        _assert_close(gather(run[key]), reference[key], key)

    # Outputs keep their shardings and memory kinds: step after step, every leaf of the
    # model and of the optimizer state is exactly where `ox.place`/`opt.init` put it.
    final = jax.tree_util.tree_map(
        lambda x: x.sharding, eqx.filter((run["model"], run["opt_state"]), eqx.is_array)
    )
    assert _specs_and_memories(final) == _specs_and_memories(run["placed"])
    plan = run["step"].plan(run["model"], run["opt_state"], run["x"])
    assert plan.mesh == mesh
    for leaf_plan, leaf in zip(plan.leaves, jax.tree_util.tree_leaves(run["model"])):
        assert leaf.sharding.memory_kind == (leaf_plan.memory or "device"), leaf_plan.path
    assert run["model"].layers.w1.sharding.spec == FSDP
    # Gradients and updates are sharded like their parameters.
    assert run["grads"].layers.w1.sharding.spec == FSDP
    assert run["updates"].layers.w2.sharding.spec == FSDP
    assert run["x"].sharding == NamedSharding(mesh, DATA)


@on_eight_devices
@pytest.mark.parametrize("strategy", ["offload_optimizer", "hybrid"])
def test_host_update_on_a_mesh_matches_one_device(strategy):
    """`update_on="host"` on a 2x4 mesh: each device's shard of the state is updated on
    its own host; the results equal the one-device device update's."""
    run = train(_mesh(), strategy, update_on="host")
    reference = _reference()
    np.testing.assert_allclose([float(x) for x in run["losses"]], reference["losses"], rtol=2e-5)
    for key in ("updates", "model"):
        _assert_close(gather(run[key]), reference[key], key)
    adam = run["opt_state"].inner[1][0]
    assert adam.mu.layers.w1.sharding == NamedSharding(_mesh(), FSDP, memory_kind="pinned_host")
    assert adam.count.sharding.memory_kind == "pinned_host"
    for leaf in jax.tree_util.tree_leaves(run["opt_state"]):
        assert leaf.sharding.memory_kind == "pinned_host"


@on_eight_devices
@pytest.mark.parametrize(
    "strategy", ["hybrid", pytest.param("offload_optimizer", marks=pytest.mark.full)]
)
def test_delayed_host_update_on_a_mesh_matches_one_device(strategy):
    """`update_on="host", delay=1` on a 2x4 mesh equals the same run on one device (which
    `test_optimizer_delayed.py` checks against the definition); the pending gradients
    are sharded like their parameters, in host memory."""
    run = train(_mesh(), strategy, update_on="host", delay=1)
    one = train(_one_device_mesh(), strategy, update_on="host", delay=1)
    np.testing.assert_allclose(
        [float(x) for x in run["losses"]], [float(x) for x in one["losses"]], rtol=2e-5
    )
    _assert_close(gather(run["model"]), gather(one["model"]), "model")
    pending = run["opt_state"].inner.pending
    assert pending.layers.w1.sharding == NamedSharding(_mesh(), FSDP, memory_kind="pinned_host")
    assert jax.typeof(pending.layers.w1).memory_space == jax.memory.Space.Host


@on_eight_devices
@pytest.mark.parametrize("mode", ["host", "delayed_host", "layer_stream"])
def test_float32_masters_on_a_mesh_equal_the_definition(mode):
    """`master_dtype=jnp.float32` for a bfloat16 model on a 2x4 mesh under `hybrid`: the
    masters (sharded like their parameters, in host memory) and the bfloat16 parameters
    equal plain JAX + optax (float32 masters, AdamW on them) given the step's own
    gradients: a data-parallel sum of bfloat16 gradients rounds in its own order (2e-5
    relative apart from one device after 4 steps), which the 8-device equivalence tests
    bound; this checks the update."""
    options = {
        "host": {"update_on": "host"},
        "delayed_host": {"update_on": "host", "delay": 1},
        "layer_stream": {"stream": "layer", "layers": DEPTH},
    }[mode]
    opt = ox.offload_optimizer(optax.adamw(1e-4), master_dtype=jnp.float32, **options)
    mesh = _mesh()
    model = ox.place(to_bf16(make_model(jax.random.key(0))), "hybrid", mesh=mesh)
    batch = jnp.asarray(make_batch()).astype(jnp.bfloat16)
    x, state = shard(batch, DATA, mesh), opt.init(model)

    @ox.filter_jit(strategy="hybrid", donate="all")
    def step(model, state, x):
        grads = eqx.filter_grad(loss_fn)(model, x)
        return (*ox.update_and_apply(opt, grads, state, model), grads)

    recorded = []
    for _ in range(4):
        model, state, grads = step(model, state, x)
        recorded.append(gather(grads))
    if options.get("delay"):
        model, state = ox.filter_jit(lambda m, s: ox.apply_pending(opt, s, m))(model, state)
    start = jax.tree_util.tree_map(
        lambda w: w.astype(jnp.float32) if eqx.is_inexact_array(w) else w,
        to_bf16(make_model(jax.random.key(0))),
    )
    reference = masters_reference(
        start,
        loss_fn,
        batch,
        optax.adamw(1e-4),
        4,
        bool(options.get("delay")),
        grad=lambda m, x: recorded.pop(0),
    )
    stored: Any = state
    inner = stored.inner.state if options.get("delay") else stored.inner
    masters = (
        inner.master
        if mode != "layer_stream"
        else jax.tree_util.tree_map(
            lambda leaf: leaf.master, inner.leaves, is_leaf=lambda leaf: hasattr(leaf, "master")
        )
    )
    w1 = masters.layers.w1
    assert w1.sharding == NamedSharding(mesh, FSDP, memory_kind="pinned_host")
    assert jax.typeof(w1).memory_space == jax.memory.Space.Host
    pairs = zip(jax.tree_util.tree_leaves(gather(masters)), jax.tree_util.tree_leaves(reference))
    for ours, want in pairs:
        assert np.max(np.abs(ours - np.asarray(want))) <= 1e-6 * np.max(np.abs(want))
    params = jax.tree_util.tree_leaves(gather(eqx.filter(model, eqx.is_array)))
    for ours, want in zip(params, jax.tree_util.tree_leaves(reference)):
        np.testing.assert_array_equal(ours, np.asarray(want.astype(jnp.bfloat16)))


@on_eight_devices
@pytest.mark.parametrize("axis_type", ["auto", "explicit"])
def test_shard_constrains_activations_inside_a_step(axis_type):
    mesh = _mesh(axis_type)
    model = ox.place(make_model(jax.random.key(0)), mesh=mesh)

    @ox.filter_jit
    def forward(model, x):
        return shard(model(x), P("data", None))  # the step's mesh, found on the model

    x = shard(jnp.ones((8, WIDTH)), DATA, mesh)
    out = forward(model, x)
    assert out.sharding.is_equivalent_to(NamedSharding(mesh, P("data", None)), out.ndim)
    text = forward.lower(model, x).as_text()
    assert "sharding" in text


@on_eight_devices
def test_a_mesh_given_to_filter_jit_moves_unplaced_arguments_once():
    mesh = _mesh()

    @ox.filter_jit(mesh=mesh)
    def forward(model, x):
        return model, jnp.mean(model(x) ** 2)

    model, loss = forward(make_model(jax.random.key(0)), jnp.ones((BATCH, WIDTH)))
    assert model.layers.w1.sharding == NamedSharding(mesh, FSDP, memory_kind="pinned_host")
    model, _ = forward(model, shard(jnp.ones((BATCH, WIDTH)), DATA, mesh))
    assert model.layers.w1.sharding == NamedSharding(mesh, FSDP, memory_kind="pinned_host")


@pytest.mark.deviceless
@on_eight_devices
def test_splash_attention_in_a_shard_map_is_priced_for_one_device():
    # XLA cannot partition a Pallas kernel, so a sharded step calls splash attention in a
    # `shard_map`, one device's sequences each (as MaxText does). Per device, both the
    # compiled simulation and the jaxpr count price one sequence's kernels by their
    # block mask: 4 blocks a side, 10 of 16 computed, by fwd (Q K^T, P V), dq (Q K^T, dP,
    # dQ) and dkv (Q K^T, dV, dP, dK). The jaxpr count once saw a quarter of it.
    pytest.importorskip("libtpu", reason="needs offload_eqx[tpu]")
    mesh = jax.make_mesh((4,), ("fsdp",), axis_types=(AxisType.Auto,), devices=jax.devices()[:4])
    heads, length, dim = 2, 1024, 128
    spec = P("fsdp")
    kernels = jax.shard_map(
        splash_step(heads, length, 256), mesh=mesh.abstract_mesh, in_specs=spec, out_specs=spec,
        check_vma=False,
    )  # fmt: skip
    q = jax.ShapeDtypeStruct(
        (4, heads, length, dim), jnp.bfloat16, sharding=NamedSharding(mesh, spec)
    )
    estimate = ox.estimate(ox.filter_jit(kernels), q, q, q, target="tpu-v5p-4")
    pairs = heads * length * length * 10 / 16
    one_device = 2 * pairs * (2 + 3 + 4) * dim
    assert estimate.simulation is not None and estimate.unpriced == ()
    assert estimate.simulation.flops == pytest.approx(one_device, rel=1e-3)
    assert estimate.flops == pytest.approx(one_device, rel=1e-3)


@on_eight_devices
def test_audit_on_a_mesh():
    mesh = _mesh()
    model = ox.place(make_model(jax.random.key(0)), mesh=mesh)
    opt = make_optimizer()
    opt_state = opt.init(model)
    x = shard(jnp.ones((BATCH, WIDTH)), DATA, mesh)
    step = make_step(opt)
    report = ox.audit(step, model, opt_state, x)
    report.assert_no_implicit()
    assert report.total("device-to-host") > 0
    audited = make_step(opt, donate="none")
    audited = ox.filter_jit(audited.fn, audit=True)  # the guard, with arguments on a mesh
    model, opt_state, loss, _ = audited(model, opt_state, x)
    assert model.layers.w1.sharding.spec == FSDP and np.isfinite(float(loss))


@functools.cache
def _streamed_run(stream: str | None, axis_type: str) -> dict:
    """Two Adam steps through `ox.update_and_apply` on the 2x4 mesh with `stream`."""
    mesh = _mesh(axis_type)
    model = ox.place(make_model(jax.random.key(0)), mesh=mesh)
    layers = DEPTH if stream == "layer" else None
    opt = ox.offload_optimizer(optax.adam(1e-2), stream=stream, layers=layers)
    opt_state = opt.init(model)
    placed = jax.tree_util.tree_map(lambda x: x.sharding, opt_state)
    x = shard(jnp.asarray(np.ones((BATCH, WIDTH), np.float32)), DATA, mesh)

    @ox.filter_jit(donate="all")
    def step(model, opt_state, x):
        grads = eqx.filter_grad(loss_fn)(model, x)
        return ox.update_and_apply(opt, grads, opt_state, model)

    for _ in range(2):
        model, opt_state = step(model, opt_state, x)
    return dict(mesh=mesh, placed=placed, model=model, opt_state=opt_state)


@on_eight_devices
@pytest.mark.parametrize(
    "stream, axis_type", [("leaf", "auto"), ("layer", "auto"), ("layer", "explicit")]
)
def test_streamed_optimizer_state_is_sharded_like_its_parameter(stream, axis_type):
    """Issue 9, bug 3: the streamed state came out replicated, P(), while the parameters
    are sharded P(None, "fsdp", None): 4x the host memory."""
    run = _streamed_run(stream, axis_type)
    mesh = run["mesh"]
    checked = 0
    for when in ("placed", "opt_state"):  # after `init`, and after two steps
        tree = run[when]
        if when == "opt_state":
            tree = jax.tree_util.tree_map(lambda x: x.sharding, tree)
        for path, sharding in jax.tree_util.tree_leaves_with_path(
            tree, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding)
        ):
            name = jax.tree_util.keystr(path)
            if ".layers.w1[" in name and name.endswith((".mu", ".nu")):
                assert sharding == NamedSharding(mesh, FSDP, memory_kind="pinned_host"), name
                checked += 1
            elif name.endswith(".count"):
                assert sharding.memory_kind == "device" and sharding.spec == P(), name
    assert checked == 4
    reference = _streamed_run(None, "auto")
    _assert_close(gather(run["model"]), gather(reference["model"]), "model")


# -- bad input ---------------------------------------------------------------------------


def _layer_with(spec, w1_shape=(DEPTH, WIDTH, HIDDEN)):
    class Custom(eqx.Module):
        w1: jax.Array = ox.field(memory="pinned_host", spec=spec)

    return Custom(w1=jnp.ones(w1_shape))


def test_spec_without_a_mesh_is_an_error():
    with pytest.raises(ValueError, match=r"`tree.layers.w1` has the partition spec .*no mesh"):
        ox.place(make_model(jax.random.key(0)))


def test_mesh_option_must_be_a_mesh():
    # Under the tests' runtime type checking the annotation catches it first.
    with pytest.raises(TypeError, match=r"mesh"):
        ox.filter_jit(lambda x: x, mesh=("data", "fsdp"))  # pyright: ignore[reportArgumentType]


@on_eight_devices
def test_spec_naming_a_missing_axis_is_an_error():
    layer = _layer_with(P(None, "fsdpp", None))
    with pytest.raises(
        ValueError,
        match=r"`tree.w1` .*names the mesh axis 'fsdpp', but the mesh has the axes "
        r"'data', 'fsdp'",
    ):
        ox.place(layer, mesh=_mesh())


@on_eight_devices
def test_spec_that_does_not_divide_the_array_is_an_error():
    layer = _layer_with(FSDP, w1_shape=(DEPTH, 6, HIDDEN))
    with pytest.raises(
        ValueError,
        match=r"`tree.w1` of shape \(3, 6, 32\) .*dimension 1 \(size 6\) over the "
        r"mesh axes 'fsdp', that is over 4 devices",
    ):
        ox.place(layer, mesh=_mesh())
    with pytest.raises(ValueError, match=r"has only 3 dimensions"):
        ox.place(_layer_with(P(None, None, None, "data")), mesh=_mesh())


@on_eight_devices
def test_a_later_call_with_a_shape_the_spec_cannot_divide_gets_the_same_clear_error():
    class Data(eqx.Module):
        x: jax.Array = ox.field(memory="device", spec=P("fsdp"))

    step = ox.filter_jit(lambda d: d.x * 2, mesh=_mesh())
    step(Data(jnp.ones(8)))  # divides over the 4 devices of "fsdp"
    for _ in range(2):  # a later call, then a cached one: both validated
        with pytest.raises(ValueError, match=r"`d.x` of shape \(6,\) .*over 4 devices"):
            step(Data(jnp.ones(6)))


@on_eight_devices
def test_arrays_from_two_meshes_is_an_error():
    model = ox.place(make_model(jax.random.key(0)), mesh=_mesh())
    other = jax.make_mesh((4, 2), ("data", "fsdp"), axis_types=(AxisType.Auto,) * 2)
    x = shard(jnp.ones((8, WIDTH)), DATA, other)

    @ox.filter_jit
    def forward(model, x):
        return model(x)

    with pytest.raises(
        ValueError, match=r"two different meshes .*: `model.layers.w1` is on .*`x` is on"
    ):
        forward(model, x)
    with pytest.raises(ValueError, match=r"the mesh given as `mesh=` is on .*`tree.layers.w1`"):
        ox.place(model, mesh=other)


# -- two processes -----------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_match_one_process(tmp_path):
    env = dict(
        os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu"
    )
    env.pop("JAX_NUMPY_DTYPE_PROMOTION", None)  # optax's Adam promotes a Python float
    port = _free_port()
    outputs = [tmp_path / f"process{i}.json" for i in range(2)]
    logs = [open(tmp_path / f"process{i}.log", "w") for i in range(2)]
    workers = [
        subprocess.Popen(
            [sys.executable, str(HERE / "_multiprocess_worker.py"), str(port), str(i), str(out)],
            env=env,
            cwd=HERE.parent,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        for i, (out, log) in enumerate(zip(outputs, logs))
    ]
    try:
        codes = [worker.wait(timeout=WORKER_TIMEOUT) for worker in workers]
    except subprocess.TimeoutExpired:
        codes = None
    finally:
        for worker in workers:
            if worker.poll() is None:
                worker.kill()
                worker.wait()
        for log in logs:
            log.close()
    if codes != [0, 0]:
        text = "\n".join((tmp_path / f"process{i}.log").read_text()[-3000:] for i in range(2))
        pytest.fail(f"Worker exit codes {codes} (None: timed out):\n{text}", pytrace=False)

    results = [json.loads(out.read_text()) for out in outputs]
    run = train(_one_device_mesh())  # the same annotated step in this one process
    expected_params = [leaf.tolist() for leaf in jax.tree_util.tree_leaves(gather(run["model"]))]
    for result in results:
        assert result["memories"] == {
            "w1": "pinned_host",
            "w1_spec": str(FSDP),
            "addressable": False,
        }
        np.testing.assert_allclose(result["losses"], [float(x) for x in run["losses"]], rtol=2e-5)
        for ours, expected in zip(result["params"], expected_params):
            np.testing.assert_allclose(np.asarray(ours), np.asarray(expected), rtol=2e-5, atol=1e-6)


@on_eight_devices
def test_arguments_on_two_devices_are_named_by_path():
    """JAX said `argument dynamic[0] of make_flat.<locals>.flat`; the error names the
    leaf, its device and the fix (issue 17, item 7)."""
    from offload_eqx._jit.call_errors import is_incompatible_devices

    model = eqx.nn.MLP(4, 4, 8, 1, key=jax.random.key(0))
    x = jax.device_put(jnp.ones((3, 4)), jax.devices()[1])
    # An uncommitted model follows the committed batch, as under `jax.jit` (issue 25).
    follows = ox.filter_jit(lambda model, x: jax.vmap(model)(x))
    assert follows(model, x).sharding.device_set == {jax.devices()[1]}
    # Committed to another device than the batch: the two conflict.
    step = ox.filter_jit(lambda model, x: jax.vmap(model)(x))
    model = jax.tree.map(
        lambda a: jax.device_put(a, jax.devices()[0]) if eqx.is_array(a) else a, model
    )
    with pytest.raises(
        ValueError,
        match=r"the arguments are on different devices \(`x` is on .*1, while the others are "
        r"on .*0\).*jax.device_put\(x, jax.devices\(\)\[0\]\)",
    ):
        step(model, x)
    with pytest.raises(ValueError) as caught:
        jax.jit(lambda a, b: a + b)(jax.device_put(jnp.ones(4), jax.devices()[0]), x[0])
    assert is_incompatible_devices(caught.value)  # JAX's words, pinned


@on_eight_devices
def test_optimizer_state_is_made_on_the_device_of_its_model():
    """`opt.init` of a model committed to device 3 put the moments on device 0, and the
    step then asked for the model on device 0 (issue 26, item 16)."""
    three = jax.devices()[3]
    model = jax.tree.map(
        lambda a: jax.device_put(a, three) if eqx.is_array(a) else a,
        eqx.nn.MLP(4, 4, 8, 1, key=jax.random.key(0)),
    )
    opt = ox.offload_optimizer(optax.adam(1e-3))
    opt_state = opt.init(model)
    state_devices = {d for x in jax.tree.leaves(opt_state) for d in x.sharding.device_set}
    assert state_devices == {three}

    @ox.filter_jit(donate="all")
    def step(model, opt_state, x):
        grads = eqx.filter_grad(lambda m: jnp.sum(jax.vmap(m)(x)))(model)
        return ox.update_and_apply(opt, grads, opt_state, model)

    model, opt_state = step(model, opt_state, jnp.ones((3, 4)))
    leaves = jax.tree.leaves(eqx.filter((model, opt_state), eqx.is_array))
    assert {d for x in leaves for d in x.sharding.device_set} == {three}


@pytest.mark.parametrize("fmt", ["orbax", "equinox"])
def test_checkpoint_restored_on_a_mesh_in_a_new_process(tmp_path, fmt):
    """Issue 18: the FSDP-sharded hybrid state of a 2x4 mesh, checkpointed after one step
    and restored in a new process, lands sharded and in pinned_host before any step, and
    trains on with an uninterrupted run's losses, bit for bit."""
    from test_checkpoints import assert_resumed_equals_straight

    (tmp_path / "straight").mkdir()
    if fmt == "equinox":
        (tmp_path / "ckpt").mkdir()
    resumed = assert_resumed_equals_straight(tmp_path, fmt, "mesh", env={"XLA_FLAGS": EIGHT})
    w1 = resumed["restored"]["[0].layers.w1"]
    mu = resumed["restored"]["[1].inner[1][0].mu.layers.w1"]
    assert w1 == ["pinned_host", "P(None, 'fsdp', None)", "host"]
    assert mu == w1  # the optimizer state is sharded like its parameter


@on_eight_devices
def test_sharding_constraints_inside_the_step_are_kept():
    """Issue 25, item 8: a constraint (or `eqx.filter_shard`) inside the step, with no
    mesh given: the uncommitted input follows it and the output comes back as
    constrained, as under `eqx.filter_jit`; with `mesh=` too (it came back replicated)."""
    mesh = jax.make_mesh((8,), ("x",), axis_types=(AxisType.Auto,))
    sharded = NamedSharding(mesh, P("x"))

    def constrain(x):
        return jax.lax.with_sharding_constraint(x + 1, sharded)

    def filter_shard(x):
        return eqx.filter_shard(x + 1, sharded)

    for fn in (constrain, filter_shard):
        expected = eqx.filter_jit(fn)(jnp.zeros(16))
        for step in (ox.filter_jit(fn), ox.filter_jit(fn, mesh=mesh)):
            out = step(jnp.zeros(16))
            assert out.sharding.is_equivalent_to(sharded, 1), out.sharding
            np.testing.assert_array_equal(out, expected)


@on_eight_devices
def test_one_step_on_two_meshes_is_planned_for_each():
    """The compile cache is the function's and its key holds no mesh: a step called with
    arrays on another mesh (or two wrappers of it, one per mesh) is planned for that
    mesh, not moved back to the first one's (issue 25)."""

    def step(model, x):
        return jax.tree.map(lambda w: w * 2, model), x.sum()

    outputs = []
    for shape in ((2, 4), (1, 8)):
        mesh = _mesh(shape=shape)
        fsdp = NamedSharding(mesh, P(None, "fsdp"))
        model = {"w": jax.device_put(jnp.ones((4, 16)), fsdp)}
        x = jax.device_put(jnp.ones((8, 16)), NamedSharding(mesh, P("data")))
        new, _ = ox.filter_jit(step)(model, x)
        assert new["w"].sharding.mesh == mesh, new["w"].sharding
        outputs.append(new)
    np.testing.assert_array_equal(outputs[0]["w"], outputs[1]["w"])
