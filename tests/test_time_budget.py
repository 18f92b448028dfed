"""The default session's time budget (`time_budget.py`) fails a `--time-budget` run over
it, naming the test, and lets `--full` runs and runs without the flag through."""

import pathlib

import pytest

BUDGET_PLUGIN = pathlib.Path(__file__).with_name("time_budget.py")


@pytest.fixture
def project(pytester):
    plugin = BUDGET_PLUGIN.read_text().replace("PHASE_SECONDS = 100.0", "PHASE_SECONDS = 0.5")
    assert "PHASE_SECONDS = 0.5" in plugin  # the budget's line is where this test looks
    ceiling = '"test_times.py::test_slow_with_a_ceiling": 5.0,'
    plugin = plugin.replace("CEILINGS: dict[str, float] = {", "CEILINGS = {" + ceiling)
    assert ceiling in plugin  # and the ceilings' line
    pytester.makepyfile(time_budget=plugin)
    pytester.makeconftest(
        """
        pytest_plugins = ("time_budget",)

        def pytest_addoption(parser):
            parser.addoption("--full", action="store_true")
        """
    )
    pytester.makepyfile(
        test_times="""
        import time

        def test_slow():
            time.sleep(1.0)

        def test_fast():
            pass

        def test_slow_with_a_ceiling():
            time.sleep(1.0)
        """
    )
    return pytester


def test_a_test_over_the_budget_fails_the_run_and_is_named(project):
    result = project.runpytest_subprocess("-p", "no:cacheprovider", "--time-budget")
    result.assert_outcomes(passed=3)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(
        ["*1 test phase(s) took more than*budget of 0 s*", "*test_times.py::test_slow"]
    )
    named = result.stdout.str().split("time budget")[-1]
    assert "test_fast" not in named and "test_slow_with_a_ceiling" not in named


@pytest.mark.parametrize("options", [("--time-budget", "--full"), ()])
def test_full_and_unbudgeted_runs_are_not_held_to_it(project, options):
    result = project.runpytest_subprocess("-p", "no:cacheprovider", *options)
    assert result.ret == pytest.ExitCode.OK


# Left out of the default session's runtime type checks (pyproject.toml's addopts), for
# time: the step-time model's inner loops. `nox -s tests -- --full` checks them too.
UNCHECKED = {
    f"offload_eqx._planning.{m}" for m in ("flops", "fused", "hlo", "kernels", "prices", "schedule")
}


def test_every_module_is_type_checked_at_run_time_but_the_step_time_models_loops():
    """A module added to the package is checked unless it is added to `UNCHECKED` too."""
    import tomllib

    root = pathlib.Path(__file__).resolve().parents[1]
    options = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["pytest"]
    [listed] = [
        a.split("=", 1)[1].split(",")[:-1]
        for a in options["ini_options"]["addopts"]
        if a.startswith("--jaxtyping-packages=")
    ]
    modules = {
        ".".join(path.relative_to(root).with_suffix("").parts)
        for path in (root / "offload_eqx").rglob("*.py")
        if path.name != "__init__.py"  # re-exports only
    }
    checked = {m for m in modules if any(m == p or m.startswith(p + ".") for p in listed)}
    assert modules - checked == UNCHECKED
    assert set(listed) <= modules | {p.rsplit(".", 1)[0] for p in modules}  # none stale
