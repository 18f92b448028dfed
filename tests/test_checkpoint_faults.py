"""A save that fails or is interrupted at any stage leaves nothing, once it returns and
after (issue 50, items 15, 18, 19): Orbax's and TensorStore's writers stopped first.

Each stage of a save is found by the call that starts it (a directory made, a TensorStore
opened, a file opened for writing, a rename), patched to inject a fault there: a Ctrl-C
or a SIGTERM (under `sys.exit(143)`, the usual preemption handler) sent to the main
thread while the stage runs, a full disk or too many open files raised by it, a leaf
donated meanwhile. Real signals, a real limit of open files and a real full disk run in
subprocesses."""

import asyncio
import builtins
import errno
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tensorstore

import offload_eqx as ox

SETTLE_SECONDS = 0.3  # what a late writer would have needed to show itself


def _tree():
    """`w` over Orbax's 1 KiB inline limit (a data file of its own), `b` inlined."""
    return {"w": jnp.arange(600.0), "b": [jnp.zeros(3)]}


def _tsopen_of(word):
    return lambda spec: word in str(spec)


def _named(name):
    return lambda path: os.path.basename(path) == name


# stage: (the call that starts it, which of its calls)
STAGES = {
    "our_directory": ("mkdir", lambda path: ".offload_eqx-tmp-" in os.path.basename(path)),
    "orbax_directory": ("mkdir", lambda path: path.endswith(".orbax-checkpoint-tmp")),
    "step_metadata": ("open", _named("_CHECKPOINT_METADATA")),
    "sharding": ("tensorstore", _tsopen_of("_sharding")),
    "array_data": ("tensorstore", _tsopen_of("'zarr'")),
    "array_metadatas": ("open", lambda path: "array_metadatas" in path),
    "tree_metadata": ("open", _named("_METADATA")),
    "commit": ("open", _named("commit_success.txt")),
    "orbax_rename": ("rename", lambda path: path.endswith(".orbax-checkpoint-tmp")),
    "checksums": ("open", _named("offload_eqx_checksums.json.tmp")),
    "publish": ("rename", lambda path: not path.endswith(".orbax-checkpoint-tmp")),
}
WRITING = [name for name, (call, _) in STAGES.items() if call in ("open", "tensorstore")]
WRITING += ["our_directory", "orbax_directory"]


def _inject(monkeypatch, stage, fault):
    """Call `fault(call, path)` once, when `stage` starts (in whichever thread runs it),
    then let the stage go on unless the fault raised."""
    call, matches = STAGES[stage]
    done = threading.Lock()

    def first(path):
        return matches(path) and done.acquire(blocking=False)

    if call == "mkdir":
        real_mkdir = os.mkdir

        def mkdir(path, *args, **kwargs):
            if first(os.fspath(path)):
                fault("mkdir", os.fspath(path))
            return real_mkdir(path, *args, **kwargs)

        monkeypatch.setattr(os, "mkdir", mkdir)
    elif call == "open":
        real_open = builtins.open

        def opened(file, mode="r", *args, **kwargs):
            writing = isinstance(file, (str, os.PathLike)) and any(c in mode for c in "wax+")
            if writing and first(os.fspath(file)):
                fault("open", os.fspath(file))
            return real_open(file, mode, *args, **kwargs)

        monkeypatch.setattr(builtins, "open", opened)
    elif call == "tensorstore":
        real_tsopen = tensorstore.open

        def tsopen(spec, *args, **kwargs):
            if first(spec):
                fault("tensorstore", str(spec)[:200])
            return real_tsopen(spec, *args, **kwargs)

        monkeypatch.setattr(tensorstore, "open", tsopen)
    else:
        real_rename = os.rename

        def rename(source, target, *args, **kwargs):
            if ".offload_eqx-tmp-" in os.fspath(source) and first(os.fspath(source)):
                fault("rename", os.fspath(source))
            return real_rename(source, target, *args, **kwargs)

        monkeypatch.setattr(os, "rename", rename)


