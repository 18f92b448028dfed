"""The experiments' own pieces: the decoder trains equally under every strategy, and its
step raises no audit alarm.

The decoder is `experiments/_decoder.py`, imported as the experiments import it (the
directory on `sys.path`). The largest-batch search the decoder experiment uses is
`ox.max_batch`, tested in `test_max_batch.py`.
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
        import _decoder  # pyright: ignore[reportMissingImports]
    finally:
        sys.path.remove(str(EXPERIMENTS))
    return _decoder


@pytest.mark.parametrize("strategy", ["hybrid"])
def test_tiny_decoder_losses_equal_the_baseline(experiments, strategy):
    decoder = experiments
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


def test_the_audit_of_every_decoder_step_raises_nothing(experiments):
    """Zero false alarms on our own code: the experiment's step under each of its
    strategies (the layer-streamed optimizer's slices of host arrays included)."""
    import offload_eqx as ox

    decoder = experiments
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


@pytest.fixture(scope="module")
def planner():
    sys.path.insert(0, str(EXPERIMENTS))
    try:
        import _planner_report  # pyright: ignore[reportMissingImports]
        import _repricing  # pyright: ignore[reportMissingImports]
        import planner  # pyright: ignore[reportMissingImports]
    finally:
        sys.path.remove(str(EXPERIMENTS))
    planner.report, planner.repricing = _planner_report, _repricing
    return planner


class _Priced:
    """Stands for an `ox.StepEstimate`: `seconds` is a function of the host link, and
    `with_speeds` prices the same program again at other speeds."""

    def __init__(self, speeds, seconds_at):
        self.speeds, self.seconds_at = speeds, seconds_at
        self.seconds = seconds_at(speeds.h2d_bandwidth)

    def with_speeds(self, **changes):
        import dataclasses

        return _Priced(dataclasses.replace(self.speeds, **changes), self.seconds_at)


def test_planner_reprices_by_simulating_again(planner):
    """The planner's re-pricing: the same compiled program at another link (both
    directions scaled alike), nothing overlapped, the link bandwidth where offloading
    stops paying, and the Pareto front."""
    import offload_eqx as ox

    speeds = ox.TARGETS["tpu-v5p"].speeds  # 32 GB/s each way
    assert speeds is not None
    nominal = speeds.h2d_bandwidth
    # Offloaded: 1 s of compute hiding 0.5 s of copies (at 32 GB/s), 0.01 s exposed, and
    # a 0.2 s update; full remat: 1.2 s of compute and the update.
    offloaded = _Priced(speeds, lambda bw: max(1.0, 0.5 * nominal / bw) + 0.01 * nominal / bw + 0.2)
    remat = _Priced(speeds, lambda bw: 1.4)
    slower = planner.repricing.at_link(offloaded, nominal / 4)
    assert slower.speeds.d2h_bandwidth == pytest.approx(speeds.d2h_bandwidth / 4)
    assert slower.seconds == pytest.approx(2.0 + 0.04 + 0.2)
    # Offloading pays while 0.5 s + 0.01 s of copies, scaled by 32 GB/s / bandwidth, stay
    # under the 1.2 s that recomputing takes: down to 32 x 0.51 / 1.2 GB/s.
    assert planner.repricing.break_even(offloaded, remat) == pytest.approx(32 * 0.51 / 1.2, 0.03)
    zero = {"compute": 0.0, "h2d": 0.0, "d2h": 0.0, "host": 0.0}
    phases = {"forward": {**zero, "compute": 1.0, "h2d": 0.5, "d2h": 0.5}, "update": zero}
    assert planner.repricing.no_overlap(phases) == pytest.approx(2.0)
    assert planner.report.pareto([(1, 5), (2, 3), (3, 4), (4, 1)]) == [(1, 5), (2, 3), (4, 1)]


def test_planner_describes_the_fraction_a_plan_splits(planner, experiments):
    """What the planner prints of a fractional plan: a name's layers, and the share of
    parameter bytes on the host when they are placed leaf by leaf."""
    import offload_eqx as ox

    decoder = experiments
    config = decoder.CONFIGS["tiny"]
    model, opt_state = decoder.abstract_state(config, "full_remat")
    optimizer = decoder.optimizer_for("full_remat", config)
    tokens = jax.ShapeDtypeStruct((2, config.seq + 1), jnp.int32)
    strategy = ox.Strategy(
        "split", params={"*.w_up": "pinned_host", "*": "device"}, optimizer="pinned_host",
        activations="remat", names={"q": ("save", 2, "offload")},
    )  # fmt: skip
    step = decoder.make_step(optimizer, strategy)
    text = planner.fraction(strategy, step, (model, opt_state, tokens), config.layers)
    up = model.layers.w_up
    total = sum(
        leaf.size * leaf.dtype.itemsize
        for leaf in jax.tree_util.tree_leaves(model)
        if isinstance(leaf, jax.ShapeDtypeStruct)
    )
    share = up.size * up.dtype.itemsize / total
    assert text.startswith("q save in 2 of 3 layers, offload in the rest; parameters ")
    assert f"parameters {share:.0%} on the host (1 of " in text
    assert "state" not in text  # all of it in one place
    whole = ox.Strategy("whole", params="pinned_host", optimizer="pinned_host")
    assert planner.fraction(whole, step, (model, opt_state, tokens), 3) == "all or nothing"


def test_the_planner_figure_draws_one_pricing(planner):
    """The smoke run's figure drew ox.fit's plan at its jaxpr count (334 ms) beside the
    presets at their compiled simulation (full_remat 253 ms), so it showed the planner
    choosing a plan slower than two presets that the table put behind it. Every mark is
    now at the simulation; a plan compiled over a budget has none (its memory only), and
    the candidates priced by the count alone are counted, not drawn."""
    gb = 1e9
    result = {
        "candidates": [
            {"compiled_by": "ox.fit", "status": "best", "seconds": 0.334,
             "simulated_seconds": 0.248, "device_bytes": 14.8 * gb},
            {"compiled_by": "ox.fit", "status": "over the device budget by 1 GiB",
             "seconds": 0.2, "simulated_seconds": None, "device_bytes": 90 * gb},
            {"compiled_by": "planner", "status": "not compiled", "seconds": 0.3,
             "simulated_seconds": None, "device_bytes": 13.2 * gb},
            {"compiled_by": None, "status": "not compiled", "seconds": 0.1},
        ],
        "presets": [
            {"plan": "full_remat", "device": 13.2 * gb, "seconds": 0.253, "fits": True},
            {"plan": "minimal", "device": 95 * gb, "seconds": 0.2, "fits": False},
            {"plan": "ox.fit", "device": 14.8 * gb, "seconds": 0.248, "fits": True},
        ],
    }  # fmt: skip
    marks, hidden = planner.report.marks_of(result)
    assert hidden == 1
    assert marks == [
        ("best", 14.8, pytest.approx(248.0)),
        ("over", 90.0, None),
        ("preset", 13.2, pytest.approx(253.0)),
        ("preset over", 95.0, pytest.approx(200.0)),
    ]
