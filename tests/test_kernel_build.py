"""The host kernels' build at install time (`offload_eqx/_host/kernels/compile.py`, called by
`hatch_build.py`): the compiler a user names, with its arguments, or the reason none was
found, recorded for the loader; a library that appears whole or not at all, even when
the build is killed."""

import json
import os
import shlex
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from offload_eqx._host.kernels import compile as kernels
from offload_eqx._host.kernels.compile import MANIFEST, build_into

# A stand-in compiler: records its arguments, writes part of its output, says it has
# started, and (with SLOW set) waits to be killed.
FAKE = textwrap.dedent(
    """\
    #!/bin/sh
    printf '%s\\n' "$@" > "$ARGS"
    while [ "$#" -gt 1 ]; do [ "$1" = "-o" ] && out="$2"; shift; done
    printf 'half a library' > "$out"
    : > "$STARTED"
    [ -n "$SLOW" ] && sleep 120
    exit 0
    """
)


@pytest.fixture
def fake(tmp_path, monkeypatch) -> Path:
    script = tmp_path / "fake compiler"
    script.write_text(FAKE)
    script.chmod(0o755)
    monkeypatch.setenv("ARGS", str(tmp_path / "args"))
    monkeypatch.setenv("STARTED", str(tmp_path / "started"))
    return script


def test_cxx_is_split_as_a_shell_splits_it(tmp_path, fake, monkeypatch):
    monkeypatch.setenv("CXX", f"'{fake}' -DOFFLOAD_EQX_CHECK=1")
    manifest = build_into(tmp_path / "out")
    entry = manifest["kernels"]["adamw"]
    assert "error" not in entry, entry
    args = (tmp_path / "args").read_text().splitlines()
    assert args[0] == "-DOFFLOAD_EQX_CHECK=1" and "-ffp-contract=off" in args
    assert "-march=native" not in args  # one build for every processor of the kind
    assert entry["compiler"] == f"'{fake}' -DOFFLOAD_EQX_CHECK=1"
    assert (tmp_path / "out" / "_adamw.so").read_bytes() == b"half a library"
    assert json.loads((tmp_path / "out" / MANIFEST).read_text()) == manifest


def test_a_cxx_that_is_not_there_is_named(tmp_path, monkeypatch):
    monkeypatch.setenv("CXX", "/opt/no-such/g++ -O2")
    manifest = build_into(tmp_path)
    assert manifest["kernels"]["adamw"] == {
        "error": "CXX='/opt/no-such/g++ -O2': '/opt/no-such/g++' is not an executable on the PATH"
    }
    assert sorted(p.name for p in tmp_path.iterdir()) == [MANIFEST]


def test_without_a_compiler_the_record_says_so_and_the_loader_repeats_it(tmp_path, monkeypatch):
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    build_into(tmp_path / "kernels")
    monkeypatch.undo()
    script = textwrap.dedent(
        f"""
        from pathlib import Path
        from offload_eqx._host.kernels import load
        load.KERNEL_DIR = Path({str(tmp_path / "kernels")!r})
        import offload_eqx as ox
        print(ox.host_kernels()["adamw"])
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == (
        "unavailable: it could not be built when offload_eqx was installed: no C++ compiler "
        "found (set CXX, or install g++ or clang++)"
    )


def test_a_build_killed_midway_leaves_nothing(tmp_path, fake):
    """SIGKILL while the compiler writes: the library was an unnamed file, now gone."""
    out = tmp_path / "out"
    out.mkdir()
    script = textwrap.dedent(
        f"""
        import importlib.util
        spec = importlib.util.spec_from_file_location("c", {kernels.__file__!r})
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        module.build_into({str(out)!r})
        """
    )
    env = {**os.environ, "CXX": shlex.quote(str(fake)), "SLOW": "1"}
    child = subprocess.Popen([sys.executable, "-c", script], env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "started").exists():
            assert child.poll() is None and time.monotonic() < deadline, "the build never started"
            time.sleep(0.05)
    finally:
        os.killpg(child.pid, signal.SIGKILL)
        child.wait()
    assert list(out.iterdir()) == []


def test_the_record_is_replaced_whole(tmp_path, fake, monkeypatch):
    monkeypatch.setenv("CXX", shlex.quote(str(fake)))
    out = tmp_path / "out"
    build_into(out)
    first = (out / MANIFEST).stat().st_ino
    build_into(out)  # over the previous build: no temporary name left beside it
    assert sorted(p.name for p in out.iterdir()) == ["_adamw.so", MANIFEST]
    assert (out / MANIFEST).stat().st_ino != first