def _signal(signum):
    """A signal sent to the main thread while a stage runs, the stage let run on after."""
    main = threading.main_thread().ident
    assert main is not None

    def fault(call, path):
        signal.pthread_kill(main, signum)
        time.sleep(0.2)

    return fault


def _raising(code):
    """The error a full disk or the limit of open files gives at this call: a bare
    `OSError` from a write, one naming the path from an open or a mkdir, TensorStore's
    `ValueError` with its status and the OS's error code."""

    def fault(call, path):
        words = os.strerror(code)
        if call == "tensorstore":
            raise ValueError(
                f'RESOURCE_EXHAUSTED: Error writing local file "{path}": Failed to write 83 '
                f"bytes to file 4: {words} [os_error_code='{code}']"
            )
        if call == "open" and code == errno.ENOSPC:
            raise OSError(code, words)  # what the write after a successful open raises
        raise OSError(code, words, path)

    return fault


@pytest.fixture
def run_directory(tmp_path):
    """`run/`, holding a file of the user's; the save goes to `run/step_1`."""
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "notes.txt").write_text("kept")
    return tmp_path / "run"


def _orbax_threads(before):
    def orbax(thread):
        target = getattr(thread, "_target", None)
        modules = (type(thread).__module__, getattr(target, "__module__", None) or "")
        return any(m.startswith("orbax.") for m in modules)

    return [t for t in threading.enumerate() if t not in before and orbax(t) and t.is_alive()]


def _assert_left_as_before(directory, before, threads):
    assert sorted(os.listdir(directory)) == before, "files left as the save returned"
    assert _orbax_threads(threads) == [], "Orbax's writers still run"
    time.sleep(SETTLE_SECONDS)
    assert sorted(os.listdir(directory)) == before, "files written after the save returned"


@pytest.fixture
def preemption_handler():
    """SIGTERM as preemption handlers take it: `sys.exit(143)`."""
    previous = signal.signal(signal.SIGTERM, lambda *args: sys.exit(143))
    yield
    signal.signal(signal.SIGTERM, previous)


@pytest.fixture
def ctrl_c_handler():
    """Ctrl-C as Python takes it, `KeyboardInterrupt`, even where the tests were started
    in the background (a shell's `&` starts them with SIGINT ignored, which Python keeps)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


@pytest.mark.parametrize("stage", list(STAGES))
@pytest.mark.parametrize("interrupt", ["ctrl_c", "sigterm"])
def test_an_interrupted_save_leaves_nothing_once_it_returns(
    run_directory, monkeypatch, request, stage, interrupt
):
    """Item 15: the interrupt reached the caller while Orbax's threads went on writing
    `_sharding`, data files and `commit_success.txt` into the removed directory. The save
    now runs in a thread of its own, stops where it can, and returns once it has."""
    request.getfixturevalue("preemption_handler" if interrupt == "sigterm" else "ctrl_c_handler")
    signum, raised = {
        "ctrl_c": (signal.SIGINT, KeyboardInterrupt),
        "sigterm": (signal.SIGTERM, SystemExit),
    }[interrupt]
    before, threads = sorted(os.listdir(run_directory)), set(threading.enumerate())
    _inject(monkeypatch, stage, _signal(signum))
    with pytest.raises(raised):
        ox.save_checkpoint(run_directory / "step_1", _tree())
    monkeypatch.undo()
    if stage == "publish":  # the checkpoint was complete, renamed as the signal came
        before = sorted([*before, "step_1"])
        restored = ox.restore_checkpoint(run_directory / "step_1", _tree())
        np.testing.assert_array_equal(restored["w"], _tree()["w"])
    _assert_left_as_before(run_directory, before, threads)


@pytest.mark.parametrize("stage", WRITING)
@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EMFILE], ids=["disk_full", "open_files"])
def test_a_full_disk_or_too_many_open_files_is_one_oserror_naming_the_checkpoint(
    run_directory, monkeypatch, stage, code
):
    """Items 15 and 18: a full disk was a bare `OSError: [Errno 28]` at some stages and
    TensorStore's `ValueError` at others, and writers went on after it was raised."""
    if code == errno.EMFILE and STAGES[stage][0] == "mkdir":
        pytest.skip("making a directory opens no file")
    before, threads = sorted(os.listdir(run_directory)), set(threading.enumerate())
    _inject(monkeypatch, stage, _raising(code))
    path = os.path.realpath(run_directory / "step_1")
    with pytest.raises(OSError) as raised:
        ox.save_checkpoint(run_directory / "step_1", _tree())
    monkeypatch.undo()
    error = raised.value
    assert error.errno == code and error.filename == path
    words = "No space left on device" if code == errno.ENOSPC else "Too many open files"
    assert f"{words} while writing the checkpoint `{path}`" in str(error)
    assert "nothing of this save is left" in str(error)
    assert ("df -h" in str(error)) == (code == errno.ENOSPC)
    assert ("ulimit -n" in str(error)) == (code == errno.EMFILE)
    assert error.__cause__ is not None  # Orbax's, TensorStore's or the OS's own words
    _assert_left_as_before(run_directory, before, threads)


