"""`ox.fit` on steps and candidates that broke it: a typed PRNG key among the arguments,
a complex value a candidate's regions would save, and a candidate whose compile aborts
the compiler (issue 66, items 8 and 9)."""

import importlib

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
import pytest

import offload_eqx as ox


class _Noisy(eqx.Module):
    """One weight, and a name in a region that draws noise from a typed key."""

    w: jax.Array = ox.field(memory="device")
    activations: ox.Activations = ox.activations(h="save")

    def __call__(self, x, key):
        def body(x):
            noise = jax.random.normal(key, x.shape)
            return ox.name(jnp.tanh((x + noise) @ self.w), "h")

        return ox.checkpoint(body, x)


def test_a_typed_key_among_the_arguments_is_counted_as_its_key_data():
    """`ox.fit` sized each argument with NumPy's dtype, which a typed key (`key<fry>`)
    is not: "TypeError: Cannot interpret 'key<fry>' as a data type", where
    `ox.memory_report` and `ox.estimate` took the same arguments."""

    @ox.filter_jit
    def step(model, x, key):
        return eqx.filter_grad(lambda m: jnp.sum(m(x, key)))(model)

    model, x, key = _Noisy(jnp.ones((64, 64))), jnp.ones((8, 64)), jax.random.key(0)
    result = ox.fit(step, model, x, key, target="cpu", device_budget=2**30)
    chosen = ox.filter_jit(step.fn, strategy=result.strategy)
    report = ox.memory_report(chosen, model, x, key, target="cpu")
    assert result.estimate.device_bytes == report.total
    # The key's 8 bytes (two uint32 words) are among the arguments, as XLA counts them.
    assert report.device["argument"] == (64 * 64 + 8 * 64) * 4 + 8


class _Complex(eqx.Module):
    """A complex intermediate: JAX's checkpoint cannot save it (`reduce_precision`)."""

    w: jax.Array = ox.field(memory="device")

    def __call__(self, x):
        def body(x):
            return jnp.abs((x @ self.w) * jnp.exp(1j * x)) ** 2

        return ox.checkpoint(body, x)


def _complex_step(strategy=None):
    def step(model, x):
        return eqx.filter_grad(lambda m: jnp.sum(m(x)))(model)

    return ox.filter_jit(step, strategy=strategy)


def test_a_complex_value_saved_in_a_region_is_refused_with_the_fix():
    model, x = _Complex(jnp.ones((64, 64))), jnp.ones((8, 64))
    with pytest.raises(ox.ContractError, match="cannot save a complex value") as error:
        _complex_step("offload_params")(model, x)
    message = str(error.value)
    assert isinstance(error.value, TypeError)  # what JAX raised
    assert "'offload_params'" in message and "reduce_precision" in message
    assert "test_fit_faults.py:" in message  # the user's line
    assert "activations='remat'" in message and "params='device'" in message
    # The fixes it names compile.
    remat = ox.Strategy("custom", params="pinned_host", optimizer="device", activations="remat")
    _complex_step(remat)(model, x)
    _complex_step("baseline")(model, x)


def test_fit_skips_a_candidate_that_would_save_a_complex_value_saying_why():
    model, x = _Complex(jnp.ones((64, 64))), jnp.ones((8, 64))
    result = ox.fit(_complex_step(), model, x, target="cpu", device_budget=2**30)
    refused = [c for c in result.candidates if "complex value" in c.status]
    assert refused and all(c.device_bytes is None for c in refused)
    assert all(c.strategy.params == "pinned_host" for c in refused)
    assert result.strategy.params == "device" or result.strategy.activations == "remat"
    assert "cannot save a complex value" in result.table()


class _Two(eqx.Module):
    """Two named activations in one region (shapes no other test compiles: every plan
    is new to this process, so each goes to the child)."""

    ws: jax.Array = ox.field(memory="device")
    activations: ox.Activations = ox.activations(a0="save", a1="save")

    def __call__(self, x):
        def body(x):
            for i in range(2):
                x = ox.name(jnp.tanh(x @ self.ws[i]), f"a{i}")
            return x

        return ox.checkpoint(body, x)


