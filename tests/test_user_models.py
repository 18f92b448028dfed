"""Models written as the authors of published Equinox libraries write them
(`tests/user_models.py`: a mixture-of-experts decoder, a DINO-style ViT with its own LoRA,
BatchNorm and a state-space scan, GRU/LSTM cells with dropout keys, a normalising flow
of nested scans, `eqx.internal.while_loop` with `eqx.error_if`), each run the way a user
runs it:

- trained under `ox.filter_jit(step, strategy=s)` with `ox.offload_optimizer(adamw)`,
    audited and under the transfer guard, against plain `eqx.filter_jit` + optax;
- its training step compiled for an H100 without the hardware (`ox.memory_report`,
    `ox.estimate`) and planned (`ox.fit`);
- `generate` and `eqx.error_if` under each strategy.

On jaxlib 0.10.2 the LoRA ViT's gradient does not compile for XLA:GPU (Triton finds no
tile for its rank-2 dot, plain Equinox too): a `CompilerFaultError` says so and gives
the fixes (`docs/limits.md`).
"""

import dataclasses
import importlib.metadata

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from test_real_models import (
    BATCH_KEY,
    MODEL_KEY,
    STEP_KEY,
    assert_same_trajectory,
    offload_run,
    offload_step,
    reference_run,
)
from user_models import (
    USER_MODELS,
    DinoViT,
    MoELM,
    fixed_point,
    images_batch,
    vit_lora_loss,
)

import offload_eqx as ox

STRATEGIES = ("baseline", "remat", "offload_params", "offload_optimizer", "hybrid")
JAXLIB = importlib.metadata.version("jaxlib")
# jaxlib 0.10.2's XLA:GPU cannot tile the LoRA adapters' rank-2 dot; 0.12.0.1 can.
NO_TILE_FAULT = JAXLIB == "0.10.2"


def _adamw():
    """AdamW with `eps=1e-3`, for the reason `test_real_models._adam` gives."""
    return optax.adamw(1e-2, eps=1e-3)


# Seconds on the project's 2-core machine, reference and offloaded run: 3 to 10 each.
# The default run trains each model under hybrid (everything moved); `--full` the rest.
TRAINED = [
    pytest.param(name, strategy, marks=() if strategy == "hybrid" else pytest.mark.full)
    for name in USER_MODELS
    for strategy in STRATEGIES
]


@pytest.mark.parametrize("name, strategy", TRAINED)
def test_training_equals_plain_equinox(name: str, strategy: str):
    case = USER_MODELS[name]
    reference = reference_run(case, _adamw())
    trajectory, report, _ = offload_run(case, ox.offload_optimizer(_adamw()), strategy)
    assert_same_trajectory(trajectory, reference, case.rtol)
    if ox.STRATEGIES[strategy].params != "device":
        assert report.total("host-to-device", kind="parameter") > 0, report


def _step_and_arguments(name: str, strategy: str):
    case = USER_MODELS[name]
    opt = ox.offload_optimizer(_adamw())
    model, state = case.make(jax.random.key(MODEL_KEY))
    model = ox.place(model, strategy)
    opt_state = ox.place(opt.init(eqx.filter(model, case.filter_spec(model))), strategy)
    key = jax.random.key(STEP_KEY) if case.dropout else None
    arguments = (model, opt_state, state, case.batch(jax.random.key(BATCH_KEY)), key)
    return offload_step(case, opt, strategy, donate="all"), arguments


# The small ones by default (2 to 9 s); the MoE (14 to 33 s), the ViT and the flow with `--full`.
_DEFAULT_DEVICELESS = {"ssm_batch_norm", "recurrent", "while_generate"}
DEVICELESS = [
    pytest.param(n, marks=() if n in _DEFAULT_DEVICELESS else pytest.mark.full) for n in USER_MODELS
]


@pytest.mark.deviceless
@pytest.mark.parametrize("name", DEVICELESS)
def test_memory_report_and_estimate_for_the_h100(name: str):
    """The offload_params training step compiles for an H100: the annotated modules are
    host arguments and the estimate prices the step."""
    step, arguments = _step_and_arguments(name, "offload_params")
    if name == "vit_lora" and NO_TILE_FAULT:
        with pytest.raises(ox.CompilerFaultError, match=r"Triton.*xla_gpu_enable_triton_gemm"):
            ox.memory_report(step, *arguments, target="h100")
        return
    report = ox.memory_report(step, *arguments, target="h100")
    assert report.host["argument"] > 0, report
    assert ox.estimate(step, *arguments, target="h100").seconds > 0


