"""Memory reports: structure and errors on the CPU; the tutorial's savings, in direction and
size, from the real XLA:GPU and XLA:TPU compilers (`-m deviceless`)."""

import dataclasses
import os
import subprocess
import sys
from typing import Any, cast

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
import pytest
from helpers import seed_model

import offload_eqx as ox
from offload_eqx import compare_memory, memory_report
from offload_eqx._base.table import format_bytes
from offload_eqx._targets.targets import TARGETS, Target, get_target

MiB = 2**20
LAYERS, BATCH, WIDTH, HIDDEN = 10, 256, 256, 1024
PARAM_BYTES = 2 * LAYERS * WIDTH * HIDDEN * 4  # 20 MiB
ACTIVATION_BYTES = LAYERS * BATCH * WIDTH * 4  # the offloaded x: 2.5 MiB


def grad_step(model, x):
    return eqx.filter_grad(lambda m: jnp.sum(m(x)))(model)


def abstract_model(layers=LAYERS):
    model = seed_model(layers, WIDTH, HIDDEN, memory="device")
    return model, jax.ShapeDtypeStruct((BATCH, WIDTH), jnp.float32)


def report(strategy, target):
    model, x = abstract_model()
    return memory_report(ox.filter_jit(grad_step, strategy=strategy), model, x, target=target)


# -- CPU: structure and errors ---------------------------------------------------------------


def test_report_structure_and_total():
    r = report("baseline", "cpu")
    assert r.target == "cpu"
    assert set(r.device) == set(r.host) == {"temp", "argument", "output", "alias", "generated_code"}
    d = r.device
    assert r.total == d["temp"] + d["argument"] + d["output"] - d["alias"]
    assert d["argument"] == PARAM_BYTES + BATCH * WIDTH * 4
    assert PARAM_BYTES <= d["output"] < PARAM_BYTES + 1024  # plus the output tuple
    assert r.as_dict()["total"] == r.total
    assert "device" in str(r) and "host" in str(r)


def test_plain_function_with_memories_and_donation():
    def f(w, x):
        return jnp.sum(x @ jax.device_put(w, jax.memory.Space.Device)), x + 1

    w = jax.ShapeDtypeStruct((64, 64), jnp.float32)
    x = jax.ShapeDtypeStruct((64, 64), jnp.float32)
    r = memory_report(
        jax.jit(f), w, x, target="cpu", in_memory=("pinned_host", None), donate_argnums=(1,)
    )
    assert r.name == "f"
    assert r.device["argument"] == 2 * 64 * 64 * 4  # CPU counts host arguments as device
    assert r.device["alias"] == 64 * 64 * 4
    # One index, as `jax.jit` takes it.
    one = memory_report(jax.jit(f), w, x, in_memory=("pinned_host", None), donate_argnums=1)
    assert one.device == r.device


def test_compare_memory_table():
    model, x = abstract_model(layers=2)
    comparison = compare_memory(
        {
            "baseline": (ox.filter_jit(grad_step, strategy="baseline"), (model, x)),
            "remat": (ox.filter_jit(grad_step, strategy="remat"), (model, x)),
        },
        target="cpu",
    )
    text = str(comparison)
    assert "baseline" in text and "remat" in text and "vs first" in text
    reports = comparison.reports
    assert reports[("remat", "cpu")].device["temp"] < reports[("baseline", "cpu")].device["temp"]
    assert len(comparison.as_dict()) == 2


def test_unknown_target_lists_known_targets():
    with pytest.raises(ValueError, match=r"Unknown target 'h200'; expected one of 'cpu', 'h100'"):
        report("baseline", "h200")
    with pytest.raises(ValueError, match="Unknown target"):
        compare_memory({}, target=["cpu", "v100"])


