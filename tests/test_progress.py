"""Progress of long work: a status line on stderr by default only where a person watches
(a terminal, outside pytest and CI); a function, True or False when asked; anything else
refused before any work."""

import io

import pytest
from test_max_batch import _fake_report, mlp_step

import offload_eqx as ox
from offload_eqx._base.progress import StatusLine, reporting, shows_status
from offload_eqx._planning import max_batch as _max_batch


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_status_line_only_on_a_terminal_outside_pytest_and_ci(monkeypatch):
    assert not shows_status(_Terminal())  # under pytest
    monkeypatch.delenv("PYTEST_CURRENT_TEST")
    monkeypatch.delenv("CI", raising=False)
    assert shows_status(_Terminal())
    assert not shows_status(io.StringIO())  # a file or a pipe
    monkeypatch.setenv("CI", "true")
    assert not shows_status(_Terminal())


def test_the_status_line_is_rewritten_in_place_and_ended_once():
    stream = _Terminal()
    line = StatusLine(stream)
    line("ox.fit h100: 12 traced, 1 compiled, best so far: none yet")
    line("ox.fit h100: 13 traced")
    line.close()
    text = stream.getvalue()
    assert text.count("\r") == 2 and text.endswith("\n") and text.count("\n") == 1
    last = text.rsplit("\r", 1)[1]
    assert last.startswith("ox.fit h100: 13 traced") and len(last.rstrip("\n")) == len(
        "ox.fit h100: 12 traced, 1 compiled, best so far: none yet"
    )  # padded over the longer line before it


def test_the_default_under_pytest_says_nothing(capsys):
    with reporting("ox.fit", None) as say:
        say("a line")
    assert capsys.readouterr().err == ""


def test_true_shows_the_status_line_on_stderr(monkeypatch, capsys):
    monkeypatch.setattr(
        _max_batch, "memory_report", lambda fn, m, x, target: _fake_report(1_000 * x.shape[0])
    )
    step, make_args = mlp_step()
    assert ox.max_batch(step, make_args, target="cpu", device_budget=20_500, progress=True) == 20
    err = capsys.readouterr().err
    assert err.count("\r") >= 4 and err.endswith("\n") and "max_batch cpu: batch 21" in err


@pytest.mark.parametrize("bad", ["yes", 1, 0.5])
def test_anything_else_is_refused_before_any_compile(bad, monkeypatch):
    with pytest.raises(TypeError, match=r"ox.fit\(progress=.*expected a function taking"):
        with reporting("ox.fit", bad):
            pass

    def never(*args, **kwargs):
        raise AssertionError("compiled")

    monkeypatch.setattr(_max_batch, "memory_report", never)
    step, make_args = mlp_step()
    # (Under this suite's jaxtyping hook the annotation refuses it first, as a TypeError.)
    with pytest.raises(TypeError, match=r"progress"):
        ox.max_batch(step, make_args, target="cpu", device_budget=10**9, progress=bad)
    with pytest.raises(TypeError, match=r"progress"):
        ox.fit(step, *make_args(4), target="h100", progress=bad)
