"""Memory reports of an FSDP-sharded step, per device, on multi-chip deviceless targets:
`h100-8` (topology 1x1x8) for a (2, 4) ("data", "fsdp") mesh and `tpu-v5p-4` (v5p:2x2x1)
for a (1, 4) mesh.

The arguments must be on a CPU mesh of the same shape, which needs 8 CPU devices before
JAX starts: the reports are computed once by running this file as a script in a child
process with `--xla_force_host_platform_device_count=8`; it prints them as JSON and the
tests below check the numbers by hand.
"""

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

# One worker runs the file: its 8-device child process (`_reports`) runs once, not once
# per worker (28 s each).
pytestmark = [pytest.mark.deviceless, pytest.mark.xdist_group("test_memory_mesh")]

EIGHT = "--xla_force_host_platform_device_count=8"
CHILD_TIMEOUT = 240
LAYERS, WIDTH, HIDDEN, BATCH = 4, 256, 1024, 64
PARAM_BYTES = 2 * LAYERS * WIDTH * HIDDEN * 4  # 8 MiB over all devices
FSDP_WAYS = 4
X_BYTES = BATCH * WIDTH * 4
# (target, mesh shape, mesh axes, how the batch is split)
CASES = {
    "h100-8": ((2, 4), ("data", "fsdp"), 2),
    "tpu-v5p-4": ((1, 4), ("data", "fsdp"), 1),
}


# -- the child: compile the reports on 8 CPU devices -------------------------------------


def _child() -> dict:
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    from helpers import seed_model  # tests/ is on the path: `_reports` runs this file
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

    import offload_eqx as ox
    from offload_eqx import compare_memory, memory_report

    assert jax.device_count() == 8
    fsdp = P(None, "fsdp", None)

    def grad_step(model, x):
        return eqx.filter_grad(lambda m: jnp.sum(m(x)))(model)

    def make_mesh(shape, axes):
        count = 1
        for size in shape:
            count *= size
        return jax.make_mesh(
            shape, axes, axis_types=(AxisType.Auto,) * len(axes), devices=jax.devices()[:count]
        )

    out: dict = {}
    for target, (shape, axes, _) in CASES.items():
        mesh = make_mesh(shape, axes)
        # Abstract arguments with NamedShardings on the CPU mesh.
        model = seed_model(
            LAYERS, WIDTH, HIDDEN, memory="device", spec=fsdp, sharding=NamedSharding(mesh, fsdp)
        )
        x = jax.ShapeDtypeStruct(
            (BATCH, WIDTH), jnp.float32, sharding=NamedSharding(mesh, P("data"))
        )
        programs = {
            s: (ox.filter_jit(grad_step, strategy=s), (model, x)) for s in ("baseline", "hybrid")
        }
        comparison = compare_memory(programs, target=target)
        out[target] = {name: r.as_dict() for (name, _), r in comparison.reports.items()}
        # The step time of the same program, its collectives priced on the interconnect.
        estimate = ox.estimate(programs["baseline"][0], model, x, target=target)
        sim = estimate.simulation
        assert sim is not None
        out[target]["estimate"] = {
            "seconds": estimate.seconds,
            "flops": estimate.flops,
            "simulated_flops": sim.flops,
            "network": [
                {"name": e.name, "seconds": e.end - e.start, "op_name": e.op_name}
                for e in sim.events
                if e.resource == "network"
            ],
            "busy": sim.busy,
            "waited": sim.waited,
        }
        out[target]["table"] = str(comparison)
        out[target]["hybrid_text"] = str(comparison.reports[("hybrid", target)])
        try:
            memory_report(
                ox.filter_jit(grad_step),
                model,
                x,
                target="tpu-v5p-4" if target == "h100-8" else "h100-8",
            )
        except ValueError as e:
            out[target]["mismatch"] = str(e)

    out["training"] = _training(make_mesh((2, 4), ("data", "fsdp")), fsdp)

    # Placed arrays (not ShapeDtypeStructs) on the (2, 4) mesh, and the CPU target.
    mesh = make_mesh((2, 4), ("data", "fsdp"))
    model = seed_model(LAYERS, WIDTH, HIDDEN, abstract=False, memory="device", spec=fsdp)
    model = ox.place(model, "hybrid", mesh=mesh)
    x = ox.shard(jnp.ones((BATCH, WIDTH)), P("data"), mesh)
    step = ox.filter_jit(grad_step, strategy="hybrid")
    placed: dict = {t: memory_report(step, model, x, target=t).as_dict() for t in ("cpu", "h100-8")}
    placed["w1_sharding"] = str(model.layers.w1.sharding)
    out["placed"] = placed
    return out


