"""The largest-model recipe (`experiments/largest_models.py`) at a tiny shape of the same
structure, compiled for the H100 without the hardware: the experiments' decoder with
bfloat16 parameters in host memory streamed per layer by `ox.scan`, each block's input
(`block_input`) offloaded, and AdamW with float32 masters updated on the host a step late
(ZeRO-Offload's way). What moves is named leaf by leaf, the host's bytes are reported, and
`ox.fit` says which budget binds."""

import dataclasses
import pathlib
import sys

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
import pytest

import offload_eqx as ox

EXPERIMENTS = pathlib.Path(__file__).resolve().parents[1] / "experiments"
sys.path.insert(0, str(EXPERIMENTS))
try:
    import _decoder as decoder  # pyright: ignore[reportMissingImports]
finally:
    sys.path.remove(str(EXPERIMENTS))

pytestmark = [pytest.mark.deviceless]

CONFIG = decoder.CONFIGS["tiny"]  # 3 layers, dim 64, ffn 128, 32 tokens
BATCH = 2
# `largest_models.FRUGAL`: parameters and state on the host, the update there, every
# activation recomputed but the layers' inputs, offloaded.
FRUGAL = ox.Strategy(
    "frugal", "pinned_host", "pinned_host", "remat", names={"block_input": "offload"}, update="host"
)
LAYER_LEAVES = ("attention_norm.weight", "wq", "wk", "wv", "wo", "mlp_norm.weight", "w_gate",
                "w_up", "w_down")  # fmt: skip


def _optimizer():
    adamw = optax.adamw(1e-4, weight_decay=0.01)
    return ox.offload_optimizer(adamw, update_on="host", delay=1, master_dtype=jnp.float32)


@pytest.fixture(scope="module")
def recipe():
    """The step under `FRUGAL`, its abstract arguments, and the model's leaves by path."""
    optimizer = _optimizer()
    model = eqx.filter_eval_shape(decoder.make_decoder, CONFIG, jax.random.key(0))
    model = jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype) if eqx.is_array(x) else x, model
    )
    state = eqx.filter_eval_shape(optimizer.init, model)
    tokens = jax.ShapeDtypeStruct((BATCH, CONFIG.seq + 1), jnp.int32)
    args = (model, state, tokens)
    return decoder.make_step(optimizer, FRUGAL), args, model


def _bytes(leaf) -> int:
    return leaf.size * jnp.dtype(leaf.dtype).itemsize


def test_audit_names_every_transfer_by_leaf_and_bytes_per_step(recipe):
    step, args, model = recipe
    transfers = ox.audit(step, *args).transfers
    assert not any(t.implicit for t in transfers)

    def moved(direction, kind, what, phase):
        found = [t for t in transfers if (t.direction, t.kind, t.what, t.phase) ==
                 (direction, kind, what, phase)]  # fmt: skip
        assert len(found) == 1, (direction, kind, what, phase, transfers)
        return found[0]

    layers = model.layers
    for name in LAYER_LEAVES:
        leaf = layers
        for part in name.split("."):
            leaf = getattr(leaf, part)
        per_layer = _bytes(leaf) // CONFIG.layers
        path = f"model.layers.{name}"
        # Fetched one layer at a time, in the forward pass and again in the recomputing
        # backward pass; its gradient sent to host memory layer by layer.
        for phase in ("forward", "backward"):
            fetch = moved("host-to-device", "parameter", path, phase)
            assert fetch.count == CONFIG.layers and fetch.where.startswith("scan[3]")
            assert fetch.bytes == per_layer * CONFIG.layers == _bytes(leaf)
        gradient = moved("device-to-host", "gradient", path, "backward")
        assert gradient.bytes == _bytes(leaf) and gradient.dtype == "bfloat16"
    # Each block's input leaves the device in the forward pass and comes back for the
    # backward pass: (batch, seq, dim) bfloat16 per layer.
    block_input = BATCH * CONFIG.seq * CONFIG.dim * 2 * CONFIG.layers
    assert moved("device-to-host", "activation", "block_input", "forward").bytes == block_input
    assert moved("host-to-device", "activation", "block_input", "backward").bytes == block_input
    # The host update: the bfloat16 gradients are all that reach the host (2 bytes per
    # parameter); the float32 masters and moments and the new parameters never cross.
    gradients = sum(t.bytes for t in transfers if t.kind == "gradient")
    assert gradients == 2 * CONFIG.parameters
    assert not [t for t in transfers if t.kind in ("optimizer", "update") or t.phase == "update"]
    kinds = {t.kind for t in transfers}
    assert kinds == {"parameter", "activation", "gradient"}, kinds