@pytest.mark.parametrize("stage", ["our_directory", "tree_metadata"])
def test_a_leaf_donated_while_the_save_reads_it_is_named_and_nothing_is_left(
    run_directory, monkeypatch, stage
):
    """Item 19: a step donating the model while another thread saved it gave `RuntimeError:
    Array has been deleted`, naming no leaf, and left the temporary directory. Deleted
    before Orbax reads it or after (then our checksum reads it): the leaf is named."""
    tree = _tree()
    before, threads = sorted(os.listdir(run_directory)), set(threading.enumerate())
    _inject(monkeypatch, stage, lambda call, path: tree["w"].delete())
    with pytest.raises(ValueError, match=r"`tree\['w'\]` was deleted while this save of") as e:
        ox.save_checkpoint(run_directory / "step_1", tree)
    monkeypatch.undo()
    assert "wait=False" in str(e.value)
    assert f"the checkpoint `{run_directory / 'step_1'}`" in str(e.value)  # which save
    _assert_left_as_before(run_directory, before, threads)


def _donating_step():
    @ox.filter_jit(donate="all")
    def step(model):
        return jax.tree.map(lambda x: x + 1, model)

    return step


def test_saving_in_a_thread_while_a_step_donates_names_the_leaf_or_saves(run_directory):
    """The asynchronous pattern as users write it: a thread saves, the loop steps on."""
    step = _donating_step()
    model = step({f"w{i}": jnp.full(4096, float(i)) for i in range(40)})
    for trial in range(3):
        outcome: list = []

        def save(model=model, trial=trial):
            try:
                ox.save_checkpoint(run_directory / f"step_{trial}", model)
            except ValueError as error:
                outcome.append(error)

        thread = threading.Thread(target=save)
        thread.start()
        time.sleep(0.01 * trial)
        for _ in range(3):
            model = step(model)
        thread.join()
        names = sorted(os.listdir(run_directory))
        if outcome:  # donated before it was read (checked first) or while it was
            assert "`tree['w" in str(outcome[0]) and "deleted" in str(outcome[0])
            assert f"step_{trial}`" in str(outcome[0])  # the checkpoint too
            assert names == ["notes.txt"]
        else:
            assert names == ["notes.txt", f"step_{trial}"]
            shutil.rmtree(run_directory / f"step_{trial}")


def test_wait_false_copies_the_arrays_so_the_next_step_may_donate_them(run_directory):
    """Item 19: `wait=False` returns once the arrays are copied (into host memory) and
    writes them in the background; the loop donates them at once."""
    step = _donating_step()
    model = step({f"w{i}": jnp.full(4096, float(i)) for i in range(40)})
    saved = {name: np.array(leaf) for name, leaf in model.items()}  # copies
    future = ox.save_checkpoint(run_directory / "step_1", model, wait=False)
    for _ in range(3):
        model = step(model)
    assert future is not None and future.result(timeout=120) is None
    like = jax.eval_shape(lambda: model)
    restored = ox.restore_checkpoint(run_directory / "step_1", like)
    for name, leaf in restored.items():
        np.testing.assert_array_equal(leaf, saved[name])
    assert sorted(os.listdir(run_directory)) == ["notes.txt", "step_1"]


