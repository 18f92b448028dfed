"""Known XLA:GPU faults (`offload_eqx/_base/compiler_faults`, `docs/limits.md`, "Known
compiler faults"): the reversed offsets of offloaded scan residuals (openxla/xla#46231,
#46308), found from the compiled program, named quietly in a deviceless report
(`MemoryReport.compiler_faults`) and refused by `ox.filter_jit` before a GPU run on an
affected release; the annotator's failed compile (openxla/xla#49299), said as our error.
The deviceless tests compile with the installed release's own XLA:GPU: on jax 0.10.2
(affected by #46231) and 0.12.0.1 (fixed)."""

import collections
import warnings
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import make_optimizer, make_step, scanned_model, seed_model

import offload_eqx as ox
from offload_eqx._base import compiler_faults as base_faults
from offload_eqx._base.compiler_faults import (
    FIX,
    REVERSED_OFFSET_RELEASES,
    CompilerFaultError,
)
from offload_eqx._base.hlo_slices import Misannotated, misannotated_host_slices
from offload_eqx._jit import miscompiled
from offload_eqx._targets import compile_memo, compiler_faults
from offload_eqx._targets.deviceless import compile_for, program_of_step
from offload_eqx._targets.targets import get_target

# The backward loop of an offloaded scan of 8 layers, as XLA:GPU compiles it (jaxlib 0.11.0,
# trimmed): the residual stack `f32[8,32,64]` in host memory (`S(5)`) is read back at
# `7 - i` by a slice the host-offload passes moved into a computation of its own.
_LOOP = """
%wrapped_dynamic-slice_computation (param_0.18: f32[8,32,64], param_1.16: s32[], param_2.13: s32[], param_3.7: s32[]) -> f32[1,32,64] {
  %param_0.18 = f32[8,32,64]{2,1,0:S(5)} parameter(0)
  %param_1.16 = s32[] parameter(1)
  %param_2.13 = s32[] parameter(2)
  %param_3.7 = s32[] parameter(3)
  ROOT %dynamic_slice.10.1 = f32[1,32,64]{2,1,0} dynamic-slice(%param_0.18, %param_1.16, %param_2.13, %param_3.7), dynamic_slice_sizes={1,32,64}, backend_config={"operation_queue_id":"0","dynamic_slice_config":WALK}
}

%fused_subtract (param_0.13: s32[]) -> s32[] {
  %constant_16_1 = s32[] constant(7)
  %param_0.13 = s32[] parameter(0)
  ROOT %subtract.2 = s32[] OFFSET(%constant_16_1, %param_0.13)
}

%region_2.11 (arg_tuple.5: (s32[], f32[8,32,64])) -> (s32[], f32[8,32,64]) {
  %arg_tuple.5 = (s32[], f32[8,32,64]{2,1,0:S(5)}) parameter(0)
  %get-tuple-element.39 = s32[] get-tuple-element(%arg_tuple.5), index=0
  %loop_subtract_fusion = s32[] fusion(%get-tuple-element.39), kind=kLoop, calls=%fused_subtract
  %constant_5_0 = s32[] constant(0)
  %get-tuple-element.57 = f32[8,32,64]{2,1,0:S(5)} get-tuple-element(%arg_tuple.5), index=1
  %dynamic-slice-start.1 = ((f32[8,32,64]{2,1,0:S(5)}, s32[], s32[], s32[]), f32[1,32,64]{2,1,0}, u32[]) fusion-start(%get-tuple-element.57, %loop_subtract_fusion, %constant_5_0, %constant_5_0), kind=kLoop, calls=%wrapped_dynamic-slice_computation
  ROOT %tuple.1 = (s32[], f32[8,32,64]{2,1,0:S(5)}) tuple(%get-tuple-element.39, %get-tuple-element.57)
}

ENTRY %main.13 (p: (s32[], f32[8,32,64])) -> (s32[], f32[8,32,64]) {
  %p = (s32[], f32[8,32,64]{2,1,0:S(5)}) parameter(0)
  ROOT %while.17 = (s32[], f32[8,32,64]{2,1,0:S(5)}) while(%p), condition=%region_3.12, body=%region_2.11, backend_config={"known_trip_count":{"n":"8"},"known_init_step":{"init":"0","step":"1"},"known_induction_variable":{"tuple_index":"0"}}
}
"""
ROW = 32 * 64 * 4  # bytes of one residual
# How each release annotates the read (measured, `docs/limits.md`).
FAULTY = '{"loop_index":"0","byte_offset":"0","byte_stride":"8192"}'  # 0.10.2, 0.11.0
RIGHT = '{"loop_index":"0","byte_offset":"57344","byte_stride":"-8192"}'  # 0.11.1, 0.11.2
RIGHT_NESTED = (  # 0.12.0, 0.12.0.1
    '{"loop_index":"0","byte_offset":"0","byte_stride":"0",'
    '"linear":{"byte_offset":"57344","byte_stride":"-8192"}}'
)


