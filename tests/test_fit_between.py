"""`ox.fit` between all-or-nothing plans (deviceless H100): a budget between the plan
that keeps everything on the device and the one with parameters and state on the host is
filled by a plan in between, found by bisection over compiles; and what the search says
when its compiles run out or the compiler crashes."""

import dataclasses

import pytest
from fit_problem import fixed_estimates_of, make_problem, step_of

import offload_eqx as ox

# The worker that runs `test_fit.py` runs these too: the problem, the fixed strategies'
# estimates and every program compiled for them are shared (compiled once per process).
pytestmark = [pytest.mark.deviceless, pytest.mark.xdist_group("test_fit")]


@pytest.fixture(scope="module")
def problem():
    return make_problem()


def _step(problem, strategy):
    return step_of(problem, strategy)


@pytest.fixture(scope="module")
def fixed_estimates(problem):
    return fixed_estimates_of(problem)


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


# The H100 with a host too slow to update on (1 GB/s of memory bandwidth, 10 GFLOP/s):
# with the H100's own host, a plan with parameters and state on the host, updated there,
# is the fastest that fits this budget (since a host update's host-memory arguments are
# not donated, no copies follow it: `remat[k=save,q=save] params=pinned_host
# optimizer=host`, 2026-11-26), and the budget is not filled by a plan in between.
_H100_SPEEDS = ox.TARGETS["h100"].speeds
assert _H100_SPEEDS is not None
SLOW_HOST = dataclasses.replace(
    ox.TARGETS["h100"],
    speeds=dataclasses.replace(_H100_SPEEDS, host_bandwidth=1e9, host_flops=1e10),
)


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
    result = ox.fit(
        _step(problem, "annotated"), *problem[1], target=SLOW_HOST, device_budget=budget
    )
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
    # By the jaxpr count the search orders candidates by (the candidates' `seconds`).
    traced = result.estimate.traced_seconds
    for candidate in whole:
        assert traced < candidate.seconds, candidate.label
    for name, estimate in fixed_estimates.items():
        if estimate.device_bytes <= budget:
            assert traced < estimate.traced_seconds, name
    assert result.compiles <= 12


def test_a_plan_that_does_not_fit_prunes_its_family_after_one_compile(between):
    budget, result = between
    compiled = [c for c in result.candidates if c.device_bytes is not None]
    # Learned from the plans compiled: a family (base and placement) whose plan kept
    # less did not fit, or its plans need what a compiled one needed beyond its
    # arguments and saved names.
    pruned = [
        c for c in result.candidates
        if c.status.startswith("not compiled: keeps") or c.status.endswith("placement needed")
    ]  # fmt: skip
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


@pytest.mark.full
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


# The two searches that fail (92 s and 59 s of a 2-core CI machine's time) run with
# `--full`: `.ci/run` must stay under 30 minutes.
@pytest.mark.full
def test_compiler_crashes_are_listed_and_not_taken_for_no_fit(problem, between, monkeypatch):
    import offload_eqx._fit.search as fit_search

    real = fit_search.program_of_step  # what each candidate's compile starts from

    def crashes_on_host_params(step, args, kwargs):
        if step.strategy.params != "device":
            raise RuntimeError("INTERNAL: Mosaic failed on a host layout")
        return real(step, args, kwargs)

    monkeypatch.setattr(fit_search, "program_of_step", crashes_on_host_params)
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
