"""Issue 49: the optimizer update on the host priced as XLA:CPU runs it, and this machine's
host measured.

A host computation is one loop per result (XLA:CPU fuses one result per loop): AdamW with
float32 masters for bfloat16 parameters moves 42 bytes a parameter, not the 28 of one
fused pass; it streams at the threads XLA gives it, at most the host's bandwidth."""

import pathlib
import sys
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import offload_eqx as ox
from offload_eqx._inspect.memory_report import compiled_report
from offload_eqx._planning.hlo import parse_module
from offload_eqx._planning.host_work import host_bytes, host_computation_bandwidth
from offload_eqx._targets.deviceless import program_of_step
from offload_eqx._targets.targets import get_target


class Params(eqx.Module):
    a: Any  # arrays, or their shapes
    b: Any


def _masters_step(delay: int = 0):
    opt = ox.offload_optimizer(
        optax.adamw(1e-4), update_on="host", master_dtype=jnp.float32, delay=delay
    )

    # Delayed on XLA:GPU, computed whole (one call) as `update="host"` asks, not in slices.
    whole = ox.Strategy("whole", update="host")

    @ox.filter_jit(donate="all-except-first", strategy=whole)
    def step(grads, model, state):
        return ox.update_and_apply(opt, grads, state, model)

    shape = (256, 1024)
    wide = Params(*(jax.ShapeDtypeStruct(shape, jnp.float32) for _ in range(2)))
    narrow = Params(*(jax.ShapeDtypeStruct(shape, jnp.bfloat16) for _ in range(2)))
    state = eqx.filter_eval_shape(opt.init, wide)
    return step, (narrow, narrow, state), 2 * shape[0] * shape[1]


@pytest.mark.deviceless
@pytest.mark.parametrize("delay", [0, 1])
def test_an_adamw_update_with_masters_moves_a_pass_per_result_on_the_h100(delay, monkeypatch):
    """Where the kernel is not on the GPU's host (`ox.host_kernels()` says why), the
    update runs as XLA:GPU's host compiler builds it. Delayed, the update is a conditional
    (nothing is applied at the first step): its costlier branch, once, not the
    conditional's whole state for every result."""
    from offload_eqx._host.kernels import gpu_host

    monkeypatch.setattr(gpu_host, "target", lambda name: None)
    step, args, parameters = _masters_step(delay)
    _, compiled = compiled_report(program_of_step(step, args, {}), get_target("h100"), "step")
    module = parse_module(compiled.as_text())
    entry = module.entry_computation
    starts = [i for i in entry.instructions if i.opcode == "custom-call-start"]
    # Undelayed, one call per parameter (`on_host(split=True)`); delayed and whole, one.
    assert len(starts) == (1 if delay else 2), [i.calls for i in starts]
    per_parameter = sum(host_bytes(module, name) for i in starts for name in i.calls) / parameters
    # mu 10, nu 10, master 16 (reads mu' and nu' back), parameter 6: 42; one pass is 28.
    # Delayed, the pending gradients are float32 (the masters' dtype), read by two passes.
    assert 40 + 4 * delay <= per_parameter <= 44 + 4 * delay, per_parameter


def test_a_host_computation_streams_at_its_threads_at_most_the_host():
    h100 = get_target("h100").speeds
    assert h100 is not None
    assert host_computation_bandwidth(h100) == h100.host_bandwidth  # 14 cores x 20 > 77
    few = ox.Speeds(**{**h100.__dict__, "host_threads": 2})
    assert host_computation_bandwidth(few) == 2 * h100.host_thread_bandwidth
    unset = ox.Speeds(**{**h100.__dict__, "host_threads": 0})
    assert host_computation_bandwidth(unset) == h100.host_bandwidth


def test_calibrate_host_measures_this_machine_into_a_target():
    target = ox.calibrate_host("h100")
    assert target.name == "h100+host" and target.platform == "cuda"
    speeds = target.speeds
    assert speeds is not None and "ox.calibrate_host" in speeds.source
    assert 1e9 < speeds.host_thread_bandwidth <= speeds.host_bandwidth < 1e12
    assert speeds.host_threads >= 1
    published = get_target("h100").speeds
    assert published is not None and speeds.flops == published.flops  # the GPU's unchanged
    assert "h100+host" not in ox.TARGETS


def test_calibrate_host_refuses_a_target_without_datasheet_speeds():
    with pytest.raises(ValueError, match=r"calibrate_host\('cpu'\).*pass a target such as 'h100'"):
        ox.calibrate_host("cpu")


def test_the_benchmark_decoder_layout_has_the_decoders_leaves():
    benchmarks = str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks")
    sys.path.insert(0, benchmarks)
    try:
        from _host_update_cases import _leaf_shapes  # pyright: ignore[reportMissingImports]
    finally:
        sys.path.remove(benchmarks)
    shapes = _leaf_shapes(10_000_000, "decoder")
    assert len(shapes) >= 10 and abs(sum(int(np.prod(s)) for s in shapes) - 1e7) < 3e6


def _nbytes(tree) -> int:
    return sum(x.size * jnp.dtype(x.dtype).itemsize for x in jax.tree_util.tree_leaves(tree))


def test_a_host_update_with_masters_writes_parameters_and_state_in_place_on_the_cpu():
    """`step(grads, model, state)` donating all but the gradients: the new model is the
    model's (not the gradients', which have its structure) and the parameters, which an
    optimizer with masters does not read, keep their buffers: every byte but the
    gradients' is aliased, so no output is allocated afresh."""
    step, (grads, model, state), _ = _masters_step()
    report = ox.memory_report(step, grads, model, state, target="cpu")
    assert report.device["alias"] == _nbytes(model) + _nbytes(state)
    assert report.device["argument"] == _nbytes(grads) + _nbytes(model) + _nbytes(state)


def test_the_host_update_benchmark_runs_its_candidates(tmp_path):
    """`benchmarks/host_update.py --smoke` (one case here): every candidate timed in one
    process, the ratios of the same run, the JSON written."""
    import json
    import os
    import subprocess

    script = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "host_update.py"
    command = [sys.executable, str(script), "--smoke", "--no-estimate", "--layouts", "4"]
    command += ["--moments", "float32", "--out", str(tmp_path)]
    done = subprocess.run(command, capture_output=True, text=True, env={**os.environ})
    assert done.returncode == 0, done.stderr[-3000:]
    (row,) = json.loads((tmp_path / "host_update-all.json").read_text())["rows"]
    assert row["ox"] > 0 and row["jax.jit"] > 0 and row["ox / jax.jit"] > 0
    if "fused C" in row:  # a C compiler was found
        assert row["ox / fused C"] > 0 and 0 < row["roofline fraction"]