@pytest.mark.deviceless
@pytest.mark.full  # 18 to 85 s a model: the fit's compiles, in a child process
@pytest.mark.parametrize("name", list(USER_MODELS))
def test_fit_for_the_h100(name: str):
    step, arguments = _step_and_arguments(name, "annotated")
    if name == "vit_lora" and NO_TILE_FAULT:  # every plan meets the fault: ox.fit says so
        with pytest.raises(ox.CompilerFaultError, match="no plan can be measured"):
            ox.fit(step, *arguments, target="h100", max_compiles=4)
        return
    result = ox.fit(step, *arguments, target="h100", max_compiles=4)
    assert result.estimate.seconds > 0 and result.compiles <= 4, result


@pytest.mark.deviceless
def test_lora_gradient_triton_cannot_tile_is_named_with_its_fixes():
    """Plain Equinox's gradient of the LoRA ViT, compiled for an H100: jaxlib 0.10.2's
    XLA:GPU stops with "Couldn't find output tile sizes" on the adapters' rank-2 dot
    (`f32[14,2]`); our error names the dot, the release and both fixes. 0.12.0.1
    compiles it."""
    model = DinoViT(key=jax.random.key(MODEL_KEY))
    batch = images_batch(jax.random.key(BATCH_KEY))

    @eqx.filter_jit
    def gradient(model, batch):
        return eqx.filter_grad(lambda m: vit_lora_loss(m, None, batch, None)[0])(model)

    if not NO_TILE_FAULT:
        assert ox.memory_report(gradient, model, batch, target="h100").device["output"] > 0
        return
    with pytest.raises(ox.CompilerFaultError) as error:
        ox.memory_report(gradient, model, batch, target="h100")
    message = str(error.value)
    for part in ("jaxlib 0.10.2", "f32[14,2]", "jax>=0.12.0.1", "xla_gpu_enable_triton_gemm"):
        assert part in message, message


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_generate_and_error_if(strategy: str):
    """`model.generate` (a scan of `eqx.internal.while_loop`s over the host-resident
    cell) gives plain Equinox's tokens; `eqx.error_if` on a bad token raises its
    message."""
    token = jnp.array(3)
    expected = eqx.filter_jit(lambda m, t: m.generate(t, 5))(fixed_point(jax.random.key(0)), token)
    model = ox.place(fixed_point(jax.random.key(0)), strategy)
    generate = ox.filter_jit(lambda m, t: m.generate(t, 5), strategy=strategy, audit=True)
    ox.audit(generate, model, token).assert_no_implicit()
    np.testing.assert_array_equal(np.asarray(generate(model, token)), np.asarray(expected))
    with pytest.raises(Exception, match="token out of range"):
        ox.filter_jit(lambda m, t: m(t), strategy=strategy)(model, jnp.array(99))


def _switch_lm(where):
    """The decoder with top-1 routing (each token's expert gathered from the stack by
    index), `where` in pinned_host."""
    return lambda key: ox.annotate(MoELM(top_k=1, key=key), where, memory="pinned_host")


def test_switch_experts_annotated_alone_are_a_host_use_error_naming_them():
    """The stacked experts annotated by themselves: the router gathers a token's expert
    from the stack (`w[expert]`) outside any region, which JAX cannot do on host memory
    ("memory_space of all inputs passed to `gather` must be the same"). A
    `HostUseError` names the experts' leaves and the fixes (`docs/errors.md`)."""
    experts = _switch_lm(lambda m: [b.moe.experts for b in m.blocks])
    case = dataclasses.replace(USER_MODELS["moe_lm"], build=experts)
    with pytest.raises(
        ox.HostUseError, match=r"`model\.blocks\[0\]\.moe\.experts\.up\.weight`.*ox\.fetch"
    ):
        offload_run(case, ox.offload_optimizer(_adamw()), "offload_params")


def test_switch_experts_in_annotated_blocks_train_as_plain_equinox():
    """The fix: annotate the blocks, whose regions fetch the experts' stack once; the
    gather reads the device copy."""
    case = dataclasses.replace(USER_MODELS["moe_lm"], build=_switch_lm(lambda m: m.blocks))
    trajectory, _, _ = offload_run(case, ox.offload_optimizer(_adamw()), "offload_params")
    assert_same_trajectory(trajectory, reference_run(case, _adamw()), case.rtol)
