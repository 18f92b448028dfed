"""`ox.fit` against the real XLA:GPU compiler for an H100 (deviceless).

The model is the experiments' decoder (`experiments/_decoder.py`), small enough that a
compile takes a second; the budgets are set from its own compiled memory, so that the
baseline does not fit and something else must be chosen.
"""

import pathlib
import sys

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest

import offload_eqx as ox

pytestmark = pytest.mark.deviceless

EXPERIMENTS = pathlib.Path(__file__).resolve().parents[1] / "experiments"
sys.path.insert(0, str(EXPERIMENTS))
try:
    import _decoder as decoder  # pyright: ignore[reportMissingImports]
finally:
    sys.path.remove(str(EXPERIMENTS))

CONFIG = decoder.Config("test", vocab=512, dim=128, ffn=384, layers=4, heads=4, seq=128)
BATCH = 16
FIXED = [
    "baseline",
    "remat",
    "offload_activations",
    "offload_params",
    "offload_optimizer",
    "hybrid",
]


@pytest.fixture(scope="module")
def problem():
    model, opt_state = decoder.abstract_state(CONFIG)
    tokens = jax.ShapeDtypeStruct((BATCH, CONFIG.seq + 1), jnp.int32)
    optimizer = decoder.make_optimizer()
    return optimizer, (model, opt_state, tokens)


def _step(problem, strategy):
    return decoder.make_step(problem[0], strategy)


@pytest.fixture(scope="module")
def fixed_estimates(problem):
    """Every fixed strategy's estimate (compiled), by name."""
    return {
        name: ox.estimate(_step(problem, ox.STRATEGIES[name]), *problem[1], target="h100")
        for name in FIXED
    }


def test_ample_budget_recomputes_and_offloads_nothing(problem):
    result = ox.fit(_step(problem, "annotated"), *problem[1], target="h100")
    assert result.estimate.recompute_flops == 0
    assert result.estimate.h2d_bytes == result.estimate.d2h_bytes == 0
    assert result.strategy.activations == "save"
    assert (result.strategy.params, result.strategy.optimizer) == ("device", "device")
    assert result.compiles <= 12
    # The scan's carry is named but never offered: the scan keeps it anyway.
    assert any("'block_input' is the carry" in note for note in result.notes)
    # A part that cannot be searched is explained by its error's whole first sentence.
    for note in result.notes:
        if note.startswith("Not searched"):
            assert not note.endswith((" and.", " of it.", " the.")), note
    # The update on the host (state in host memory, only gradients and updates moving)
    # is priced like every other placement.
    host = [c for c in result.candidates if c.strategy.update == "host"]
    assert host and all(c.strategy.optimizer == "pinned_host" for c in host)
    assert all(c.seconds > 0 for c in host)


def test_tight_budget_fits_and_beats_every_fixed_strategy_that_fits(problem, fixed_estimates):
    baseline = fixed_estimates["baseline"].device_bytes
    least = min(e.device_bytes for e in fixed_estimates.values())
    budget = (baseline + least) // 2
    assert baseline > budget
    lines = []
    result = ox.fit(
        _step(problem, "baseline"), *problem[1], target="h100", device_budget=budget,
        progress=lines.append,
    )  # fmt: skip
    assert result.estimate.device_bytes <= budget
    # What `ox.fit` returns is what `ox.filter_jit` compiles under its strategy.
    again = ox.estimate(_step(problem, result.strategy), *problem[1], target="h100")
    assert again.device_bytes == result.estimate.device_bytes
    assert again.seconds == pytest.approx(result.estimate.seconds)
    for name, estimate in fixed_estimates.items():
        if estimate.device_bytes <= budget:
            assert result.estimate.seconds <= estimate.seconds * (1 + 1e-9), name
    assert lines and "compiled" in lines[-1] and "best so far" in lines[-1]
    assert sum(c.status == "best" for c in result.candidates) == 1
    assert "best" in result.table()


def test_impossible_budget_names_the_least_memory_found(problem, fixed_estimates):
    with pytest.raises(ValueError, match=r"no plan of this step fits 'h100'") as error:
        ox.fit(_step(problem, "baseline"), *problem[1], target="h100", device_budget=1024)
    # A measured memory, at most what the smallest fixed strategy needs, and its plan.
    message = str(error.value)
    assert "The least device memory found was" in message and "0 B (" not in message
    assert "by the plan remat[" in message or "by the plan save[" in message


