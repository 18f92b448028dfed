"""A delayed host update spans the step on XLA:GPU (`_host/overlap_schedule`).

ZeRO-Offload's declaration (bfloat16 parameters on the device, float32 masters and AdamW
moments in host memory, the update on the host, delayed) compiled for the h100 without
the hardware: XLA's scheduler gives the host call a fixed latency and placed it after
both loops; compiled again with a profile naming the call, it starts before the forward
loop and is waited for after the backward loop. A spanning program that would not fit
where the first did is not taken. The profile is a private file, removed after the
compile.
"""

import os
import stat
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import offload_eqx as ox
from offload_eqx._host import overlap_schedule
from offload_eqx._host.compute import OVERLAP_OPTIONS

LAYERS, WEIGHTS, DIM, BATCH = 4, 4, 256, 256


class Block(eqx.Module):
    """Four weights a layer: four gradients sent to host memory (by the backward loop's
    trips), for the host update to read."""

    weights: list

    def __call__(self, x):
        for w in self.weights:
            x = jnp.tanh(ox.name(x, "x") @ w)
        return x


class Stack(eqx.Module):
    layers: Block
    activations: ox.Activations = ox.activations(x="remat")

    def __call__(self, x):
        return ox.scan(self.layers, x)


ZERO_OFFLOAD = ox.Strategy("zero_offload", "device", "pinned_host", update="host")


def _step_and_args():
    model = eqx.filter_eval_shape(
        lambda: Stack(Block([jnp.zeros((LAYERS, DIM, DIM), jnp.bfloat16)] * WEIGHTS))
    )
    opt = ox.offload_optimizer(
        optax.adamw(1e-3), update_on="host", delay=1, master_dtype=jnp.float32
    )
    state = eqx.filter_eval_shape(opt.init, model)

    @ox.filter_jit(strategy=ZERO_OFFLOAD, donate="all")
    def step(model, state, x):
        grads = eqx.filter_grad(lambda m: jnp.mean(m(x).astype(jnp.float32) ** 2))(model)
        return ox.update_and_apply(opt, grads, state, model)

    return step, (model, state, jax.ShapeDtypeStruct((BATCH, DIM), jnp.bfloat16))


def _entry_order(estimate):
    program = estimate.simulation.program
    entry = program.computations[program.entry]
    order = [i.name for i in entry.instructions if i.opcode != "get-tuple-element"]
    whiles = [i.name for i in entry.instructions if i.opcode == "while"]
    start = next(n for n in order if "call-start" in n)
    done = next(n for n in order if "call-done" in n)
    return order, whiles, start, done


@pytest.mark.deviceless
def test_zero_offload_delayed_update_spans_both_loops_on_the_h100():
    """Compiled once, the host call is placed after the loops (its fixed latency is
    covered by what comes before it); with the profile, it starts before the forward
    loop and is waited for after the backward loop."""
    step, args = _step_and_args()
    estimate = ox.estimate(step, *args, target="h100")
    order, whiles, start, done = _entry_order(estimate)
    assert len(whiles) == 2
    assert order.index(start) < order.index(whiles[0]) < order.index(whiles[1]) < order.index(done)
    # The device waits only for what the host work outlasts the loops by (floor: 0.09 of
    # 0.44 ms of host work beside 0.35 ms of compute; 0.21 ms compiled once).
    simulation = estimate.simulation
    assert simulation is not None
    host, compute = simulation.busy["host"], simulation.busy["compute"]
    waited = simulation.waited.get("host", 0.0)
    assert waited <= max(0.0, host - compute) + 0.1 * host, (simulation.waited, simulation.busy)


class _Compiled:
    """What `overlapped` reads of a compiled program: its text and its memory."""

    def __init__(self, temp: int):
        self.temp = temp

    def as_text(self):
        return (
            "ENTRY %main (a: f32[4]) -> f32[4] {\n"
            '  %host-call.1.call-start = ((f32[4]), f32[4]) async-start(%a), metadata={op_name="ox_host[delayed u]"}\n'
            "}\n"
        )

    def memory_analysis(self):
        return type("Stats", (), {"temp_size_in_bytes": self.temp, "host_temp_size_in_bytes": 7})()


