"""`ox.estimate` and per-name strategies, on the CPU.

The model is the experiments' decoder (`experiments/_decoder.py`: RMSNorm, rotary
attention, SwiGLU, `ox.scan` over stacked layers), not one written for these tests; its
FLOPs are derived by hand below and compared with what the trace counts.
"""

import dataclasses
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from beartype import beartype
from jaxtyping import Array, Int, jaxtyped

import offload_eqx as ox
from offload_eqx._planning import traced_time
from offload_eqx._planning.traced_time import Load, predict, speeds_of
from offload_eqx._targets.targets import Speeds

EXPERIMENTS = pathlib.Path(__file__).resolve().parents[1] / "experiments"
sys.path.insert(0, str(EXPERIMENTS))
try:
    import _decoder as decoder  # pyright: ignore[reportMissingImports]
finally:
    sys.path.remove(str(EXPERIMENTS))

CONFIG = decoder.Config("test", vocab=96, dim=32, ffn=64, layers=3, heads=4, seq=16)
BATCH = 2
SHAPES = {"B": BATCH, "S": CONFIG.seq + 1}


def forward_flops(c=CONFIG, b=BATCH) -> int:
    """Matmul FLOPs of one forward pass: per layer the q, k, v, o projections (4 d^2), the
    SwiGLU's gate, up and down (3 d f), the scores and the weighted sum (2 S^2 d each
    counted as 2 B S S d); the head's unembedding (d V). The embedding is a gather."""
    tokens = b * c.seq
    layer = 2 * tokens * (4 * c.dim**2 + 3 * c.dim * c.ffn) + 2 * 2 * b * c.seq**2 * c.dim
    return c.layers * layer + 2 * tokens * c.dim * c.vocab


def recompute_flops(c=CONFIG, b=BATCH) -> int:
    """What full remat recomputes in the backward pass: each layer's forward but the down
    projection (its output feeds only the residual add, whose derivative needs nothing);
    the head's region recomputes its norm only (the unembedding's output is not needed)."""
    tokens = b * c.seq
    return c.layers * (2 * tokens * (4 * c.dim**2 + 2 * c.dim * c.ffn) + 4 * b * c.seq**2 * c.dim)


@pytest.fixture(scope="module")
def state():
    model = decoder.make_decoder(CONFIG, jax.random.key(0), dtype=jnp.float32)
    optimizer = decoder.make_optimizer()
    return optimizer, model, optimizer.init(model)


@jaxtyped(typechecker=beartype)
def make_tokens() -> Int[Array, "B S"]:
    return jnp.zeros((BATCH, CONFIG.seq + 1), jnp.int32)


def _estimate(state, strategy, **kwargs):
    optimizer, model, opt_state = state
    step = decoder.make_step(optimizer, strategy)
    return ox.estimate(step, model, opt_state, make_tokens(), target="cpu", **kwargs)


def test_baseline_flops_are_three_forward_passes(state):
    # Every matmul's two operands are differentiated (the embedding is trained), so the
    # backward pass runs two matmuls of the forward's size for each.
    estimate = _estimate(state, ox.STRATEGIES["baseline"], compile=False)
    assert estimate.recompute_flops == 0
    assert estimate.flops == pytest.approx(3 * forward_flops(), rel=0.03)
    assert estimate.h2d_bytes == estimate.d2h_bytes == 0


def test_full_remat_adds_the_recomputed_forward(state):
    estimate = _estimate(state, ox.STRATEGIES["remat"], compile=False)
    assert estimate.recompute_flops == pytest.approx(recompute_flops(), rel=0.03)
    assert estimate.flops == pytest.approx(3 * forward_flops() + recompute_flops(), rel=0.03)