def test_wait_false_refuses_before_returning_and_fails_through_the_future(
    run_directory, monkeypatch
):
    (run_directory / "step_1").mkdir()
    with pytest.raises(FileExistsError, match=r"step_1` exists already"):
        ox.save_checkpoint(run_directory / "step_1", _tree(), wait=False)
    _inject(monkeypatch, "array_data", _raising(errno.ENOSPC))
    future = ox.save_checkpoint(run_directory / "step_2", _tree(), wait=False)
    assert future is not None
    with pytest.raises(OSError, match=r"No space left on device while writing the checkpoint"):
        future.result(timeout=120)
    assert sorted(os.listdir(run_directory)) == ["notes.txt", "step_1"]


def test_wait_false_is_refused_in_a_run_of_several_processes(run_directory, monkeypatch):
    """Each process would rename and sync in a thread of its own, in its own order."""
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    with pytest.raises(ValueError, match=r"`wait=False` saves in a thread .* has 2\)"):
        ox.save_checkpoint(run_directory / "step_1", {"w": np.ones(3)}, wait=False)
    assert sorted(os.listdir(run_directory)) == ["notes.txt"]


# -- real signals, a real limit of open files, a real full disk: in subprocesses ---------

_REAL_FAULTS = """
import os, resource, shutil, signal, sys, threading, time
import jax.numpy as jnp
import offload_eqx as ox

parent, fault = sys.argv[1], sys.argv[2]
tree = {f"w{i}": jnp.full(4096, float(i)) for i in range(100)}
ox.save_checkpoint(os.path.join(parent, "warm"), {"w": jnp.ones(3)})  # imports, compiles
shutil.rmtree(os.path.join(parent, "warm"))
if fault == "sigterm":
    signal.signal(signal.SIGTERM, lambda *args: sys.exit(143))
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
for trial in range(8):
    name = f"step_{trial}"
    try:
        if fault == "open_files":
            opened = len(os.listdir("/proc/self/fd"))
            resource.setrlimit(resource.RLIMIT_NOFILE, (opened + 1 + trial, hard))
        else:
            number = signal.SIGINT if fault == "ctrl_c" else signal.SIGTERM
            threading.Timer(0.03 * trial, os.kill, (os.getpid(), number)).start()
        try:
            ox.save_checkpoint(os.path.join(parent, name), tree)
            outcome = "saved"
        finally:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        time.sleep(1.0)  # a signal that comes after the save
    except BaseException as error:
        outcome = type(error).__name__ + (f" errno={error.errno}" if isinstance(error, OSError) else "")
    now = sorted(os.listdir(parent))
    time.sleep(0.5)
    print("TRIAL", name, outcome, now, sorted(os.listdir(parent)), sep="|", flush=True)
    for entry in os.listdir(parent):
        shutil.rmtree(os.path.join(parent, entry))
"""


