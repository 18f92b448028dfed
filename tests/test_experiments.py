"""The experiments' own pieces: the decoder trains equally under every strategy, and the
batch search finds the largest batch of a known memory line.

The decoder is `experiments/_decoder.py`, imported as the experiments import it (the
directory on `sys.path`); the search is `experiments/_batch_search.py`, given a measurement
that needs no compiler.
"""

import pathlib
import sys

import jax
import jax.numpy as jnp
import pytest

EXPERIMENTS = pathlib.Path(__file__).resolve().parents[1] / "experiments"


@pytest.fixture(scope="module")
def experiments():
    sys.path.insert(0, str(EXPERIMENTS))
    try:
        import _batch_search  # pyright: ignore[reportMissingImports]
        import _decoder  # pyright: ignore[reportMissingImports]
    finally:
        sys.path.remove(str(EXPERIMENTS))
    return _decoder, _batch_search


@pytest.mark.parametrize("strategy", ["hybrid"])
def test_tiny_decoder_losses_equal_the_baseline(experiments, strategy):
    decoder, _ = experiments
    config = decoder.CONFIGS["tiny"]
    tokens = jax.random.randint(jax.random.key(1), (2, config.seq + 1), 0, config.vocab)

    def losses(name):
        optimizer = decoder.optimizer_for(name, config)
        model = decoder.make_decoder(config, jax.random.key(0), dtype=jnp.float32)
        opt_state = optimizer.init(model)
        step = decoder.make_step(optimizer, decoder.STRATEGIES[name])
        history = []
        for _ in range(2):
            model, opt_state, loss = step(model, opt_state, tokens)
            history.append(float(loss))
        return history

    baseline, ours = losses("no_remat"), losses(strategy)
    assert baseline[1] < baseline[0]  # it trains
    assert ours == pytest.approx(baseline, rel=1e-5)


def _linear(capacity: int, fixed: int, per_batch: int):
    probed = []

    def measure_at(batch: int) -> dict:
        probed.append(batch)
        total = fixed + per_batch * batch
        return {"batch": batch, "fits": total <= capacity, "total": total, "compile_s": 0.0}

    return measure_at, probed


def test_batch_search_finds_the_largest_batch_of_a_line(experiments):
    _, search = experiments
    measure_at, probed = _linear(capacity=100, fixed=10, per_batch=3)  # fits up to 30
    result = search.largest_batch(measure_at, 100, measure_at(1), budget=10)
    assert result["max_batch"] == 30
    assert result["exact"]
    assert result["predicted"] == 30
    assert result["total_at_max"] == 100
    assert len(probed) <= 11 and len(set(probed)) == len(probed)


def test_batch_search_with_a_small_budget_says_at_least(experiments):
    _, search = experiments
    measure_at, probed = _linear(capacity=100, fixed=10, per_batch=3)
    result = search.largest_batch(measure_at, 100, measure_at(1), budget=1)
    assert result["max_batch"] == 2 and not result["exact"]
    assert result["predicted"] == 30  # the line through batch 1 and 2
    assert probed == [1, 2]


def test_the_audit_of_every_decoder_step_raises_nothing(experiments):
    """Zero false alarms on our own code: the experiment's step under each of its
    strategies (the layer-streamed optimizer's slices of host arrays included)."""
    import offload_eqx as ox

    decoder, _ = experiments
    config = decoder.CONFIGS["tiny"]
    tokens = jax.random.randint(jax.random.key(1), (2, config.seq + 1), 0, config.vocab)
    for name, strategy in decoder.STRATEGIES.items():
        optimizer = decoder.optimizer_for(name, config)
        model = ox.place(decoder.make_decoder(config, jax.random.key(0)), strategy)
        opt_state = ox.place(optimizer.init(model), strategy)
        step = decoder.make_step(optimizer, strategy)
        report = ox.audit(step, model, opt_state, tokens)
        report.assert_no_implicit()
        assert not report.violations, (name, report.violations)