@pytest.mark.parametrize(
    "target, module, extra",
    [("h100", "jax_plugins.xla_cuda12", "cuda"), ("tpu-v5p", "libtpu", "tpu")],
)
def test_missing_extra_names_the_extra_and_pip_command(monkeypatch, target, module, extra):
    monkeypatch.setitem(sys.modules, module, None)  # `import module` now raises ImportError
    pattern = rf"optional extra '{extra}'.*pip install 'offload_eqx\[{extra}\]'"
    with pytest.raises(ImportError, match=pattern):
        report("baseline", target)


def test_bad_memory_and_bad_program():
    w = jax.ShapeDtypeStruct((8, 8), jnp.float32)
    with pytest.raises(ValueError, match=r"in_memory gives memory 'gpu'.*expected one of"):
        memory_report(lambda w: w * 2, w, target="cpu", in_memory="gpu")
    with pytest.raises(TypeError, match=r"program 'p' is"):
        compare_memory({"p": (lambda w: w,)}, target="cpu")
    with pytest.raises(ValueError, match="compiled from its plan"):
        memory_report(ox.filter_jit(lambda w: w * 2), w, target="cpu", in_memory="device")


def test_targets_are_described():
    assert {"cpu", "h100", "h100-8", "tpu-v5p", "tpu-v5p-4"} <= set(TARGETS)
    assert get_target(TARGETS["h100"]) is TARGETS["h100"]
    assert isinstance(get_target("a100"), Target) and get_target("a100").extra == "cuda"


# -- issue 10 item 9: does the program fit the target? ----------------------------------------


def test_targets_know_their_device_memory():
    # h100/a100: `device_memory_size` of their GpuTargetConfig; TPUs: Google's published
    # HBM per chip (95 GB v5p, 16 GB v5e, 32 GB v6e); the CPU: unknown.
    assert TARGETS["h100"].capacity == TARGETS["h100-8"].capacity == 84_978_434_048
    assert TARGETS["a100"].capacity == 80 * 2**30
    assert TARGETS["tpu-v5p"].capacity == TARGETS["tpu-v5p-4"].capacity == 95 * 10**9
    assert (TARGETS["tpu-v5e"].capacity, TARGETS["tpu-v6e"].capacity) == (16e9, 32e9)
    assert TARGETS["cpu"].capacity is None


def test_report_says_whether_the_program_fits():
    w = jax.ShapeDtypeStruct((64, 64), jnp.float32)
    tiny = Target("cpu-1kib", "cpu", capacity=1024, description="a CPU with 1 KiB")
    small = memory_report(lambda w: w * 2, w, target=tiny)
    assert (small.capacity, small.fits) == (1024, False)
    needs = format_bytes(small.total)
    assert f"does not fit: needs {needs}, the cpu-1kib has 1.00 KiB" in str(small)
    assert small.as_dict()["fits"] is False
    roomy = memory_report(lambda w: w * 2, w, target=dataclasses.replace(tiny, capacity=2**30))
    assert roomy.fits is True
    assert f"fits: needs {needs} of the 1.00 GiB the cpu-1kib has" in str(roomy)
    unknown = memory_report(lambda w: w * 2, w, target="cpu")
    assert unknown.fits is None and "fit not checked" in str(unknown)
    table = str(compare_memory({"w": (lambda w: w * 2, (w,))}, target=tiny))
    assert "fits" in table.splitlines()[1]
    assert f"w: does not fit: needs {needs}" in table


# -- deviceless: the tutorial's savings from the real compilers -------------------------------

DEVICELESS = ["h100", "tpu-v5p"]


@pytest.mark.deviceless
@pytest.mark.parametrize("target", DEVICELESS)
def test_activation_offload_cuts_device_temp(target):
    baseline, offload = report("baseline", target), report("offload_activations", target)
    # The offloaded x lives in host memory: exactly its bytes.
    assert baseline.host["temp"] == 0
    assert offload.host["temp"] == ACTIVATION_BYTES
    # The device temp falls by at least the bytes moved to the host (h100 18.50 -> 5.50 MiB,
    # tpu-v5p 17.69 -> 11.28 MiB), and nothing else changes.
    assert baseline.device["temp"] - offload.device["temp"] >= ACTIVATION_BYTES
    assert offload.device["argument"] == baseline.device["argument"]
    assert offload.total < baseline.total