def _loop(walk: str, offset: str = "subtract") -> str:
    return _LOOP.replace("WALK", walk).replace("OFFSET", offset)


def test_a_residual_read_forward_in_a_backward_loop_is_found():
    (found,) = misannotated_host_slices(_loop(FAULTY))
    assert found.slice == "dynamic_slice.10.1" and found.loop == "while.17"
    assert found.offsets == (7 * ROW, 6 * ROW)  # read at 7 - i
    assert found.annotated == (0, ROW)  # annotated as if read at i
    assert "addresses bytes 57344, 49152, ... (step -8192)" in str(found)
    assert "annotated 0, 8192, ... (step +8192)" in str(found)


@pytest.mark.parametrize("walk", [RIGHT, RIGHT_NESTED])
def test_a_residual_annotated_as_it_is_read_passes(walk):
    assert misannotated_host_slices(_loop(walk)) == []


def test_an_offset_not_evaluated_here_gives_no_verdict():
    """An operation the checker does not evaluate leaves the slice out, right or wrong."""
    assert misannotated_host_slices(_loop(FAULTY, offset="remainder")) == []


def test_other_errors_and_other_targets_keep_xlas_error():
    class Lowered:
        def compile(self, compiler_options=None):
            raise AssertionError("not compiled again")

    h100, cpu = get_target("h100"), get_target("cpu")
    assert compiler_faults.annotator_fault(RuntimeError("INTERNAL: other"), Lowered(), h100) is None
    failed = RuntimeError(
        "FAILED_PRECONDITION: Failed to evaluate instruction (bitcast.1) since it depends "
        "on infeed or parameters to its parent computation (region_0.10)."
    )
    assert compiler_faults.annotator_fault(failed, Lowered(), cpu) is None


# -- deviceless: the release's own XLA:GPU --------------------------------------------------


def _offloaded_scan_compiled(monkeypatch, strategy: str = "offload_activations") -> str:
    """The seed model's gradient under `strategy`, compiled for the H100 anew (the memo of
    compiled programs emptied), with every warning an error: the compile is quiet."""
    monkeypatch.setattr(compile_memo, "_compiled", collections.OrderedDict())
    model = seed_model(layers=8, width=64, hidden=128)
    x = jax.ShapeDtypeStruct((32, 64), jnp.float32)
    step = ox.filter_jit(lambda m, x: eqx.filter_grad(lambda m: m(x).sum())(m), strategy=strategy)
    program = program_of_step(step, (model, x), {})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return compile_for(program, get_target("h100"), []).as_text()


RESIDUAL = "addresses bytes 57344, 49152, ... (step -8192)"  # 8 x f32[32,64], read at 7 - i
WEIGHTS = "addresses bytes 229376, 196608, ... (step -32768)"  # 8 x f32[64,128]


@pytest.mark.deviceless
@pytest.mark.parametrize("strategy", ["offload_activations", "offload_params"])
def test_the_installed_release_compiles_the_offloaded_scan_as_measured(monkeypatch, strategy):
    """0.10.2 and 0.11.0 annotate the backward loop's slices of host memory (the
    residuals; the host-resident weights and their gradients) forward: the checker finds
    them in the compiled text, the report names them in `compiler_faults`, and nothing is
    warned (the figures are right). 0.11.1 and later annotate them backward: no fault."""
    text = _offloaded_scan_compiled(monkeypatch, strategy)
    found = " ".join(str(slice_) for slice_ in misannotated_host_slices(text))
    model, x = (
        seed_model(layers=8, width=64, hidden=128),
        jax.ShapeDtypeStruct((32, 64), jnp.float32),
    )
    step = ox.filter_jit(lambda m, x: eqx.filter_grad(lambda m: m(x).sum())(m), strategy=strategy)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        report = ox.memory_report(step, model, x, target="h100")
    release = base_faults.installed_release()
    if release in REVERSED_OFFSET_RELEASES:
        assert (RESIDUAL if strategy == "offload_activations" else WEIGHTS) in found
        buffers = {slice_.buffer for slice_ in misannotated_host_slices(text)}
        weights = {"f32[8,64,128]", "f32[8,128,64]"}  # w1, w2 and their gradients
        assert (
            buffers == {"f32[8,32,64]"} if strategy == "offload_activations" else buffers <= weights
        )
        (message,) = report.compiler_faults
        assert f"XLA:GPU of jaxlib {release} miscompiles this program for target 'h100'" in message
        assert "openxla/xla#46231, fixed by openxla/xla#46308" in message and FIX in message
        assert report.as_dict()["compiler_faults"] == [message]
    else:
        assert found == "" and report.compiler_faults == ()
        assert '"byte_offset":"229376","byte_stride":"-32768"' in text  # weights, backward
        if strategy == "offload_activations":
            assert '"byte_offset":"57344","byte_stride":"-8192"' in text  # residuals, backward


