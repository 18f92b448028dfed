"""Sessions for offload_eqx. Every session installs what it needs into its own venv.

nox -s tests            # every single-process test on jax 0.10.2, the newest's part on 0.12.0.1
nox -s deviceless       # only the memory reports from the real XLA:GPU / XLA:TPU compilers
nox -s multidevice      # tests on 8 CPU devices and across 2 processes
nox -s lint typecheck   # ruff, pyright
nox -s experiments      # the experiments on small defaults (--smoke)
nox -s benchmarks       # dispatch overhead, audit time, step time, compiled FLOPs, GPU check
nox -s docs             # the documentation site into site/ (mkdocs --strict)
"""

import glob
import os

import nox

nox.options.default_venv_backend = "uv|virtualenv"
nox.options.reuse_venv = "yes"
nox.options.sessions = ["lint", "typecheck", "tests", "multidevice", "docs"]


def _python(version: str) -> str:
    """Python `version`'s interpreter: pyenv's where it has one (its `python3.12` shim
    answers only for the versions pyenv is told to use), else as nox finds it."""
    root = os.environ.get("PYENV_ROOT", os.path.expanduser("~/.pyenv"))
    found = sorted(glob.glob(f"{root}/versions/{version}.*/bin/python{version}"))
    return found[-1] if found else version


# The JAX pairs the project is tested on, each pinned whole by constraints/jax-<jax>.txt:
# the oldest JAX offload_eqx supports (0.10.2, on the oldest Python), and the newest JAX
# served (0.12.0.1: JAX from 0.11 on needs Python 3.12). The README's and the docs'
# printed numbers are the floor's compiler output (tests/snippets.py: elsewhere the
# verdicts are compared). Everything runs on the floor; the newest JAX runs NEWEST_PART.
FLOOR, NEWEST = "0.10.2", "0.12.0.1"
PYTHON = _python("3.11")
CELLS = [(PYTHON, FLOOR), (_python("3.12"), NEWEST)]
CELL_IDS = ["floor", "newest"]
# What the newest JAX runs: where offload_eqx meets JAX's and Equinox's private names and
# XLA's behaviour (host computations, callbacks, deviceless compiles, the FFI kernel),
# the users' everyday surface (annotate, filter_jit as Equinox's drop-in, audit, memory,
# masters, layer splits), the README's examples, the published libraries and models
# written as their authors write them (`user_models`), XLA:GPU's
# known faults (fixed in 0.12.0.1, not in 0.10.2), the GPU-host proof's isolation and
# ox.fit's compiling child (XLA's compile entry, its aborts). Left to
# the floor: the planner's searches and the step-time model (pure Python over XLA's text,
# the same on both; their compiles take the most time), the real-model families under
# every strategy, the docs pages, the kernel's build and trust checks (files and
# permissions; `test_fused_adamw` loads it on both), the checkpoints (Orbax's I/O; their
# resumes in new processes took a minute of the newest's five).
NEWEST_PART = tuple(
    f"tests/test_{name}.py"
    for name in (
        "annotate", "jit", "audit", "memory", "masters", "layer_split", "drop_in", "readme",
        "fused_adamw", "host_split", "host_chunks", "callbacks", "flops",
        "published_libraries", "jax_versions", "gpu_host_kernels", "gpu_host_proof",
        "compiler_faults", "nested_scans", "fit_faults", "user_models",
    )
)  # fmt: skip
# The one XLA limit tested among the step-time model's tests.
NEWEST_PART += (
    "tests/test_schedule.py::"
    "test_h100_a_host_computation_in_a_loop_returns_its_results_to_the_device",
)


def _install(session: nox.Session, jax: str, extras: str) -> None:
    """The package with `extras`, every dependency at the version `jax`'s pair pins."""
    session.install("-c", f"constraints/jax-{jax}.txt", "-e", f".[{extras}]")


# A bare `import jax` with the CUDA plugin installed looks for a driver and prints errors;
# this project only ever compiles for GPUs, so the platform is always chosen.
CPU_ENV = {
    "JAX_PLATFORMS": "cpu",
    "TPU_ACCELERATOR_TYPE": "v5p-8",
    "TPU_WORKER_HOSTNAMES": "localhost",
}


# pytest-xdist workers, one per core. One process running the whole suite crashed in an
# XLA:CPU compile near its end (a segfault, 2026-11-26) where two workers, each compiling
# half, passed. `loadgroup`: the tests of an `xdist_group` share a worker, so a module
# fixture that compiles for minutes (test_fit.py) or a reference run cached per case
# (helpers.rotated) is computed once, not once per worker. `-- -n 0` runs one process.
# A worker that crashes is not replaced: under `loadgroup`, pytest-xdist 3.8.0 hangs
# after replacing one (its issues #1323 and #1378; seen here 2026-11-28 after an XLA:CPU
# segfault), which would hold CI until its 90 minutes run out; the crash fails the run.
PARALLEL = ("-n", "auto", "--dist", "loadgroup", "--max-worker-restart=0")


def _pytest(session: nox.Session, *args: str, env: dict[str, str] | None = None) -> None:
    session.run("pytest", *args, *session.posargs, env={**CPU_ENV, **(env or {})})