def test_offloaded_bytes_are_exact(state):
    # q, k, v: (B, S, d) float32 per layer, down in the forward pass and up in the backward.
    strategy = ox.Strategy(
        "qkv", "device", "device", "remat", names={"q": "offload", "k": "offload", "v": "offload"}
    )
    estimate = _estimate(state, strategy, compile=False)
    expected = 3 * BATCH * CONFIG.seq * CONFIG.dim * 4 * CONFIG.layers
    assert estimate.d2h_bytes == expected
    assert estimate.h2d_bytes == expected
    assert estimate.phases["forward"].d2h > 0 and estimate.phases["backward"].h2d > 0
    # Offloading q, k, v spares recomputing their projections (and nothing else).
    remat = _estimate(state, ox.STRATEGIES["remat"], compile=False)
    projections = 3 * 2 * BATCH * CONFIG.seq * CONFIG.dim**2 * CONFIG.layers
    assert remat.recompute_flops - estimate.recompute_flops == pytest.approx(projections)


def test_estimate_reports_memory_and_prints(state):
    estimate = _estimate(state, ox.STRATEGIES["baseline"])
    assert estimate.device_bytes is not None and estimate.device_bytes > 0
    assert estimate.seconds > 0 and 0 < estimate.mfu() <= 1
    text = str(estimate)
    assert "baseline" in text and "forward" in text and "backward" in text
    assert estimate.to_dict()["flops"] == estimate.flops


def _load(compute, down=0.0, up=0.0, chunk_down=0.0, chunk_up=0.0, phase=0) -> Load:
    sums = np.zeros((3, 4))
    chunks = np.zeros((3, 2))
    sums[phase] = [compute, 0.0, down, up]
    chunks[phase] = [chunk_down, chunk_up]
    return Load(sums, chunks, np.zeros(2), 0.0, 0.0)


SPEEDS = Speeds(
    flops=1e12,
    efficiency=1.0,
    memory_bandwidth=1e11,
    h2d_bandwidth=1e9,
    d2h_bandwidth=2e9,
    host_flops=1e11,
    host_bandwidth=1e10,
    host_memory=2**40,
)


def test_time_model_overlaps_compute_and_both_link_directions():
    # 1 s of compute, 2 GB down (2 s at 1 GB/s) in 10 chunks, 2 GB up (1 s at 2 GB/s): the
    # phase takes the longest (2 s) plus the chunks that cannot hide (0.2 s + 0.1 s).
    seconds, phases = predict(_load(1.0, 2e9, 2e9, 2e8, 2e8), SPEEDS)
    assert phases["forward"].h2d == pytest.approx(2.0)
    assert phases["forward"].d2h == pytest.approx(1.0)
    assert seconds == pytest.approx(2.0 + 0.2 + 0.1)
    # Compute-bound: the copies hide but for their first and last chunks.
    seconds, _ = predict(_load(5.0, 2e9, 0.0, 2e8), SPEEDS)
    assert seconds == pytest.approx(5.2)
    # Phases add up.
    both = _load(1.0) + (_load(3.0, phase=1) - _load(0.0))
    assert predict(both, SPEEDS)[0] == pytest.approx(4.0)


def test_cpu_speeds_are_measured():
    speeds = speeds_of(ox.TARGETS["cpu"])
    assert speeds.flops > 1e8 and speeds.memory_bandwidth > 1e8
    assert speeds.h2d_bandwidth > 1e7 and speeds.host_memory > 2**30


def _never_measured(monkeypatch) -> list:
    """Record every measurement of the CPU's speeds (a second or more each)."""
    measured = []
    monkeypatch.setattr(traced_time, "cpu_speeds", lambda: measured.append(1) or SPEEDS)
    return measured


def test_a_wrong_call_fails_before_the_cpu_is_measured(monkeypatch):
    measured = _never_measured(monkeypatch)
    w = jnp.ones((4, 4))
    with pytest.raises(TypeError, match="missing 1 required positional argument: 'x'"):
        ox.estimate(lambda w, x: jnp.sum(w @ x), w, target="cpu")
    with pytest.raises(TypeError, match="dot_general requires contracting dimensions"):
        ox.estimate(lambda w, x: jnp.sum(w @ x), w, jnp.ones((3,)), target="cpu")
    assert not measured
    # A right call is priced at the (here recorded) speeds.
    assert ox.estimate(lambda w, x: jnp.sum(w @ x), w, w, target="cpu", compile=False).flops
    assert measured


