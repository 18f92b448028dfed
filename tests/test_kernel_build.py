"""The host kernels' build at install time (`offload_eqx/_host/kernels/compile.py`, called by
`hatch_build.py`): the compiler a user names, with its arguments, or the reason none was
found, recorded for the loader; a library that appears whole or not at all, even when
the build is killed; a record that vouches only for a library a child process loaded; a
compiler that hangs stopped with every process it started."""

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from offload_eqx._host.kernels import compile as kernels
from offload_eqx._host.kernels.compile import MANIFEST, build_into

# A stand-in compiler: records its arguments, writes $LIBRARY as its output (else part of
# one), writes its processes' ids, says it has started, and (with SLOW set) waits to be
# killed.
FAKE = textwrap.dedent(
    """\
    #!/bin/sh
    printf '%s\\n' "$@" > "$ARGS"
    while [ "$#" -gt 1 ]; do [ "$1" = "-o" ] && out="$2"; shift; done
    if [ -n "$LIBRARY" ]; then cat "$LIBRARY" > "$out"; else printf 'half a library' > "$out"; fi
    echo $$ > "$PIDS"
    if [ -n "$SLOW" ]; then sleep 120 & echo $! >> "$PIDS"; fi
    : > "$STARTED"
    wait
    exit 0
    """
)

# What the stand-in compiler writes: a library with the kernel's symbols, which the
# build loads in a child process before its record vouches for it.
STAND_IN = textwrap.dedent(
    """\
    void* OffloadEqxAdamW(void* frame) { return 0; }
    const char* OffloadEqxAdamWVariant(void) { return "stand-in"; }
    """
)


def _c_library(folder: Path, name: str, source: str) -> Path:
    """`source` compiled by `cc` into a library `name` in `folder`."""
    if shutil.which("cc") is None:
        pytest.skip("no C compiler (`cc`) to build a stand-in library")
    (folder / f"{name}.c").write_text(source)
    library = folder / f"{name}.so"
    command = ["cc", "-shared", "-fPIC", "-o", str(library), str(folder / f"{name}.c")]
    subprocess.run(command, check=True)
    return library


def _running(pid: int) -> bool:
    """Whether process `pid` runs (a zombie, dead and not yet reaped by init, does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _ended(pids: list[int]) -> list[int]:
    """Which of `pids` still run after up to 10 s; those are killed (ours to end)."""
    deadline = time.monotonic() + 10
    while any(map(_running, pids)) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = [pid for pid in pids if _running(pid)]
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    return left


@pytest.fixture(scope="module")
def stand_in(tmp_path_factory) -> Path:
    return _c_library(tmp_path_factory.mktemp("stand_in"), "stand_in", STAND_IN)


@pytest.fixture
def fake(tmp_path, monkeypatch, stand_in) -> Path:
    script = tmp_path / "fake compiler"
    script.write_text(FAKE)
    script.chmod(0o755)
    monkeypatch.setenv("ARGS", str(tmp_path / "args"))
    monkeypatch.setenv("STARTED", str(tmp_path / "started"))
    monkeypatch.setenv("PIDS", str(tmp_path / "pids"))
    monkeypatch.setenv("LIBRARY", str(stand_in))
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
    assert (tmp_path / "out" / "_adamw.so").read_bytes() == Path(os.environ["LIBRARY"]).read_bytes()
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
    """SIGKILL while the compiler writes: the library was an unnamed file, now gone, and
    the compiler was killed with the build."""
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
    # The compiler was in the build's process group: killed with it, not left running.
    pids = [int(line) for line in (tmp_path / "pids").read_text().split()]
    assert len(pids) == 2 and _ended(pids) == [], "the compiler outlived the build"


def test_the_record_is_replaced_whole(tmp_path, fake, monkeypatch):
    monkeypatch.setenv("CXX", shlex.quote(str(fake)))
    out = tmp_path / "out"
    build_into(out)
    first = (out / MANIFEST).stat().st_ino
    build_into(out)  # over the previous build: no temporary name left beside it
    assert sorted(p.name for p in out.iterdir()) == ["_adamw.so", MANIFEST]
    assert (out / MANIFEST).stat().st_ino != first


NO_SYMBOL = "int offload_eqx_not_the_kernel(void) { return 1; }\n"
# Loads, and kills the process that loads it (as a library cut short while mapped does).
CRASHES = (
    "#include <signal.h>\n__attribute__((constructor)) static void f(void) { raise(SIGBUS); }\n"
)


def _garbage(folder: Path, stand_in: Path) -> Path | None:
    return None  # the stand-in compiler then writes `half a library`


def _cut_short(folder: Path, stand_in: Path) -> Path:
    data = stand_in.read_bytes()
    (folder / "cut.so").write_bytes(data[: len(data) // 2])
    return folder / "cut.so"


UNLOADABLE = {
    "garbage": (_garbage, "it is not an ELF library (it begins b'half a l', 14 bytes)"),
    "cut_short": (_cut_short, "lies past its end at"),
    "no_kernel_symbol": (
        lambda folder, _: _c_library(folder, "no_symbol", NO_SYMBOL),
        "it has no symbol OffloadEqxAdamW, OffloadEqxAdamWVariant",
    ),
    "crashes_its_loader": (
        lambda folder, _: _c_library(folder, "crashes", CRASHES + STAND_IN),
        "loading it killed the process (signal SIGBUS)",
    ),
}


@pytest.mark.parametrize("case", list(UNLOADABLE))
def test_a_library_that_cannot_load_here_is_not_vouched_for(
    tmp_path, fake, stand_in, monkeypatch, case
):
    """The build loads what the compiler wrote in a child process (checked as the loader
    checks it) before its record vouches for it: a library cut short, a foreign one or
    one that crashes its loader leaves no library and a record saying why."""
    make, expected = UNLOADABLE[case]
    written = make(tmp_path, stand_in)
    if written is None:
        monkeypatch.delenv("LIBRARY")
    else:
        monkeypatch.setenv("LIBRARY", str(written))
    monkeypatch.setenv("CXX", shlex.quote(str(fake)))
    manifest = build_into(tmp_path / "out")
    (why,) = manifest["kernels"]["adamw"].values()
    assert why.startswith(f"`{shlex.quote(str(fake))} -O3") and expected in why, why
    assert "built a library this machine cannot load: " in why, why
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [MANIFEST]


HANGS = textwrap.dedent(
    """\
    #!/bin/sh
    echo $$ > "$PIDS"
    sleep 120 &
    echo $! >> "$PIDS"
    wait
    """
)


def test_a_compiler_that_hangs_leaves_no_process_behind(tmp_path, monkeypatch):
    """Past its time the compiler's whole process group is killed: what it started too
    (a `sleep` holding its output open, here), not the compiler alone."""
    script = tmp_path / "hanging compiler"
    script.write_text(HANGS)
    script.chmod(0o755)
    monkeypatch.setenv("PIDS", str(tmp_path / "pids"))
    monkeypatch.setenv("CXX", shlex.quote(str(script)))
    monkeypatch.setattr(kernels, "BUILD_SECONDS", 1)
    started = time.monotonic()
    manifest = build_into(tmp_path / "out")
    took = time.monotonic() - started
    pids = [int(line) for line in (tmp_path / "pids").read_text().split()]
    assert len(pids) == 2 and _ended(pids) == [], "the compiler's processes still run"
    (why,) = manifest["kernels"]["adamw"].values()
    assert why.endswith("did not finish in 1 s, and was stopped with every process it started")
    assert took < 30 and sorted(p.name for p in (tmp_path / "out").iterdir()) == [MANIFEST]