def test_host_budget_rules_out_host_placements(problem, fixed_estimates):
    baseline = fixed_estimates["baseline"].device_bytes
    result = ox.fit(
        _step(problem, "baseline"), *problem[1], target="h100",
        device_budget=baseline // 2, host_budget=0,
    )  # fmt: skip
    assert result.estimate.host_bytes == 0
    assert (result.strategy.params, result.strategy.optimizer) == ("device", "device")
    assert "offload" not in dict(result.strategy.names).values()


# -- plans between all and nothing (issue 19) ----------------------------------------------


def _all_or_nothing(strategy) -> bool:
    """No name split over layers, no placement leaf by leaf."""
    whole = all(isinstance(policy, str) for _, policy in strategy.names)
    return whole and isinstance(strategy.params, str) and isinstance(strategy.optimizer, str)


def _placement(strategy) -> tuple:
    return (strategy.activations, strategy.params, strategy.optimizer, strategy.update)


def _keeps_at_least(plan, other) -> bool:
    """`plan` saves every name `other` saves (both all-or-nothing)."""
    saved = {n for n, policy in plan.names if policy == "save"}
    return {n for n, policy in other.names if policy == "save"} <= saved


def _estimate(problem, **strategy):
    return ox.estimate(
        _step(problem, ox.Strategy("s", activations="remat", **strategy)), *problem[1],
        target="h100",
    )  # fmt: skip


@pytest.fixture(scope="module")
def between(problem):
    """A budget between the plan that recomputes everything with everything on the device
    (which does not fit) and that plan with parameters and state on the host (which
    does), and what `ox.fit` returns for it."""
    on_device = _estimate(problem, params="device", optimizer="device")
    on_host = _estimate(problem, params="pinned_host", optimizer="pinned_host")
    assert on_device.device_bytes is not None and on_host.device_bytes is not None
    assert on_host.device_bytes < on_device.device_bytes
    budget = (on_device.device_bytes + on_host.device_bytes) // 2
    result = ox.fit(_step(problem, "annotated"), *problem[1], target="h100", device_budget=budget)
    return budget, result


def test_budget_between_all_or_nothing_plans_is_filled_by_a_fractional_plan(
    problem, fixed_estimates, between
):
    budget, result = between
    assert not _all_or_nothing(result.strategy), result.strategy
    assert result.estimate.device_bytes <= budget
    # It is what `ox.filter_jit` compiles under that strategy.
    again = ox.estimate(_step(problem, result.strategy), *problem[1], target="h100")
    assert again.device_bytes == result.estimate.device_bytes
    # Faster than every all-or-nothing plan that fits: those the search compiled, and the
    # fixed strategies.
    whole = [
        c for c in result.candidates
        if _all_or_nothing(c.strategy) and c.device_bytes is not None
        and c.device_bytes <= budget
    ]  # fmt: skip
    assert whole
    for candidate in whole:
        assert result.estimate.seconds < candidate.seconds, candidate.label
    for name, estimate in fixed_estimates.items():
        if estimate.device_bytes <= budget:
            assert result.estimate.seconds < estimate.seconds, name
    assert result.compiles <= 12


def test_a_plan_that_does_not_fit_prunes_its_family_after_one_compile(between):
    budget, result = between
    compiled = [c for c in result.candidates if c.device_bytes is not None]
    pruned = [c for c in result.candidates if c.status.startswith("not compiled: keeps")]
    assert len(pruned) > 5 * len(compiled)  # most of the search was learned, not compiled
    for index, over in enumerate(compiled):
        if over.device_bytes <= budget or not _all_or_nothing(over.strategy):
            continue
        for later in compiled[index + 1 :]:
            if _all_or_nothing(later.strategy) and _placement(later.strategy) == _placement(
                over.strategy
            ):
                assert not _keeps_at_least(later.strategy, over.strategy), (
                    f"{later.label} was compiled although {over.label} did not fit"
                )


