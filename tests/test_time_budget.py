"""The default session's time budget (`time_budget.py`) fails a `--time-budget` run over
it, naming the test, grows on a slower or busier machine, and lets `--full` runs and runs
without the flag through; `nox -s tests` asks for it only on CI."""

import pathlib

import pytest

BUDGET_PLUGIN = pathlib.Path(__file__).with_name("time_budget.py")


def _project(pytester, reference: float):
    """A project with a budget of 0.5 s on a machine whose fixed work takes `reference`
    seconds (huge: every machine is as fast; tiny: every machine is far slower)."""
    plugin = BUDGET_PLUGIN.read_text().replace("PHASE_SECONDS = 100.0", "PHASE_SECONDS = 0.5")
    assert "PHASE_SECONDS = 0.5" in plugin  # the budget's line is where this test looks
    line = next(x for x in plugin.splitlines() if x.startswith("REFERENCE_SECONDS = "))
    plugin = plugin.replace(line, f"REFERENCE_SECONDS = {reference!r}")
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


@pytest.fixture
def project(pytester):
    return _project(pytester, reference=1e9)


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
    f"offload_eqx._planning.{m}"
    for m in ("dots", "flops", "fused", "hlo", "kernels", "prices", "schedule")
}


def test_a_slower_machine_gets_a_larger_budget(pytester):
    """A machine (or a load) that makes the fixed work take many times the project
    machine's time gives the budget as many times: the slow test passes, and a run on
    that machine is not failed for its speed."""
    project = _project(pytester, reference=1e-6)
    result = project.runpytest_subprocess("-p", "no:cacheprovider", "--time-budget")
    assert result.ret == pytest.ExitCode.OK


def test_the_slowdown_never_shrinks_the_budget():
    import time_budget

    assert time_budget.slowdown([0.01, 0.02], reference=0.1) == 1.0
    assert time_budget.slowdown([0.1, 0.3], reference=0.1) == pytest.approx(3.0)
    assert 0.0 < time_budget.machine_seconds(repeats=1) < 60.0


def test_the_budget_is_asked_for_on_ci_only(monkeypatch):
    """A user's `nox -s tests` is never failed for time; `.ci/run` asks for the budget."""
    root = pathlib.Path(__file__).resolve().parents[1]
    assert "OFFLOAD_EQX_TIME_BUDGET=1" in (root / ".ci" / "run").read_text()
    import importlib.util
    import sys
    import types

    # The test session has no nox: a stand-in with what the noxfile uses at import.
    stub = types.ModuleType("nox")
    stub.options = types.SimpleNamespace()  # type: ignore[attr-defined]
    stub.Session = object  # type: ignore[attr-defined]
    stub.session = lambda f=None, **_: f or (lambda g: g)  # type: ignore[attr-defined]
    stub.parametrize = lambda *_, **__: lambda f: f  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "nox", stub)
    spec = importlib.util.spec_from_file_location("noxfile", root / "noxfile.py")
    noxfile = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(noxfile)  # type: ignore[union-attr]
    monkeypatch.delenv("OFFLOAD_EQX_TIME_BUDGET", raising=False)
    assert noxfile.time_budget() == ()
    monkeypatch.setenv("OFFLOAD_EQX_TIME_BUDGET", "1")
    assert noxfile.time_budget() == ("--time-budget",)


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