@pytest.mark.deviceless
@pytest.mark.parametrize("target", DEVICELESS)
def test_parameter_offload_moves_parameters_to_host_arguments(target):
    activations, hybrid = report("offload_activations", target), report("hybrid", target)
    assert activations.device["argument"] - hybrid.device["argument"] == PARAM_BYTES
    assert hybrid.host["argument"] - activations.host["argument"] == PARAM_BYTES
    # The gradients of host-resident parameters are host-typed: host outputs.
    assert PARAM_BYTES <= hybrid.host["output"] < PARAM_BYTES + 1024
    assert hybrid.total < 8 * MiB  # h100 6.51 MiB, tpu-v5p 5.09 MiB (tutorial: 25.00)


@pytest.mark.deviceless
@pytest.mark.parametrize("target", DEVICELESS)
def test_host_argument_compiles_as_host_memory(target):
    """The silent trap: on compile-only GPUs a `pinned_host` sharding built on the concrete
    mesh becomes device memory. The report must show it as host argument bytes."""

    def f(w, x):
        return x @ jax.device_put(w, jax.memory.Space.Device)

    w = jax.ShapeDtypeStruct((512, 512), jnp.float32)
    x = jax.ShapeDtypeStruct((128, 512), jnp.float32)
    r = memory_report(
        f, w, x, target=target, in_memory=("pinned_host", "device"), out_memory="pinned_host"
    )
    assert r.host["argument"] == 512 * 512 * 4
    assert r.device["argument"] == 128 * 512 * 4
    assert r.host["output"] == 128 * 512 * 4
    assert r.device["output"] == 0


@pytest.mark.deviceless
def test_optimizer_offload_moves_state_to_host_arguments():
    dim = 256
    p = dim * dim * 4

    class MLP(eqx.Module):
        w1: jax.Array = ox.field()
        w2: jax.Array = ox.field()

        def __call__(self, x):
            return jax.nn.gelu(jax.nn.gelu(x @ self.w1) @ self.w2)

    opt = ox.offload_optimizer(optax.chain(optax.clip_by_global_norm(1.0), optax.adam(0.1)))
    w = jax.ShapeDtypeStruct((dim, dim), jnp.float32)
    weight = cast(jax.Array, w)  # abstract: nothing is allocated
    model = MLP(weight, weight)
    state = eqx.filter_eval_shape(opt.init, model)

    def step(model, state, x):
        grads = jax.grad(lambda m: jnp.mean((m(x) - x) ** 2))(model)
        updates, state = opt.update(grads, state, model)
        return ox.apply_updates(model, updates), state

    reports = {
        s: memory_report(
            ox.filter_jit(step, strategy=s, donate="all"), model, state, w, target="h100"
        )
        for s in ("baseline", "offload_optimizer")
    }
    baseline, offload = reports["baseline"], reports["offload_optimizer"]
    # Adam's mu and nu of both weights: 4P move from device to host arguments (the count
    # scalar stays on the device).
    assert baseline.device["argument"] - offload.device["argument"] == 4 * p
    assert offload.host["argument"] == 4 * p
    assert 4 * p <= offload.host["output"] < 4 * p + 1024


@pytest.mark.deviceless
def test_a_model_larger_than_the_device_does_not_fit():
    # 24 Gi float32 = 96 GiB of argument: more than an H100's 79.14 GiB.
    w = jax.ShapeDtypeStruct((24, 2**30), jnp.float32)
    r = memory_report(lambda w: jnp.sum(w, axis=1), w, target="h100")
    assert r.fits is False and r.capacity is not None and r.total > r.capacity
    assert "does not fit" in str(r) and "the h100 has 79.14 GiB" in str(r)