def time_budget() -> tuple[str, ...]:
    """`--time-budget` (tests/time_budget.py) where CI asks for it (`.ci/run` sets
    `OFFLOAD_EQX_TIME_BUDGET=1`): a user's run is never failed for its machine's time."""
    return ("--time-budget",) if os.environ.get("OFFLOAD_EQX_TIME_BUDGET") == "1" else ()


@nox.session
@nox.parametrize("python,jax", CELLS, ids=CELL_IDS)
def tests(session: nox.Session, jax: str) -> None:
    """Every single-process test, CPU unit tests and deviceless compiles in one pool of
    workers (each keeps the other busy), on the floor JAX; `NEWEST_PART` on the newest:
    `nox -s tests` (both), `nox -s "tests(floor)"` (pytest options after `--`; only the
    CPU unit tests: `-- -m "not deviceless and not multidevice"`)."""
    _install(session, jax, "test,checkpoint,cuda,tpu")
    # The slowest tests, printed at the end, and on CI a test's setup or call over the
    # budget (tests/time_budget.py) fails the run: the next feature cannot add minutes
    # unseen.
    # With `--full`, every module is type-checked at run time (pyproject.toml leaves the
    # step-time model's inner loops out of the default session).
    every = ("--jaxtyping-packages=offload_eqx,beartype.beartype",)
    full = "--full" in session.posargs
    # Without JAX's persistent compilation cache (tests/conftest.py) with `--full`: two
    # whole `--full` runs (2026-11-28) each crashed a worker with a segfault inside XLA:CPU
    # serialising an executable for that cache; no default run has.
    env = {"JAX_ENABLE_COMPILATION_CACHE": "false"} if full else {}
    checks = every if full else ()
    part = NEWEST_PART if jax == NEWEST and not full else ()
    _pytest(
        session,
        *PARALLEL,
        "--durations=25",
        *time_budget(),
        *checks,
        "-m",
        "not multidevice",
        *part,
        env=env,
    )


@nox.session(python=PYTHON)
def multidevice(session: nox.Session) -> None:
    """Tests on 8 CPU devices and two processes: `nox -s multidevice` (the first 8-device
    test runs them all in one child pytest with 8 devices, beside the tests that start
    processes of their own). With the `tpu` extra: a Pallas kernel on a 4-chip mesh is
    compiled for `tpu-v5p-4`."""
    _install(session, FLOOR, "test,checkpoint,tpu")
    _pytest(session, *PARALLEL, "-m", "multidevice")


@nox.session
@nox.parametrize("python,jax", CELLS, ids=CELL_IDS)
def deviceless(session: nox.Session, jax: str) -> None:
    """Deviceless h100 and tpu-v5p memory reports, each JAX with its own plugin and
    libtpu: `nox -s deviceless` (`"deviceless(newest)"`: on the newest JAX only)."""
    _install(session, jax, "test,checkpoint,cuda,tpu")
    _pytest(session, *PARALLEL, "-m", "deviceless")


@nox.session(python=PYTHON)
def lint(session: nox.Session) -> None:
    """ruff: `nox -s lint`."""
    session.install("ruff==0.17.6")
    paths = ("offload_eqx", "tests", "experiments", "docs/_hooks.py", "noxfile.py")
    paths += ("hatch_build.py",)
    session.run("ruff", "check", *paths, *session.posargs)
    session.run("ruff", "format", "--check", *paths)


@nox.session(python=PYTHON)
def typecheck(session: nox.Session) -> None:
    """pyright on the package and the tests: `nox -s typecheck`."""
    _install(session, FLOOR, "test,checkpoint,lint")
    session.run("pyright", *session.posargs)


@nox.session(python=PYTHON)
def experiments(session: nox.Session) -> None:
    """All experiments on small defaults: `nox -s experiments` (`-- --full` for full sizes)."""
    _install(session, FLOOR, "experiments,checkpoint,cuda,tpu")
    size = "--full" if "--full" in session.posargs else "--smoke"
    for script in sorted(os.listdir("experiments")):
        if script.endswith(".py") and not script.startswith("_"):
            session.run("python", f"experiments/{script}", size, env=CPU_ENV)


@nox.session(python=PYTHON)
def docs(session: nox.Session) -> None:
    """The documentation site into `site/`: `nox -s docs` (`-- serve` to preview it)."""
    _install(session, FLOOR, "docs")
    # mkdocs-material prints a banner about its end of life on every build otherwise.
    env = {**CPU_ENV, "NO_MKDOCS_2_WARNING": "1"}
    if session.posargs[:1] == ["serve"]:
        session.run("mkdocs", "serve", *session.posargs[1:], env=env)
    else:
        session.run("mkdocs", "build", "--strict", *session.posargs, env=env)


@nox.session(python=PYTHON)
def benchmarks(session: nox.Session) -> None:
    """Benchmarks (dispatch overhead, audit time, predicted step time, compiled FLOPs):
    `nox -s benchmarks`."""
    _install(session, FLOOR, "test,cuda")  # compiled_flops.py compiles for an H100
    for script in sorted(os.listdir("benchmarks")):
        if script.endswith(".py"):
            session.run("python", f"benchmarks/{script}", *session.posargs, env=CPU_ENV)