def test_compiles_running_out_says_so_and_names_what_is_untried(problem, between):
    budget, _ = between
    with pytest.raises(ValueError, match=r"no plan of this step fits") as error:
        ox.fit(
            _step(problem, "annotated"), *problem[1], target="h100", device_budget=budget,
            max_compiles=2,
        )  # fmt: skip
    message = str(error.value)
    assert "The 2 compiles allowed ran out with" in message
    assert "plans untried that might fit" in message and "the fastest: remat[" in message
    assert "Raise `max_compiles`" in message
    assert "lower the batch" not in message  # nothing showed that no plan fits


def test_compiler_crashes_are_listed_and_not_taken_for_no_fit(problem, between, monkeypatch):
    import offload_eqx._fit.search as fit_search

    real = fit_search.memory_report

    def crashes_on_host_params(step, *args, **kwargs):
        if step.strategy.params != "device":
            raise RuntimeError("INTERNAL: Mosaic failed on a host layout")
        return real(step, *args, **kwargs)

    monkeypatch.setattr(fit_search, "memory_report", crashes_on_host_params)
    budget, _ = between
    with pytest.raises(ValueError, match=r"no plan of this step fits") as error:
        ox.fit(_step(problem, "annotated"), *problem[1], target="h100", device_budget=budget)
    message = str(error.value)
    assert "compile failed: RuntimeError: INTERNAL: Mosaic failed" in message
    assert "lower the batch" not in message
    # Two crashes of one placement rule out the rest of it: the compiles go elsewhere.
    crashes = message.count("compile failed: RuntimeError")
    placements = {"params=pinned_host optimizer=pinned_host", "params=pinned_host optimizer=host"}
    assert 2 <= crashes <= 2 * len(placements)
    assert "were not compiled because plans of the same placement crashed" in message


def test_an_unsearched_part_is_explained_by_a_whole_sentence():
    from offload_eqx._fit.price import _first_sentence

    long = "Activation 'k' is declared 'offload' " + "and more " * 30 + "here. Then a fix."
    assert _first_sentence("Short one. Second.") == "Short one"
    cut = _first_sentence(long, limit=100)
    assert cut.endswith(" ...") and len(cut) <= 104 and "Then" not in cut
    assert _first_sentence(long) == long.split(". ")[0]


def test_an_optimizer_declared_on_the_host_is_searched_on_the_device_where_the_target_cannot():
    """An optimizer made with `update_on="host"` ran its update on the host under every
    plan `ox.fit` tried, and XLA:TPU refuses host computations: every compile failed and
    fit said "no plan fits" (issue 26, item 9). The search decides where the update runs."""
    tiny = decoder.Config("tiny", vocab=64, dim=32, ffn=64, layers=2, heads=2, seq=16)
    model, opt_state = decoder.abstract_state(tiny, "hybrid_host_update")
    tokens = jax.ShapeDtypeStruct((2, tiny.seq + 1), jnp.int32)
    step = decoder.make_step(decoder.make_optimizer(update_on="host"), "annotated")
    result = ox.fit(step, model, opt_state, tokens, target="tpu-v5p", max_compiles=2)
    assert result.strategy.update == "device"
    with pytest.raises(ValueError, match=r"target 'tpu-v5p' does not support"):
        ox.estimate(step, model, opt_state, tokens, target="tpu-v5p", compile=False)


class _Twelve(eqx.Module):
    """Twelve named activations in one region: 3^12 combinations under the remat base."""

    ws: jax.Array = ox.field(memory="device")
    activations: ox.Activations = ox.activations(**{f"a{i}": "save" for i in range(12)})

    def __call__(self, x):
        def body(x):
            for i in range(12):
                x = ox.name(jnp.tanh(x @ self.ws[i]), f"a{i}")
            return x

        return ox.checkpoint(body, x)


def test_twelve_names_are_searched_along_a_frontier_not_every_combination():
    """12 declared names made 1,062,888 candidates (76-106 s, +3.6 GiB); the candidates
    now grow with the names (issue 26, item 11)."""
    model = _Twelve(jax.ShapeDtypeStruct((12, 64, 64), jnp.float32))  # pyright: ignore[reportArgumentType]
    x = jax.ShapeDtypeStruct((32, 64), jnp.float32)

    @ox.filter_jit
    def step(model, x):
        return eqx.filter_grad(lambda m: jnp.sum(m(x)))(model)

    result = ox.fit(step, model, x, target="h100", max_compiles=2)
    assert len(result.candidates) <= 4 * (12 + 2)
    assert any("along a frontier" in note for note in result.notes)