@pytest.mark.parametrize(
    ("capacity", "taken"), [(None, "spanning"), (150, "spanning"), (120, "first"), (90, "first")]
)
def test_a_spanning_program_that_would_not_fit_is_not_taken(capacity, taken):
    """The spanning program holds the new device parameters from the start of the step:
    it is taken within the capacity, and never where it needs more than the first
    and exceeds the capacity."""
    first, spanning = _Compiled(100), _Compiled(140)
    seen = []

    def recompile(options):
        seen.append(options)
        with open(options[overlap_schedule.PROFILE_OPTION]) as file:
            assert '"host-call.1.call-start"' in file.read()
        return spanning

    result = overlap_schedule.overlapped(first, dict(OVERLAP_OPTIONS), recompile, capacity)
    assert result is {"first": first, "spanning": spanning}[taken]
    assert len(seen) == 1 and not os.path.exists(seen[0][overlap_schedule.PROFILE_OPTION])


@pytest.mark.parametrize(
    ("host_capacity", "taken"), [(7, "first"), (8, "spanning"), (None, "spanning")]
)
def test_a_spanning_program_over_the_host_share_is_not_taken(host_capacity, taken):
    """It holds 8 bytes of host memory where the first holds 7."""
    first, spanning = _Compiled(100), _Compiled(100)
    spanning.memory_analysis = lambda: type(  # type: ignore[method-assign]
        "Stats", (), {"temp_size_in_bytes": 100, "host_temp_size_in_bytes": 8}
    )()
    result = overlap_schedule.overlapped(
        first, dict(OVERLAP_OPTIONS), lambda o: spanning, None, host_capacity
    )
    assert result is {"first": first, "spanning": spanning}[taken]


def test_a_delayed_update_in_slices_is_left_as_compiled():
    """Its loop's host calls run a trip at a time; the scalar call it leaves in the entry
    is not spanned (the 70B block stack's host memory grew by 65 GiB when it was)."""
    text = "\n".join(
        [
            "%body (p: s32[]) -> s32[] {",
            '  %host-call.9.call-start = (s32[]) custom-call-start(%p), metadata={op_name="a/ox_host[delayed x]/c"}',
            "}",
            "ENTRY %main (a: s32[]) -> s32[] {",
            '  %host-call.2.call-start = (s32[]) custom-call-start(%a), metadata={op_name="jit(f)/ox_host[delayed x]/cond"}',
            "}",
        ]
    )
    assert overlap_schedule.delayed_starts(text) == []


def test_only_the_delayed_calls_outside_loops_are_named():
    text = "\n".join(
        [
            "HloModule m",
            "%body (p: s32[]) -> s32[] {",
            '  %host-call.9.call-start = (s32[]) async-start(%p), metadata={op_name="a/ox_host[x]/c"}',
            "}",
            "",
            "ENTRY %main (a: f32[4]) -> f32[4] {",
            '  %host-call.cloned.1.call-start.1 = ((f32[4]), f32[4]) async-start(%a), metadata={op_name="jit(f)/ox_host[delayed optimizer update]/compute_on" scheduling_name="host-call.cloned.1.call-start.1"}',
            '  %host-call.2.call-start = ((f32[4]), f32[4]) async-start(%a), metadata={op_name="jit(f)/ox_host[optimizer update]/compute_on"}',
            '  %copy-start.1 = (f32[4], f32[4], u32[]) copy-start(%a), metadata={op_name="ox_host[delayed y]"}',
            "  ROOT %r = f32[4] add(%a, %a)",
            "}",
        ]
    )
    assert overlap_schedule.delayed_starts(text) == ["host-call.cloned.1.call-start.1"]


def test_the_profile_is_private_and_removed_after_the_compile():
    with overlap_schedule.profile_file(["host-call.cloned.1.call-start.1"]) as path:
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        assert stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode) == 0o700
        with open(path) as file:
            assert file.read() == (
                'costs { name: "host-call.cloned.1.call-start.1" cost_us: 1000000000.0 }\n'
            )
    assert not os.path.exists(os.path.dirname(path))