@pytest.mark.deviceless
def test_a_candidate_whose_compile_aborts_xla_is_reported_and_the_others_searched(
    tmp_path, monkeypatch
):
    """An XLA `CHECK` failure in one candidate's deviceless compile aborted the process
    running `ox.fit`. Candidates are compiled in a child process; the test hook makes
    the child abort (`os.abort()`, as a `CHECK` does) on the next compile, which is the
    first candidate's (the count's best plan)."""
    from offload_eqx._targets import isolated

    flag = tmp_path / "abort-next-compile"
    flag.touch()
    monkeypatch.setenv("OFFLOAD_EQX_TEST_ABORT_COMPILE", str(flag))
    isolated.close_child()  # the next child reads the environment
    model = _Two(jax.ShapeDtypeStruct((2, 192, 192), jnp.float32))  # pyright: ignore[reportArgumentType]
    x = jax.ShapeDtypeStruct((48, 192), jnp.float32)

    @ox.filter_jit
    def step(model, x):
        return eqx.filter_grad(lambda m: jnp.sum(m(x)))(model)

    result = ox.fit(step, model, x, target="h100", max_compiles=6)
    assert not flag.exists()  # the hook fired
    (aborted,) = [c for c in result.candidates if c.status.startswith("XLA aborted")]
    assert aborted.status.startswith("XLA aborted compiling this plan: F0000 ")
    assert "Check failed: OFFLOAD_EQX_TEST_ABORT_COMPILE" in aborted.status
    assert "(the compiling process ended with signal 6)" in aborted.status
    assert aborted.device_bytes is None and aborted.strategy != result.strategy
    # The others were compiled (by a new child) and the best of them returned.
    simulated = [c.simulated_seconds for c in result.candidates if c.simulated_seconds]
    assert len(simulated) >= 2
    (best,) = [c for c in result.candidates if c.status == "best"]
    assert best.simulated_seconds is not None
    assert best.simulated_seconds <= min(simulated) * 1.005
    assert aborted.seconds <= best.seconds  # the abort cost the count's best plan
    assert "XLA aborted" in result.table()


def test_an_abort_is_said_by_xlas_fatal_line():
    from offload_eqx._targets.isolated import _last_words

    log = (
        "W1207 21:03:10.000001 7 gpu_compiler.cc:12] slow\n"
        "F1207 21:03:11.123456 7 host_offloader.cc:812] Check failed: shape.has_layout()\n"
        "*** Check failure stack trace: ***\n    @ 0x7f 0xdead\n"
    )
    said = _last_words(log, -6)
    assert said.startswith("F1207 21:03:11.123456 7 host_offloader.cc:812] Check failed")
    assert "stack trace" not in said and said.endswith("ended with signal 6)")
    assert _last_words("one\ntwo\nthree\nfour\n", 1) == (
        "two | three | four (the compiling process ended with exit status 1)"
    )


class _Layer(eqx.Module):
    w: jax.Array = ox.field(memory="pinned_host")

    def __call__(self, x):
        return jnp.tanh(x @ self.w)


class _Layers(eqx.Module):
    layers: _Layer

    def __call__(self, x):
        return ox.scan(self.layers, x)