@pytest.mark.deviceless
def test_xla_log_lines_of_a_program_over_capacity_stay_off_the_terminal(capfd):
    """XLA's rematerialisation gives up on a program over the capacity and logs it: the
    report keeps those lines (`compiler_log`), the terminal shows none of them."""
    w = jax.ShapeDtypeStruct((24, 2**30), jnp.float32)
    r = memory_report(lambda w: jnp.sin(w) @ jnp.cos(w).T, w, target="h100")
    assert r.fits is False
    assert any("Can't reduce memory use" in line for line in r.compiler_log), r.compiler_log
    assert "Can't reduce memory use" not in capfd.readouterr().err
    # The same program again is not compiled again, and its report keeps the lines.
    again = memory_report(lambda w: jnp.sin(w) @ jnp.cos(w).T, w, target="h100")
    assert again.compiler_log == r.compiler_log


def _backend_compiles() -> list[float]:
    """The durations of XLA's compiles from now on (jax's monitoring events)."""
    durations: list[float] = []

    def listen(event: str, duration_secs: float, **kwargs: Any) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            durations.append(duration_secs)

    jax.monitoring.register_event_duration_secs_listener(listen)
    return durations


@pytest.mark.deviceless
def test_a_program_is_compiled_for_a_target_once_per_process():
    """`ox.fit`, then `ox.estimate` or `ox.memory_report` of the plan it chose, compile
    the same program: XLA:GPU spends seconds on each, so it is compiled once. A program
    that differs (another function, shape or target) is compiled."""
    w = jax.ShapeDtypeStruct((256, 512), jnp.float32)
    compiles = _backend_compiles()

    def f(w):
        return jnp.tanh(w) @ w.T

    first = memory_report(f, w, target="h100")
    assert len(compiles) == 1
    assert memory_report(f, w, target="h100") == first
    assert len(compiles) == 1
    memory_report(f, jax.ShapeDtypeStruct((256, 256), jnp.float32), target="h100")
    memory_report(lambda w: jnp.sin(w) @ w.T, w, target="h100")
    memory_report(f, w, target="tpu-v5p")
    assert len(compiles) == 4


@pytest.mark.deviceless
def test_a_deviceless_compile_stays_out_of_the_persistent_cache(tmp_path, monkeypatch):
    """With JAX's persistent compilation cache on (as many users set it), a program
    compiled for the H100 was written there, and the next process to compile it read it
    back with "Error reading persistent compilation cache entry ... PjRtCompiler must be
    constructed with a Client" on stderr. (The CPU's compiles still use the cache: the test
    session's own, `conftest.py`.)"""
    from snippets import run_script

    cache = tmp_path / "cache"
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(cache))
    monkeypatch.setenv("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    script = (
        "import jax, jax.numpy as jnp, offload_eqx as ox\n"
        "w = jax.ShapeDtypeStruct((128, 128), jnp.float32)\n"
        "print(ox.memory_report(lambda w: jnp.tanh(w) @ w, w, target='h100').device)\n"
    )
    first, second = (run_script(script, tmp_path, timeout=300) for _ in range(2))
    assert first.returncode == second.returncode == 0, second.stderr[-2000:]
    assert first.stdout == second.stdout and second.stderr == "", second.stderr[-2000:]
    assert not list(cache.glob("*flat*"))


def test_a_compile_on_the_attached_accelerator_uses_the_persistent_cache(monkeypatch):
    """Only a compile made without the device stays out of the cache: on a machine with
    the target's chip (a GPU machine compiling for "h100"), the program is an ordinary
    one, and a later run of the same step finds it on disk (`gpu_check.py` counts on
    this). Found on the first GPU run: every compile for the H100 skipped the cache."""
    from jax._src import config as jax_config

    from offload_eqx._targets import compile_memo

    h100 = ox.TARGETS["h100"]
    kept_out = compile_memo._kept_out_of_the_persistent_cache_if_deviceless
    default = jax_config.persistent_cache_min_compile_time_secs.value
    with kept_out(h100):
        assert jax_config.persistent_cache_min_compile_time_secs.value == float("inf")
    monkeypatch.setattr(compile_memo, "attached_devices", lambda target: tuple(jax.devices()))
    with kept_out(h100):
        assert jax_config.persistent_cache_min_compile_time_secs.value == default