def test_steps_without_a_delayed_host_update_compile_once():
    calls = []

    class Compiled:
        def as_text(self):
            return (
                '%host-call.1.call-start = async-start(%a), metadata={op_name="ox_host[delayed u]"}'
            )

    first = Compiled()
    recompile = lambda options: calls.append(options)  # noqa: E731
    assert overlap_schedule.overlapped(first, None, recompile, None) is first
    assert overlap_schedule.overlapped(first, {"xla_foo": 1}, recompile, None) is first
    assert not calls
    assert overlap_schedule.wants_overlap(dict(OVERLAP_OPTIONS, other=True))


def _cpu_step():
    """A delayed host update on this machine's CPU (where it is inlined: no host call)."""
    model: Any = Stack(Block([jnp.full((LAYERS, 8, 8), 0.1, jnp.float32)] * 2))
    opt = ox.offload_optimizer(optax.adam(1e-2), update_on="host", delay=1)
    state = opt.init(model)
    x = jnp.ones((4, 8))

    def step(model, state, x):
        grads = eqx.filter_grad(lambda m: jnp.mean(m(x) ** 2))(model)
        return ox.update_and_apply(opt, grads, state, model)

    return step, (model, state, x)


def test_on_a_gpu_the_step_is_compiled_again_with_the_profile_at_its_first_call(monkeypatch):
    """The GPU path, on this CPU: the platform check and the call's name are made to say
    GPU; the first call compiles twice (the second with the profile), later calls none,
    and the results are the step's."""
    import offload_eqx._jit.compile as compile_module
    import offload_eqx._jit.gpu_compiles as gpu_compiles

    monkeypatch.setattr(gpu_compiles, "runs_on_gpu", lambda device: True)
    monkeypatch.setattr(compile_module, "compiler_options", lambda *a, **k: dict(OVERLAP_OPTIONS))
    monkeypatch.setattr(overlap_schedule, "delayed_starts", lambda text: ["host-call.1.start"])
    profiles = []
    real = jax.jit

    def recording_jit(*args, **kwargs):
        options = kwargs.get("compiler_options") or {}
        if overlap_schedule.PROFILE_OPTION in options:
            with open(options[overlap_schedule.PROFILE_OPTION]) as file:
                profiles.append(file.read())
        return real(*args, **kwargs)

    monkeypatch.setattr(compile_module.jax, "jit", recording_jit)
    step, args = _cpu_step()
    expected = jax.jit(step)(*args)
    spanning_step = ox.filter_jit(step)
    result = spanning_step(*args)
    entry = spanning_step.compilation(*args)[0]
    assert not isinstance(entry.jitted, gpu_compiles._ChosenAtFirstCall)  # chosen once
    assert entry.jitted._cache_size() == 1  # the ahead compile, reused by the call
    spanning_step(*args)
    assert entry.jitted._cache_size() == 1
    assert profiles == ['costs { name: "host-call.1.start" cost_us: 1000000000.0 }\n']
    for a, b in zip(jax.tree_util.tree_leaves(result), jax.tree_util.tree_leaves(expected)):
        np.testing.assert_array_equal(a, b)


def test_parameters_a_delayed_host_update_writes_are_donated_only_where_it_is_inlined():
    """The new bfloat16 parameters are cast from their masters by the host computation:
    XLA:GPU gives them buffers of their own from the call's start, so the old ones are
    not donated there (donated, XLA copied them for the passes, copied the new ones in
    afterwards, and its scheduler waited for the update before the backward loop); this
    machine inlines the computation and donates them."""
    from offload_eqx._targets.deviceless import program_of_step

    step, args = _step_and_args()
    program = program_of_step(step, args, {})
    parameters = set(range(WEIGHTS))  # the model's leaves come first
    assert parameters <= set(program.donate_argnums)  # on this machine
    assert parameters <= set(program.host_donated)  # not where the call is one of its own
