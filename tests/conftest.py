import atexit
import os
import shutil
import tempfile

import pytest

# Before jax is imported anywhere: choose the platform (the CUDA plugin, when installed
# for deviceless compiles, otherwise probes for a driver). Strict dtype promotion is not
# switched on: optax's own Adam mixes Python floats with its int32 step count.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# The tests check what offload_eqx plans, moves and computes, not how fast the machine
# code XLA emits runs: LLVM's optimisations are switched off, which cuts a CPU test's
# compiles by about 40% (tests/test_equivalence.py: 58 s against 102 s). XLA's HLO passes
# run as always, so the compiled programs, memory reports and schedules are the ones users
# get (the planner tests' decoder under `hybrid`: the same optimised HLO and the same
# memory, for the CPU and for the H100). Processes the tests start inherit it.
FAST_COMPILE = ("--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true")
_flags = os.environ.get("XLA_FLAGS", "").split()
os.environ["XLA_FLAGS"] = " ".join(_flags + [f for f in FAST_COMPILE if f not in _flags])

# Many tests compile the same program (a plain-Equinox reference, the same model under a
# strategy another test also runs, the eager ops that build arrays) in different worker
# processes, in the processes tests start, or from a new `jax.jit` of the same function.
# JAX's persistent compilation cache, empty at the start of each session and removed at
# its end, compiles each of them once (`test_real_models.py`, `test_optimizer.py` and
# `test_optimizer_host.py` on two workers: 215 s against 154 s). The process
# that starts the session makes it; the xdist workers and every process a test starts
# inherit it. A directory the caller chose is kept.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _cache = tempfile.mkdtemp(prefix="offload-eqx-tests-jax-cache-")
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"  # every program

# A test over the default session's time budget fails the run (see time_budget.py).
pytest_plugins = ("time_budget", "pytester")


def pytest_addoption(parser):
    parser.addoption(
        "--full",
        action="store_true",
        help="also run the cases marked `full` (every real-model family under every strategy)",
    )


def pytest_configure(config):
    config.addinivalue_line("markers", "deviceless: compiles for h100/tpu-v5p without the hardware")
    config.addinivalue_line("markers", "multidevice: needs 8 CPU devices or 2 processes")
    config.addinivalue_line(
        "markers", "full: a case the default run leaves to `--full` (the test command's time)"
    )


def pytest_collection_modifyitems(config, items):
    if config.getoption("--full"):
        return
    skip = pytest.mark.skip(reason="run with --full")
    for item in items:
        if "full" in item.keywords:
            item.add_marker(skip)