def _forward(text: str) -> str:
    """A compiled program's backward residual read annotated forward, as 0.10.2 and 0.11.0
    print it (the installed release's own text where it is fixed)."""
    return text.replace(
        '"byte_offset":"57344","byte_stride":"-8192"', '"byte_offset":"0","byte_stride":"8192"'
    )


@pytest.mark.deviceless
def test_an_affected_release_is_named_with_the_fix(monkeypatch):
    """An affected release simulated on any: its name read from the version, its compiled
    program the installed one's with the read annotated forward."""
    forward = _forward(_offloaded_scan_compiled(monkeypatch))

    class Compiled:
        def as_text(self):
            return forward

    monkeypatch.setattr(base_faults, "installed_release", lambda: "0.11.0")
    (message,) = compiler_faults.faults_of(Compiled(), get_target("h100"))
    assert "XLA:GPU of jaxlib 0.11.0 miscompiles this program for target 'h100'" in message
    assert RESIDUAL in message and "0.11.1, 0.11.2, 0.12.0 and 0.12.0.1 do not" in message
    # The TPU's programs carry no such annotation.
    assert compiler_faults.faults_of(Compiled(), get_target("tpu-v5p")) == ()


# -- ox.filter_jit on a GPU: a miscompiled step refused before it runs ---------------------


def _training(monkeypatch, release: str, on_gpu: bool, found: list):
    """A donating training step of an offloaded scan on this CPU, as if on a GPU
    (`on_gpu`) with jaxlib `release`, whose compiled program the checker finds `found` in;
    the compiled texts it was handed go into the returned list."""
    monkeypatch.setattr(miscompiled, "runs_on_gpu", lambda device: on_gpu)
    monkeypatch.setattr(miscompiled, "installed_release", lambda: release)
    monkeypatch.setattr(base_faults, "installed_release", lambda: release)
    checked: list[str] = []
    monkeypatch.setattr(miscompiled, "reversed_offsets", lambda text: checked.append(text) or found)
    model: Any = scanned_model(jax.random.key(0), depth=4, width=16, hidden=32)
    opt = make_optimizer()
    step = make_step(opt, "offload_activations", donate="all")
    return step, (model, opt.init(model), jnp.ones((8, 16))), checked


@pytest.mark.deviceless
def test_a_gpu_run_on_an_affected_release_is_refused_before_it_runs(monkeypatch):
    """The checker fed the slices the floor's XLA:GPU really misannotates in this kind of
    step (its deviceless H100 compile; on a fixed release, that text annotated forward)."""
    text = _offloaded_scan_compiled(monkeypatch)
    if base_faults.installed_release() not in REVERSED_OFFSET_RELEASES:
        text = _forward(text)
    found = misannotated_host_slices(text)
    assert found
    step, args, checked = _training(monkeypatch, "0.10.2", True, found)
    with pytest.raises(ox.CompilerFaultError) as error:
        step(*args)
    message = str(error.value)
    assert message.startswith("ox.filter_jit(step) was not run (nothing ran, no argument")
    assert "XLA:GPU of jaxlib 0.10.2 miscompiles this program for this machine's GPU" in message
    assert RESIDUAL in message and "openxla/xla#46231, fixed by openxla/xla#46308" in message
    assert "it would walk the wrong way: `f32[8,32,64]` (an offloaded activation)." in message
    assert f"`{FIX}`" in message and "ox.field(memory='device')" in message
    assert "HloModule" in checked[0]  # the program compiled ahead, as it would have run
    entry, _ = step.compilation(*args)
    assert entry.donate_argnums  # the step donates: the arrays passed are still whole
    leaves = jax.tree_util.tree_leaves(eqx.filter(args, eqx.is_array))
    assert not any(leaf.is_deleted() for leaf in leaves)
    assert all(np.isfinite(np.asarray(leaf)).all() for leaf in leaves)
    with pytest.raises(CompilerFaultError):  # refused again, never run
        step(*args)
    compiled = step.lower(*args).compile()  # compiled ahead by hand: inspected, not run
    assert "HloModule" in compiled.as_text()
    with pytest.raises(CompilerFaultError, match=r"ox.filter_jit\(step\) was not run"):
        compiled(*args)
    assert not any(leaf.is_deleted() for leaf in leaves)


