"""The GPU-host proofs' verdict file (`_host/kernels/gpu_host_verdicts.py`): read only
from a regular file no one else can write, never opened before that is known, a damaged
one replaced; written through a temporary file of its own that no failure leaves behind;
where it cannot be kept, the reason is returned (and `ox.host_kernels()` reports it)."""

import errno
import json
import os
import stat
import subprocess
import sys
import textwrap
import threading

import pytest

from offload_eqx._host.kernels import gpu_host_verdicts as verdicts

_OK = {"ok": True, "why": ""}


@pytest.fixture
def path(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    found = verdicts.verdict_file()
    assert found == tmp_path / "cache" / "offload_eqx" / "gpu_host_kernels.json"
    assert found is not None
    found.parent.mkdir(mode=0o700, parents=True)
    return found


def _temporary_files(path) -> list[str]:
    return [name for name in os.listdir(path.parent) if name.endswith(".tmp")]


def test_a_verdict_file_others_may_write_is_ignored(path):
    """A verdict says whether a compile may call the kernel: one that anyone else could
    have written (a group- or world-writable file or folder, a link) is not read."""
    assert verdicts.write("key", _OK) is None
    assert verdicts.read() == {"key": _OK}
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    path.chmod(0o622)
    assert verdicts.read() == {}
    path.chmod(0o600)
    path.parent.chmod(0o777)
    assert verdicts.read() == {}
    path.parent.chmod(0o700)
    link = path.parent.parent / "elsewhere.json"
    link.write_text(json.dumps({"key": _OK}))
    path.unlink()
    path.symlink_to(link)
    assert verdicts.read() == {}


def test_a_pipe_at_the_verdict_files_path_is_never_opened(path):
    """Opened, a FIFO blocks until someone writes to it: the first h100 compile hung."""
    os.mkfifo(path, 0o600)
    found = []
    reader = threading.Thread(target=lambda: found.append(verdicts.read()), daemon=True)
    reader.start()
    reader.join(10)
    if reader.is_alive():  # release the blocked open before failing
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
        reader.join(10)
        pytest.fail("reading the verdicts opened the pipe at their path and waited")
    assert found == [{}]
    why = verdicts.write("key", _OK)
    assert why is not None and str(path) in why and "a pipe" in why, why
    assert stat.S_ISFIFO(os.lstat(path).st_mode)
    assert _temporary_files(path) == []


def test_a_verdict_file_nested_too_deeply_is_replaced(path):
    """JSON nested deeper than Python's recursion limit raised `RecursionError` where it
    was read, so the damaged file was never replaced and the proof never made."""
    path.write_text("[" * 100_000 + "]" * 100_000)
    path.chmod(0o600)
    assert verdicts.read() == {}
    assert verdicts.write("key", _OK) is None
    assert verdicts.read() == {"key": _OK}


@pytest.mark.parametrize(
    "damage",
    ["{", "\xff", "[1, 2]", "{}" + " " * (1 << 20)],
    ids=["unfinished", "not UTF-8", "not a record", "over the size limit"],
)
def test_a_damaged_or_oversized_verdict_file_is_replaced(path, damage):
    path.write_bytes(damage.encode("latin-1"))
    path.chmod(0o600)
    assert verdicts.read() == {}
    assert verdicts.write("key", _OK) is None
    assert verdicts.read() == {"key": _OK}


def test_a_folder_at_the_verdict_files_path_is_reported_and_left(path):
    """A folder there is someone's: left as it is, said why, and no temporary file left
    behind (one was, for each process that tried)."""
    (path / "theirs").mkdir(parents=True)
    for _ in range(2):
        why = verdicts.write("key", _OK)
        assert why is not None and f"{path} is a folder" in why, why
    assert (path / "theirs").is_dir()
    assert _temporary_files(path) == []


_FILE_SIZE_LIMITED = textwrap.dedent(
    """
    import importlib.util, json, os, resource, signal, sys
    spec = importlib.util.spec_from_file_location("verdicts", sys.argv[1])
    verdicts = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(verdicts)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails instead
    resource.setrlimit(resource.RLIMIT_FSIZE, (100, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
    print(json.dumps(verdicts.write("key", {"ok": True, "why": "x" * 1000})))
    """
)


def test_a_write_the_disk_refuses_leaves_no_temporary_file(path):
    """A write that fails part way (the kernel's own refusal: a file size limit of 100
    bytes) leaves the old verdicts as they were and no temporary file."""
    assert verdicts.write("before", _OK) is None
    done = subprocess.run(
        [sys.executable, "-c", _FILE_SIZE_LIMITED, verdicts.__file__],
        capture_output=True, text=True, timeout=60, env=os.environ,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    why = json.loads(done.stdout)
    assert why is not None and "could not be written (File too large)" in why, why
    assert _temporary_files(path) == []
    assert verdicts.read() == {"before": _OK}


def test_a_full_disk_leaves_no_temporary_file(path, monkeypatch):
    def full(descriptor, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "write", full)
    why = verdicts.write("key", _OK)
    monkeypatch.undo()
    assert why == f"{path} could not be written (No space left on device)", why
    assert _temporary_files(path) == []
    assert not path.exists()


def test_a_temporary_file_an_earlier_process_left_does_not_stop_the_write(path):
    """A temporary file named by the process id, opened exclusively, was never written
    again by a later process with the same id (process ids repeat, in containers soon)."""
    (path.parent / f"{path.name}.{os.getpid()}.tmp").write_text("left by a killed process")
    assert verdicts.write("key", _OK) is None
    assert verdicts.read() == {"key": _OK}


def test_a_relative_xdg_cache_home_is_ignored(tmp_path, monkeypatch):
    """The XDG Base Directory specification: a relative path is invalid and ignored (it
    wrote into the working directory)."""
    monkeypatch.setenv("XDG_CACHE_HOME", "relative")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    expected = tmp_path / "home" / ".cache" / "offload_eqx" / "gpu_host_kernels.json"
    assert verdicts.verdict_file() == expected
    assert verdicts.write("key", _OK) is None
    assert json.loads(expected.read_text()) == {"key": _OK}
    assert not (tmp_path / "relative").exists()