def _training(mesh, fsdp) -> dict:
    """A full FSDP training step on h100-8, Adam's update streamed layer by layer: the
    collectives each plan compiles to, and `ox.fit` between the two plans' memories."""
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import optax
    from helpers import seed_model
    from jax.sharding import NamedSharding, PartitionSpec as P

    import offload_eqx as ox

    def sharded(tree):
        return jax.tree_util.tree_map(
            lambda x: jax.ShapeDtypeStruct(
                x.shape, x.dtype, sharding=NamedSharding(mesh, fsdp if x.ndim == 3 else P())
            ),
            tree,
        )

    model = seed_model(
        LAYERS, WIDTH, HIDDEN, memory="device", spec=fsdp, sharding=NamedSharding(mesh, fsdp)
    )
    opt = ox.offload_optimizer(optax.adam(1e-3), stream="layer", layers=LAYERS)
    state = sharded(jax.eval_shape(opt.init, model))
    x = jax.ShapeDtypeStruct((BATCH, WIDTH), jnp.float32, sharding=NamedSharding(mesh, P("data")))

    def train_step(model, opt_state, x):
        grads = eqx.filter_grad(lambda m: jnp.sum(m(x) ** 2))(model)
        return ox.update_and_apply(opt, grads, opt_state, model)

    out: dict = {}
    for strategy in ("baseline", "hybrid"):
        step = ox.filter_jit(train_step, strategy=strategy, mesh=mesh, donate="all")
        estimate = ox.estimate(step, model, state, x, target="h100-8")
        assert estimate.simulation is not None
        out[strategy] = {
            "collectives": sorted(
                {
                    e.name.split(".")[0]
                    for e in estimate.simulation.events
                    if e.resource == "network"
                }
            ),
            "device": estimate.device_bytes,
        }
    budget = (out["baseline"]["device"] + out["hybrid"]["device"]) // 2
    step = ox.filter_jit(train_step, mesh=mesh, donate="all")
    result = ox.fit(step, model, state, x, target="h100-8", device_budget=budget, max_compiles=4)
    chosen = result.estimate
    assert chosen.simulation is not None
    # A budget the device-only plan fits in, per device: the search must not rule it out
    # by the whole model's bytes.
    ample = ox.fit(
        step, model, state, x, target="h100-8", device_budget=out["baseline"]["device"] * 2,
        max_compiles=4,
    )  # fmt: skip
    out["ample"] = [ample.strategy.params, ample.strategy.optimizer]
    out["fit"] = {
        "budget": budget,
        "device": chosen.device_bytes,
        "model": chosen.model,
        "seconds": chosen.seconds,
        "params": result.strategy.params,
        "optimizer": result.strategy.optimizer,
        "network": chosen.simulation.busy.get("network", 0.0),
        "flops": chosen.flops,
        "simulated_flops": chosen.simulation.flops,
    }
    return out


@functools.cache
def _reports() -> dict:
    env = dict(os.environ, XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} {EIGHT}".strip())
    env.setdefault("JAX_PLATFORMS", "cpu")
    root = Path(__file__).parent.parent
    tests = Path(__file__).parent  # for `helpers` (also sys.path[0] of a script run)
    env["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(root), str(tests), env.get("PYTHONPATH")])
    )
    try:
        done = subprocess.run(
            [sys.executable, __file__],
            env=env,
            cwd=root,
            capture_output=True,
            text=True,
            timeout=CHILD_TIMEOUT,
        )
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"The 8-device child took more than {CHILD_TIMEOUT} s:\n{e.stdout}")
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        pytest.fail(f"The 8-device child failed:\n{done.stdout}\n{done.stderr[-4000:]}")
    return json.loads(lines[-1])


def _require_extras():
    pytest.importorskip("jax_plugins.xla_cuda12", reason="needs offload_eqx[cuda]")
    pytest.importorskip("libtpu", reason="needs offload_eqx[tpu]")


# -- the checks ----------------------------------------------------------------------------


@pytest.mark.parametrize("target", list(CASES))
def test_fsdp_parameters_are_a_quarter_per_device(target):
    _require_extras()
    reports = _reports()[target]
    baseline, hybrid = reports["baseline"], reports["hybrid"]
    shape, axes, batch_ways = CASES[target]
    per_device = PARAM_BYTES // FSDP_WAYS  # FSDP over 4 devices: 2 MiB each
    x_per_device = X_BYTES // batch_ways
    assert baseline["mesh"] == dict(zip(axes, shape))
    # Baseline: the parameters' shard and the batch's shard are device arguments.
    assert baseline["device"]["argument"] == per_device + x_per_device
    assert baseline["host"]["argument"] == 0
    # Hybrid: the parameters' shard moves to host arguments; only the batch stays.
    assert hybrid["host"]["argument"] == per_device
    assert hybrid["device"]["argument"] == x_per_device
    assert baseline["device"]["argument"] - hybrid["device"]["argument"] == per_device
    # The gradients keep the parameters' FSDP sharding (not replicated: 8 MiB), host-typed
    # under hybrid.
    assert per_device <= baseline["device"]["output"] < per_device + 1024
    assert per_device <= hybrid["host"]["output"] < per_device + 1024
    assert hybrid["total"] < baseline["total"]