def test_only_the_most_recent_programs_are_kept(monkeypatch):
    from offload_eqx._targets import compile_memo

    monkeypatch.setattr(compile_memo, "KEEP", 1)
    compiles = _backend_compiles()
    w = jax.ShapeDtypeStruct((8, 8), jnp.float32)
    memory_report(jnp.sin, w)
    memory_report(jnp.cos, w)  # pushes out the first
    memory_report(jnp.cos, w)
    memory_report(jnp.sin, w)
    assert len(compiles) == 3


@pytest.mark.deviceless
def test_importing_with_the_accelerator_extras_is_quiet():
    """Issue 10 item 11: with the `cuda` and `tpu` extras installed, importing jax and
    offload_eqx, creating this machine's devices and compiling for an h100 print nothing on
    stderr, in the environment the sessions run in (noxfile.py's CPU_ENV).

    "Could not find cuda drivers" comes from the cudart stub of every CUDA module of the
    plugin when `libcudart.so.12` is missing: nvcc's static initializer registers the
    module's kernels while the library is loaded, before TSL reads TF_CPP_MIN_LOG_LEVEL, so no
    environment variable silences it; the `cuda` extra installs the CUDA runtime instead."""
    code = (
        "import jax, jax.numpy as jnp, offload_eqx as ox; jax.devices(); "
        "r = ox.memory_report(lambda w: w * 2, jax.ShapeDtypeStruct((8,), jnp.float32),"
        " target='h100'); assert r.fits, r"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=dict(os.environ),
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert "Could not find cuda drivers" not in result.stderr, (
        "libcudart.so.12 is not installed next to jax_cuda12_plugin: the `cuda` extra in "
        "pyproject.toml must include nvidia-cuda-runtime-cu12.\n" + result.stderr
    )
    assert result.stderr == "", result.stderr


def test_an_unknown_target_is_refused_before_the_step_is_traced():
    traced = []

    def step(x):
        traced.append(1)
        return x

    with pytest.raises(ValueError, match="Unknown target 'h200'"):
        memory_report(ox.filter_jit(step), jnp.ones(3), target="h200")
    with pytest.raises(ValueError, match="Unknown target 'h200'"):
        memory_report(step, jnp.ones(3), target="h200")
    assert not traced


@pytest.mark.filterwarnings("ignore:Some donated buffers were not usable")  # the batch's
def test_a_plain_equinox_step_returning_a_module_is_reported_with_its_donation():
    """`eqx.filter_jit(..., donate="all")` returning an `eqx.nn.MLP` (its activation is a
    field, not an array): the report counts the arrays it returns and aliases what the
    step donates, as it runs."""
    import equinox as eqx

    mlp = eqx.nn.MLP(64, 64, 128, depth=2, key=jax.random.key(0))

    def sgd(model, x):
        grads = eqx.filter_grad(lambda m: jnp.mean(jax.vmap(m)(x) ** 2))(model)
        return eqx.apply_updates(model, jax.tree_util.tree_map(lambda g: -0.1 * g, grads))

    x = jnp.ones((8, 64))
    kept = ox.memory_report(eqx.filter_jit(sgd), mlp, x)
    donated = ox.memory_report(eqx.filter_jit(sgd, donate="all"), mlp, x)
    size = sum(a.nbytes for a in jax.tree_util.tree_leaves(eqx.filter(mlp, eqx.is_array)))
    leaves = len(jax.tree_util.tree_leaves(eqx.filter(mlp, eqx.is_array)))
    assert size <= kept.device["output"] <= size + 8 * leaves  # and the result tuple's table
    assert kept.device["alias"] == 0 and donated.device["alias"] == size