def test_memory_report_for_the_h100_reports_the_host_bytes(recipe):
    step, args, model = recipe
    report = ox.memory_report(step, *args, target="h100")
    host = report.as_dict()["host"]
    # In host memory: the bfloat16 parameters (2 bytes each), the float32 masters and
    # AdamW moments (12) and the pending gradients of the delayed update (2).
    assert host["argument"] == pytest.approx(16 * CONFIG.parameters, abs=64)
    # The host update writes its new state beside the old one (its outputs alias none of
    # the donated arguments, as compiled for the H100): the host holds both.
    assert host["output"] == pytest.approx(host["argument"], abs=64)
    assert report.host_total == host["temp"] + host["argument"] + host["output"] - host["alias"]
    # On the device no parameter and no state: the arguments are the tokens alone.
    assert report.as_dict()["device"]["argument"] < 1024
    assert report.fits


# The device holds neither the state nor the parameters with their optimizer state.
DEVICE_BUDGET = int(1.5 * 2**20)
# Every plan with the parameters on the host, updated there, needs at least what this one
# needs in host memory (it offloads nothing more).
PARAMETERS_ON_HOST = ox.Strategy("host", "pinned_host", "pinned_host", "remat", update="host")


@pytest.fixture(scope="module")
def host_bound(recipe):
    """`ox.fit` with a host budget a byte short of any plan with the parameters on the
    host: they must stay on the device, which leaves no room to save what the faster
    plans save there."""
    step, args, _ = recipe
    on_host = decoder.make_step(_optimizer(), PARAMETERS_ON_HOST)
    short = ox.memory_report(on_host, *args, target="h100")
    host_budget = short.host_total - 1
    result = ox.fit(step, *args, target="h100", device_budget=DEVICE_BUDGET,
                    host_budget=host_budget, max_compiles=4)  # fmt: skip
    return result, host_budget


# `ox.fit`'s search takes 170 s here under the tests' runtime type checks (22 traces, 4
# compiles): over the CI's 100 s per phase, so with `--full`.
@pytest.mark.full
def test_fit_says_the_host_budget_binds_when_it_does(host_bound):
    result, host_budget = host_bound
    assert result.host_budget == host_budget and result.device_budget == DEVICE_BUDGET
    assert result.strategy.params == "device"
    assert (result.estimate.host_bytes or 0) <= host_budget
    assert (result.estimate.device_bytes or 0) <= DEVICE_BUDGET
    assert "host" in result.binds
    # The plans with the parameters on the host, updated there, are over the host budget
    # (compiled, or bounded by what a compiled one of their placement needed).
    on_host = [c for c in result.candidates
               if (c.strategy.params, c.strategy.update) == ("pinned_host", "host")]  # fmt: skip
    assert any(c.status.startswith("over the host budget") for c in on_host)
    assert not any(c.status in ("fits", "best") for c in on_host)
    assert "host budget" in result.binding() and "bind" in result.binding()
    assert result.binding() in result.table()
    assert result.to_dict()["binds"] == list(result.binds)