def test_the_refusal_names_the_host_leaves_of_each_buffer():
    model = seed_model(layers=8, width=64, hidden=128)
    x = jax.ShapeDtypeStruct((32, 64), jnp.float32)
    step = ox.filter_jit(
        lambda m, x: eqx.filter_grad(lambda m: m(x).sum())(m), strategy="offload_params"
    )
    found = [
        Misannotated(name, "while.19", (0, 0), (0, 0), buffer)
        for name, buffer in [("a", "f32[8,128,64]"), ("b", "f32[8,32,64]"), ("c", "f32[8,128,64]")]
    ]
    assert miscompiled.host_buffers(found, step.plan(model, x).leaves) == (
        "`f32[8,128,64]` (`m.layers.w2` (or its gradient)); `f32[8,32,64]` (an offloaded activation)"
    )


@pytest.mark.parametrize("release, on_gpu", [("0.11.1", True), ("0.10.2", False)])
def test_a_fixed_release_or_another_platform_compiles_nothing_ahead(monkeypatch, release, on_gpu):
    step, args, checked = _training(monkeypatch, release, on_gpu, ["a slice"])
    entry, _ = step.compilation(*args)
    assert type(entry.jitted) is type(jax.jit(len))  # JAX's own: nothing on the call path
    model, state, loss = step(*args)
    assert checked == [] and np.isfinite(loss)
    model, state, loss = step.lower(model, state, args[2]).compile()(model, state, args[2])
    assert checked == [] and np.isfinite(loss)


def test_a_program_that_passes_is_run_by_jit_itself_after_its_check(monkeypatch):
    step, args, checked = _training(monkeypatch, "0.11.0", True, [])
    entry, _ = step.compilation(*args)
    assert type(entry.jitted) is miscompiled._CheckedAtFirstCall
    model, state, loss = step(*args)
    assert len(checked) == 1 and np.isfinite(loss)
    assert type(entry.jitted) is type(jax.jit(len))  # later calls go straight to jit
    step(model, state, args[2])
    assert len(checked) == 1


_TABLE = jnp.asarray(np.linspace(1.0, 0.0, 9), jnp.float32)
_STEPS = jnp.asarray(np.arange(8, dtype=np.float32))
_GRID = jnp.arange(9.0)


def _walk(queries: int):
    """openxla/xla#49299's reproducer: a scan reading a table at a `searchsorted` index."""

    def walk(x):
        def body(x, t):
            index = jnp.searchsorted(_GRID, jnp.full((queries,), t))  # a while loop
            return x * _TABLE[index][0], None

        return jax.lax.scan(body, x, _STEPS)[0]

    return walk


@pytest.mark.deviceless
def test_the_annotators_failed_compile_is_our_error(monkeypatch):
    monkeypatch.setattr(compile_memo, "_compiled", collections.OrderedDict())
    monkeypatch.setattr(compiler_faults, "installed_release", lambda: "0.11.0")
    x = jax.ShapeDtypeStruct((1, 4), jnp.float32)
    with pytest.raises(CompilerFaultError) as error:
        ox.memory_report(_walk(1), x, target="h100")
    message = str(error.value)
    assert "XLA:GPU of jaxlib 0.11.0 cannot compile this program for target 'h100'" in message
    assert "openxla/xla#49299" in message
    assert "`XLA_FLAGS=--xla_disable_hlo_passes=dynamic-slice-annotator`" in message
    assert "XLA said: Failed to evaluate instruction (" in message
    # The fix the message gives compiles: two queries are a gather, not a slice.
    assert ox.memory_report(_walk(2), x, target="h100").device["argument"] > 0