@pytest.mark.parametrize("target", list(CASES))
def test_table_says_per_device_and_mismatch_names_both_shapes(target):
    _require_extras()
    reports = _reports()[target]
    shape, axes, _ = CASES[target]
    assert reports["hybrid_text"].startswith(
        f"Memory per device of 'hybrid' compiled for '{target}'"
    )
    assert "Compiled memory per device" in reports["table"] and "mesh" in reports["table"]
    message = reports["mismatch"]
    assert f"shape {shape}" in message
    assert "has 4 devices" in message or "has 8 devices" in message


@pytest.mark.parametrize("target", list(CASES))
def test_fsdp_step_time_prices_its_collectives(target):
    """FSDP over 4 devices: the compiled step gathers each layer's weights and
    reduce-scatters their gradients; the simulation runs them on the interconnect."""
    _require_extras()
    import offload_eqx as ox

    estimate = _reports()[target]["estimate"]
    network = estimate["network"]
    assert network, "an FSDP step has collectives"
    assert estimate["busy"]["network"] == pytest.approx(sum(e["seconds"] for e in network))
    speeds = ox.TARGETS[target].speeds
    assert speeds is not None and speeds.interconnect_bandwidth > 0
    # XLA spreads the matmuls over every device: the compiled program's FLOPs, its
    # loops' trips counted (XLA:TPU's read from their conditions), are the jaxpr
    # count's divided evenly.
    assert estimate["simulated_flops"] == pytest.approx(estimate["flops"], rel=1e-6)
    # Each layer's weights gathered before use (forward and recomputation) and its
    # gradient reduced across the shards: several collectives per trip of the scan.
    kinds = {e["name"].split(".")[0].removesuffix("-start") for e in network}
    assert "all-gather" in kinds and kinds & {"reduce-scatter", "all-reduce"}
    assert len(network) >= 2 * LAYERS
    # Nothing collective is free: the step is at least its collectives' longest.
    assert estimate["seconds"] >= max(e["seconds"] for e in network)


def test_streamed_update_slices_fsdp_state_without_resharding_it():
    """The layer-streamed Adam update under FSDP: the gradient is sharded as its
    parameter, so the update loop slices it in place. Without that rule the partitioner
    kept the gradient as the backward pass made it and resharded the whole stack with an
    all-to-all on every trip (Llama-2-70B on h100-8: 55.8 s predicted per step, 10.6 s
    with the rule)."""
    _require_extras()
    training = _reports()["training"]
    for strategy in ("baseline", "hybrid"):
        kinds = training[strategy]["collectives"]
        assert "all-gather-start" in kinds, (strategy, kinds)
        assert not any("all-to-all" in k for k in kinds), (strategy, kinds)


def test_fit_on_a_mesh_target_picks_a_plan_within_the_budget():
    """`ox.fit` over 8 deviceless H100s, a budget between the device-only and the
    offloaded plans' memory: the plan it returns fits, offloads something, and its time
    is the compiled schedule's, collectives included."""
    _require_extras()
    training = _reports()["training"]
    fit = training["fit"]
    assert fit["device"] <= fit["budget"] < training["baseline"]["device"]
    assert "pinned_host" in repr((fit["params"], fit["optimizer"]))
    assert fit["model"] == "compiled" and fit["network"] > 0
    assert fit["simulated_flops"] == pytest.approx(fit["flops"], rel=1e-6)
    # Memory bounds are per device: with room for the device-only plan, it is chosen
    # (the whole model's bytes had ruled every device plan out).
    assert training["ample"] == ["device", "device"]


def test_placed_arrays_on_a_cpu_mesh():
    _require_extras()
    placed = _reports()["placed"]
    assert "pinned_host" in placed["w1_sharding"] and "'fsdp'" in placed["w1_sharding"]
    per_device = PARAM_BYTES // FSDP_WAYS
    gpu = placed["h100-8"]
    assert gpu["host"]["argument"] == per_device
    assert gpu["device"]["argument"] == X_BYTES // 2
    # CPU: offloading is only a type, host arguments count as device; still per device.
    cpu = placed["cpu"]
    assert cpu["device"]["argument"] == per_device + X_BYTES // 2
    assert per_device <= cpu["device"]["output"] < per_device + 1024


if __name__ == "__main__":
    print(json.dumps(_child()))