def _host_update_program():
    """A step whose AdamW update (float32 masters) runs on the GPU's host as our fused
    kernel, compiled for the H100 in a child: its program and the target."""
    from offload_eqx._host.kernels import gpu_host
    from offload_eqx._targets.deviceless import program_of_step

    if gpu_host.target("adamw") is None:
        pytest.skip(f"the fused kernel is not usable here: {gpu_host.host_kernels()}")
    opt = ox.offload_optimizer(optax.adamw(1e-4), update_on="host", master_dtype=jnp.float32)

    def train_step(model, opt_state, x):
        grads = eqx.filter_grad(lambda m: jnp.mean(m(x).astype(jnp.float32) ** 2))(model)
        return ox.update_and_apply(opt, grads, opt_state, model)

    model = _Layers(_Layer(jax.ShapeDtypeStruct((2, 160, 160), jnp.bfloat16)))  # pyright: ignore[reportArgumentType]
    wide = jax.tree_util.tree_map(lambda s: jax.ShapeDtypeStruct(s.shape, jnp.float32), model)
    state = eqx.filter_eval_shape(opt.init, wide)
    x = jax.ShapeDtypeStruct((16, 160), jnp.bfloat16)
    strategy = ox.Strategy("s", "pinned_host", "pinned_host", "remat", update="host")
    step = ox.filter_jit(train_step, strategy=strategy, donate="all")
    return program_of_step(step, (model, state, x), {})


@pytest.mark.deviceless
def test_a_real_xla_abort_in_the_child_is_the_plans_answer(monkeypatch):
    """XLA:GPU's host compiler aborts (a `CHECK`: "No FFI handler registered") on a
    kernel not registered in the process that compiles. The child registers the kernels
    a program calls, as the parent did; made to forget, it aborts, and the parent gets
    `CompileAborted` with XLA's fatal line, and lives."""
    from offload_eqx._targets import compile_memo, isolated
    from offload_eqx._targets.deviceless import compile_for
    from offload_eqx._targets.targets import get_target

    target = get_target("h100")
    program = _host_update_program()
    compile_memo._compiled.clear()
    with isolated.isolating(target):
        compiled = compile_for(program, target, [])  # registered in the child: compiles
    assert isinstance(compiled, isolated.Compiled)
    assert "offload_eqx_adamw" in compiled.as_text()
    compile_memo._compiled.clear()
    monkeypatch.setattr(isolated, "_kernels_called", lambda module, target: [])
    isolated.close_child()  # a child that has not registered it
    with isolated.isolating(target), pytest.raises(isolated.CompileAborted) as error:
        compile_for(program, target, [])
    message = str(error.value)
    assert message.startswith("XLA aborted compiling this plan: F")
    assert "No FFI handler registered for offload_eqx_adamw" in message
    assert message.endswith("(the compiling process ended with signal 6)")


def test_a_request_interrupted_ends_the_child_so_no_answer_reaches_the_next(monkeypatch):
    """Ctrl-C while the child compiles left its answer in the pipe, where the next
    request would have read it as its own."""
    from offload_eqx._targets import isolated

    child = isolated._worker()

    def interrupted(stream):
        raise KeyboardInterrupt

    monkeypatch.setattr(isolated.pickle, "load", interrupted)
    with pytest.raises(KeyboardInterrupt):
        child.ask({})
    monkeypatch.undo()
    child.process.wait(timeout=60)
    assert isolated._worker() is not child
    isolated.close_child()


def test_fit_raises_the_compiler_fault_every_compiled_plan_met(monkeypatch):
    """Where each compiled plan fails through a known compiler fault (jaxlib 0.10.2's
    Triton tiling of a LoRA adapter's gradient, every plan alike), ox.fit said that the
    compiles ran out and to raise `max_compiles`, which cannot help: it raises the
    fault, with its fixes."""
    search = importlib.import_module("offload_eqx._fit.search")

    def faulty(program, target, label):
        raise ox.CompilerFaultError("XLA:GPU of jaxlib 0.10.2 cannot tile this dot; fix: upgrade")

    monkeypatch.setattr(search, "compiled_report", faulty)
    model, x = _Complex(jnp.ones((64, 64))), jnp.ones((8, 64))
    with pytest.raises(ox.CompilerFaultError, match="no plan can be measured") as error:
        ox.fit(_complex_step(), model, x, target="cpu", device_budget=2**30, max_compiles=2)
    assert "cannot tile this dot; fix: upgrade" in str(error.value)