def test_every_gpu_and_tpu_target_has_speeds():
    for target in ox.TARGETS.values():
        if target.platform != "cpu":
            assert target.speeds is not None, target.name
            assert target.speeds.source


# -- per-name strategies -----------------------------------------------------------------


def test_strategy_names_override_the_mode():
    strategy = ox.Strategy("s", activations="save", names={"q": "offload"})
    assert strategy.names == (("q", "offload"),)
    assert strategy.policy_of("q", "remat") == "offload"
    assert strategy.policy_of("k", "offload") == "save"
    assert ox.Strategy("a", names={"q": "offload"}).policy_of("k", "remat") == "remat"
    assert hash(strategy) == hash(ox.Strategy("s", activations="save", names=[("q", "offload")]))


def test_strategy_names_reject_bad_policies():
    with pytest.raises(ValueError, match=r"'q' the policy 'host'.*'save', 'offload', 'remat'"):
        ox.Strategy("s", names={"q": "host"})
    with pytest.raises(ValueError, match="mapping of activation names to policies"):
        ox.Strategy("s", names=3)


def test_strategy_name_nobody_declares_is_an_error(state):
    optimizer, model, opt_state = state
    step = decoder.make_step(optimizer, ox.Strategy("typo", names={"qq": "offload"}))
    with pytest.raises(ValueError, match=r"'qq'.*no module of this step declares it.*'k', 'q'"):
        step(model, opt_state, make_tokens())


def test_per_name_policies_train_like_the_baseline(state):
    optimizer, model, opt_state = state
    tokens = jax.random.randint(jax.random.key(2), (BATCH, CONFIG.seq + 1), 0, CONFIG.vocab)

    def loss_after_two(strategy):
        # The step donates its arguments: each strategy trains its own copy.
        step = decoder.make_step(optimizer, strategy)
        m, s = jax.tree.map(jnp.copy, (model, opt_state))
        for _ in range(2):
            m, s, loss = step(m, s, tokens)
        return float(loss)

    mixed = ox.Strategy(
        "mixed", "pinned_host", "pinned_host", "remat", names={"q": "offload", "k": "save"}
    )
    assert loss_after_two(mixed) == pytest.approx(
        loss_after_two(ox.STRATEGIES["baseline"]), rel=1e-5
    )


def test_host_parameters_under_full_remat_audit_clean(state):
    # The embedding's gathered rows (B x S x d, more elements than the table here) are
    # not the table's device copy: keeping them for the backward pass keeps no leaf.
    optimizer, model, opt_state = state
    step = decoder.make_step(optimizer, ox.Strategy("r", "pinned_host", "device", "remat"))
    report = ox.audit(step, model, opt_state, make_tokens())
    assert report.total("h2d", what="model.embedding.weight") > 0


def test_estimate_dataclass_is_frozen(state):
    estimate = _estimate(state, ox.STRATEGIES["baseline"], compile=False)
    with pytest.raises(dataclasses.FrozenInstanceError):
        estimate.seconds = 0.0  # type: ignore[misc]


def test_while_loop_is_counted_once_and_said_so():
    def fn(w, x):
        def body(carry):
            i, y = carry
            return i + 1, jnp.tanh(y @ w)

        return jax.lax.while_loop(lambda c: c[0] < 5, body, (0, x))[1]

    w = jnp.ones((16, 16))
    x = jnp.ones((4, 16))
    estimate = ox.estimate(fn, w, x, target="cpu", compile=False)
    assert estimate.flops == 2 * 4 * 16 * 16
    assert estimate.notes and "while loop counted once" in estimate.notes[0][1]
    assert "while loop counted once" in str(estimate)