def _trials(parent, fault):
    done = subprocess.run(
        [sys.executable, "-c", _REAL_FAULTS, str(parent), fault],
        env=dict(os.environ, JAX_PLATFORMS="cpu"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    trials = [line.split("|")[1:] for line in done.stdout.splitlines() if line[:5] == "TRIAL"]
    assert len(trials) == 8, done.stderr[-3000:]
    return trials


@pytest.mark.parametrize("fault", ["ctrl_c", "sigterm", "open_files"])
def test_real_signals_and_open_file_limits_leave_nothing(tmp_path, fault):
    """A signal at 8 moments of a save of 100 arrays, or 8 limits of open files: each save
    either completes (then the signal comes after) or leaves nothing, then or later."""
    (tmp_path / "run").mkdir()
    raised = {"ctrl_c": "KeyboardInterrupt", "sigterm": "SystemExit", "open_files": "OSError"}
    for name, outcome, now, later in _trials(tmp_path / "run", fault):
        assert now == later, (name, outcome, now, later)  # nothing written after it returned
        if outcome == "saved" or f"'{name}'" in now:  # done before the signal came
            assert now == f"['{name}']", (name, outcome, now)
        else:
            assert outcome.startswith(raised[fault]) and now == "[]", (name, outcome, now)
            assert fault != "open_files" or outcome == "OSError errno=24", outcome


class _FailedThenLateSaver:
    """A checkpointer whose save failed as Orbax's do under a limit of open files: its
    wait raised, while one of its threads was failing (Orbax's `_SignalingThread`, whose
    `join` raises its error) and one started after it still wrote, making the
    directories it writes into."""

    def save(self, directory, tree):
        from orbax.checkpoint._src.futures.future import CommitFuture

        async def failed():
            await asyncio.sleep(0.1)
            raise OSError(errno.EMFILE, "Too many open files")

        async def late():
            await asyncio.sleep(0.3)
            os.makedirs(os.path.join(directory, "ocdbt.process_0", "d"))

        self.futures = [CommitFuture(failed(), name="failed"), CommitFuture(late(), name="late")]

    def wait_until_finished(self):  # Orbax's raises at the first failure it meets
        raise OSError(errno.EMFILE, "Too many open files")


def test_a_failed_orbax_thread_does_not_stop_the_wait_for_those_after_it(run_directory):
    """The wait for Orbax's threads stopped at the first that had failed (its `join`
    raised its error), so the threads after it, and TensorStore's writes (a real save:
    98 under way), went on after the directory was removed and made it again: a save
    failed for too many open files left `step_6.offload_eqx-tmp-*` (3 runs in 40)."""
    before, threads = sorted(os.listdir(run_directory)), set(threading.enumerate())
    with pytest.raises(OSError, match="Too many open files while writing"):
        ox.save_checkpoint(run_directory / "step_1", _tree(), checkpointer=_FailedThenLateSaver())
    _assert_left_as_before(run_directory, before, threads)


class _StartingLateSaver:
    """A checkpointer whose failed save left one thread, which starts another that
    writes after the first has ended (as Orbax's commit thread starts its own)."""

    def save(self, directory, tree):
        from orbax.checkpoint._src.futures.future import CommitFuture

        async def late():
            await asyncio.sleep(0.3)
            os.makedirs(os.path.join(directory, "ocdbt.process_0", "d"))

        async def starting():
            await asyncio.sleep(0.1)
            self.futures.append(CommitFuture(late(), name="late"))

        self.futures = [CommitFuture(starting(), name="starting")]

    def wait_until_finished(self):
        raise OSError(errno.EMFILE, "Too many open files")


def test_a_thread_started_by_an_orbax_thread_awaited_is_awaited_too(run_directory):
    """The wait for Orbax's threads took the threads there were when it began: one that
    a thread awaited started later went on writing after the directory was removed."""
    before, threads = sorted(os.listdir(run_directory)), set(threading.enumerate())
    with pytest.raises(OSError, match="Too many open files while writing"):
        ox.save_checkpoint(run_directory / "step_1", _tree(), checkpointer=_StartingLateSaver())
    _assert_left_as_before(run_directory, before, threads)


_STARVED = """
import errno, os, resource, sys
import jax.numpy as jnp
import offload_eqx as ox
from offload_eqx._checkpoints import checkpoints, private_directory

private_directory._REMOVE_ATTEMPTS = 3  # a failed removal shows in 0.1 s, not in 22 s
held = []  # the failed writers' files, open until the save has returned (as their
# event loops' were, kept by the error being raised)


def starved_write(ocp, written, arrays, given):
    os.makedirs(os.path.join(written + ".orbax-checkpoint-tmp", "ocdbt.process_0", "d"))
    try:
        while True:
            held.append(os.open(os.devnull, os.O_RDONLY))
    except OSError as error:
        raise OSError(errno.EMFILE, "Too many open files") from error


parent = sys.argv[1]
ox.save_checkpoint(os.path.join(parent, "warm"), {"w": jnp.ones(3)})
checkpoints.orbax_write = starved_write
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 8, hard))
try:
    ox.save_checkpoint(os.path.join(parent, "step"), {"w": jnp.ones(3)})
except OSError as error:
    outcome = f"errno={error.errno}"
for fd in held:
    os.close(fd)
resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
print("OUTCOME", outcome, sorted(os.listdir(parent)), resource.getrlimit(resource.RLIMIT_NOFILE) == (soft, hard))
"""


def test_a_save_failed_for_open_files_still_held_removes_its_directory(tmp_path):
    """The writers of a save that failed for too many open files may keep theirs open
    until it returns (event loops half-made, kept by the error): its directory, three
    levels deep, is removed all the same, and the limit is as it was."""
    (tmp_path / "run").mkdir()
    done = subprocess.run(
        [sys.executable, "-c", _STARVED, str(tmp_path / "run")],
        env=dict(os.environ, JAX_PLATFORMS="cpu"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert "OUTCOME errno=24 ['warm'] True" in done.stdout, done.stdout + done.stderr[-3000:]


def _mount_small_disk():
    """A command prefix running the subprocess with a 40 KiB tmpfs at `/mnt` (a user
    namespace of its own), or None where that cannot be made."""
    unshare = shutil.which("unshare")
    if unshare is None:
        return None
    prefix = [unshare, "--user", "--map-root-user", "--mount", "sh", "-c"]
    probe = subprocess.run([*prefix, "mount -t tmpfs -o size=40k tmpfs /mnt"], capture_output=True)
    return prefix if probe.returncode == 0 else None


def test_a_real_full_disk_is_the_oserror_naming_the_checkpoint(tmp_path):
    prefix = _mount_small_disk()
    if prefix is None:
        pytest.skip("no user namespace here to mount a small tmpfs in")
    script = tmp_path / "full.py"
    script.write_text(
        "import os, sys, time\n"
        "import jax.numpy as jnp\n"
        "import offload_eqx as ox\n"
        "for n in (1, 20, 200):\n"
        "    try:\n"
        "        ox.save_checkpoint(f'/mnt/step_{n}', {f'w{i}': jnp.arange(4096.0) + i "
        "for i in range(n)})\n"
        "        print('SAVED', n)\n"
        "    except OSError as error:\n"
        "        time.sleep(0.5)\n"
        "        print('FULL', n, error.errno, error.filename, os.listdir('/mnt'), flush=True)\n"
    )
    command = f"mount -t tmpfs -o size=40k tmpfs /mnt && exec {sys.executable} {script}"
    done = subprocess.run(
        [*prefix, command],
        env=dict(os.environ, JAX_PLATFORMS="cpu"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    full = [line.split(" ", 4) for line in done.stdout.splitlines() if line.startswith("FULL")]
    assert full, done.stdout + done.stderr[-3000:]
    for _, n, code, filename, left in full:
        assert (code, filename) == ("28", f"/mnt/step_{n}")
        assert "offload_eqx-tmp" not in left and "orbax-checkpoint-tmp" not in left, left


def test_a_directory_that_cannot_be_removed_is_named_in_a_warning(tmp_path, monkeypatch):
    """Where every attempt to remove a stopped save's directory fails, the caller is told
    which directory is left, not that nothing is."""
    from offload_eqx._checkpoints import private_directory

    left = tmp_path / "step_1.offload_eqx-tmp-abc"
    left.mkdir()
    monkeypatch.setattr(private_directory, "_REMOVE_ATTEMPTS", 2)
    monkeypatch.setattr(private_directory.shutil, "rmtree", lambda *a, **k: None)
    with pytest.warns(UserWarning, match=r"step_1\.offload_eqx-tmp-abc` could not be removed"):
        private_directory._remove(str(left))
    assert left.exists()