@pytest.mark.full
def test_binds_reads_the_statuses_of_faster_plans(host_bound):
    """Which budget binds is which ruled out a plan the count predicts faster than the
    chosen one: over the device budget, or the host one, compiled or bounded."""
    fitted, _ = host_bound
    best = next(c for c in fitted.candidates if c.status == "best")

    def with_faster(*statuses):
        faster = [
            dataclasses.replace(best, label=f"faster {i}", seconds=best.seconds / 2, status=s)
            for i, s in enumerate(statuses)
        ]
        slower = dataclasses.replace(
            best, label="slower", seconds=best.seconds * 2, status="over the host budget by 1 B"
        )
        return dataclasses.replace(fitted, candidates=(best, *faster, slower))

    assert with_faster().binds == ()
    assert "neither budget binds" in with_faster().binding()
    assert with_faster("fits").binds == ()
    assert with_faster("over the device budget by 1.00 MiB").binds == ("device",)
    assert with_faster("not compiled: predicted to need 3 MiB of device memory").binds == (
        "device",
    )
    assert with_faster("not compiled: needs at least 9 MiB of host memory").binds == ("host",)
    both = with_faster("does not fit: the compiler ran out of device memory",
                       "over the host budget by 2 B")  # fmt: skip
    assert both.binds == ("device", "host")
    assert "the device and the host budgets bind (2 faster plans over it)" in both.binding()


def test_the_undelayed_recipe_writes_the_state_in_place_on_the_h100(recipe):
    """Not delayed, the host update is one host call per parameter, the state donated:
    every host output aliases its argument, and the host holds less than the delayed
    recipe, whose one call writes every result beside the state."""
    _, args, model = recipe
    adamw = optax.adamw(1e-4, weight_decay=0.01)
    opt = ox.offload_optimizer(adamw, update_on="host", master_dtype=jnp.float32)
    state = eqx.filter_eval_shape(opt.init, model)
    step = decoder.make_step(opt, FRUGAL)
    undelayed = ox.memory_report(step, model, state, args[2], target="h100")
    delayed = ox.memory_report(recipe[0], *args, target="h100")
    assert undelayed.host["alias"] == undelayed.host["output"] > 0, dict(undelayed.host)
    assert delayed.host["alias"] == 0, dict(delayed.host)
    assert undelayed.host_total < 0.6 * delayed.host_total


def test_the_delayed_recipe_in_slices_holds_the_state_once_on_the_h100(recipe):
    """Delayed and computed whole (`update="host"`), the one host call overlaps the
    passes and writes every result beside the state (alias 0); in slices
    (`update="host_sliced"`), written back over the donated state, every host output
    aliases its argument and the host holds the state once plus the pending gradients."""
    _, args, _ = recipe
    sliced = dataclasses.replace(FRUGAL, name="frugal sliced", update="host_sliced")
    step = decoder.make_step(_optimizer(), sliced)
    report = ox.memory_report(step, *args, target="h100")
    whole = ox.memory_report(recipe[0], *args, target="h100")
    assert report.host["alias"] == report.host["argument"] > 0, dict(report.host)
    assert report.host_total <= 1.3 * report.host["argument"], dict(report.host)
    assert whole.host["alias"] == 0 and whole.host_total > 1.8 * whole.host["argument"]


def test_max_batch_stops_where_the_offloaded_layer_inputs_fill_the_host(recipe):
    """Each block's input is offloaded, so the host total grows with the batch: with the
    host budget at batch 2's total, batch 3 is over it while the device has room."""
    step, (model, state, _), _ = recipe

    def make_args(batch):
        return model, state, jax.ShapeDtypeStruct((batch, CONFIG.seq + 1), jnp.int32)

    at = {b: ox.memory_report(step, *make_args(b), target="h100") for b in (2, 3)}
    assert at[3].host_total > at[2].host_total and at[3].fits
    probes = []
    batch = ox.max_batch(step, make_args, target="h100", host_budget=at[2].host_total,
                         start=2, probes=probes)  # fmt: skip
    assert batch == 2
    assert {p["batch"]: p["host_total"] for p in probes}[2] == at[2].host_total
