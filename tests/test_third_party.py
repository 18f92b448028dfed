"""Third-party model code (`tests/third_party_families.py`) in the shapes that do not fit
a `Case`: a GAN's two alternating steps, a sampler's `eqx.internal.while_loop`, a
decoder's `generate` method, NumPy float64 batches. Each is run under every strategy with
`ox.filter_jit` (the guard on, `audit=True`, `ox.audit` finding nothing implicit where
the inputs are `jax.Array`s) and compared with the same code under plain
`eqx.filter_jit` + optax. The models carry no offload_eqx code of their own: one
`ox.annotate(..., memory="pinned_host")` from outside each.

The Case-shaped families are trained by `tests/test_real_models.py`
(`test_same_as_plain_equinox`, through `THIRD_PARTY` in its `ALL_CASES`).
"""

import contextlib
import functools
import inspect
import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import third_party_families
from helpers import rotated
from jaxtyping import Array, Float, Int
from test_real_models import (
    BATCH_KEY,
    MODEL_KEY,
    PARAMETER_RTOL,
    STEP_KEY,
    STEPS,
    _adam,
    assert_same,
    assert_same_trajectory,
    memories,
    offload_step,
    reference_run,
    snapshot,
)
from third_party_families import (
    NUMPY_BATCHES,
    THIRD_PARTY,
    LlamaDecoder,
    WhileKind,
    gan,
    gan_batch,
    kv_cache_decoder,
    prompt_batch,
    sample_batch,
    sampler_batch,
    score_model,
    step_discriminator,
    step_generator,
)

import offload_eqx as ox

STRATEGIES = list(ox.STRATEGIES)
# None of these models names an activation: `offload_activations` has nothing to offload,
# and the README's rule is an error saying what to write (see test_same_as_plain_equinox).
NOTHING_NAMED = r"'offload_activations'.*no module declares any activation names"


def _host_params(strategy: str) -> bool:
    """Whether the strategy keeps some parameter in pinned_host: every model here
    annotates some of its modules into pinned_host."""
    return ox.STRATEGIES[strategy].params != "device"


def assert_fetched_outside_loops(report: ox.TransferReport, at_most: int) -> None:
    """Every parameter fetch happens once per call (count 1), outside any `scan` or
    `while` body, and each leaf is fetched at most `at_most` times: a loop body's
    host-resident leaves are fetched once, before the loop, not once per iteration."""
    fetches = report.select("host-to-device", kind="parameter")
    assert fetches, f"no parameter is fetched:\n{report}"
    in_loops = [t for t in fetches if t.count != 1 or "scan" in t.where or "while" in t.where]
    assert not in_loops, f"parameters fetched inside a loop body:\n{report}"
    per_leaf: dict[str, int] = {}
    for t in fetches:
        per_leaf[t.what] = per_leaf.get(t.what, 0) + t.count
    assert max(per_leaf.values()) <= at_most, f"{per_leaf}\n{report}"


# -- 4. A GAN: two step functions, each with its own optimizer, alternating. --------------


def _gan_run(strategy: str | None) -> list[tuple]:
    """Three rounds of (discriminator step, generator step), as Equinox's DCGAN example
    trains; `strategy=None` is plain `eqx.filter_jit` + optax + `eqx.apply_updates`.
    Returns per round the snapshots of (discriminator loss, discriminator, generator
    loss, generator)."""
    generator, discriminator = gan(jax.random.key(MODEL_KEY))
    d_optimizer, g_optimizer = optax.adam(1e-2, eps=1e-3), optax.adam(1e-2, eps=1e-3)
    if strategy is None:
        jit, apply_updates = eqx.filter_jit, eqx.apply_updates
    else:
        jit, apply_updates = ox.filter_jit(strategy=strategy, audit=True), ox.apply_updates
        d_optimizer = ox.offload_optimizer(d_optimizer)
        g_optimizer = ox.offload_optimizer(g_optimizer)
        generator = ox.place(generator, strategy)
        discriminator = ox.place(discriminator, strategy)
    d_opt_state = d_optimizer.init(eqx.filter(discriminator, eqx.is_array))
    g_opt_state = g_optimizer.init(eqx.filter(generator, eqx.is_array))
    if strategy is not None:
        d_opt_state, g_opt_state = ox.place((d_opt_state, g_opt_state), strategy)
    d_step = jit(functools.partial(step_discriminator, apply_updates=apply_updates))
    g_step = jit(functools.partial(step_generator, apply_updates=apply_updates))
    batches = [gan_batch(jax.random.fold_in(jax.random.key(BATCH_KEY), i)) for i in range(STEPS)]
    key = jax.random.key(STEP_KEY)

    if strategy is not None:
        d_report = ox.audit(d_step, discriminator, generator, batches[0], d_optimizer,
                            d_opt_state, key)  # fmt: skip
        g_report = ox.audit(g_step, generator, discriminator, g_optimizer, g_opt_state, key)
        d_report.assert_no_implicit()
        g_report.assert_no_implicit()
        if _host_params(strategy):
            assert d_report.total("host-to-device", kind="parameter") > 0, d_report
            assert g_report.total("host-to-device", kind="parameter") > 0, g_report

    rounds = []
    with ox.no_implicit_transfers() if strategy is not None else contextlib.nullcontext():
        for batch in batches:
            d_loss, discriminator, d_opt_state, key = d_step(
                discriminator, generator, batch, d_optimizer, d_opt_state, key
            )
            g_loss, generator, g_opt_state, key = g_step(
                generator, discriminator, g_optimizer, g_opt_state, key
            )
            rounds.append(tuple(map(snapshot, (d_loss, discriminator, g_loss, generator))))
    if strategy is not None:
        host = _host_params(strategy)
        assert ("pinned_host" in memories(generator)) == host, memories(generator)
        assert ("pinned_host" in memories(discriminator)) == host, memories(discriminator)
        optimizer_host = ox.STRATEGIES[strategy].optimizer != "device"
        assert ("pinned_host" in memories(d_opt_state)) == optimizer_host
        assert ("pinned_host" in memories(g_opt_state)) == optimizer_host
    return rounds


_GAN_STRATEGIES = ("annotated", "hybrid", "offload_activations")


# Under "annotated", "hybrid" and "offload_activations" (the error for nothing named);
# every strategy with `--full`.
@pytest.mark.parametrize(
    "strategy",
    [
        pytest.param(s, marks=() if s in _GAN_STRATEGIES else (pytest.mark.full,))
        for s in STRATEGIES
    ],
)
def test_gan(strategy: str):
    """Two `ox.filter_jit` steps over the same two models, each differentiating one
    model through the other (whose host-resident layer its region fetches, with no
    gradient of its own), each with its own offloaded Adam, alternating: every loss and
    both models after every round equal the plain Equinox run's."""
    if strategy == "offload_activations":
        with pytest.raises(ValueError, match=NOTHING_NAMED):
            _gan_run(strategy)
        return
    ours, reference = _gan_run(strategy), _gan_run(None)
    for i, ((d_loss, d, g_loss, g), (ref_d_loss, ref_d, ref_g_loss, ref_g)) in enumerate(
        zip(ours, reference)
    ):
        assert_same(d_loss, ref_d_loss, f"discriminator loss of round {i}")
        assert_same(g_loss, ref_g_loss, f"generator loss of round {i}")
        assert_same(d, ref_d, f"discriminator after round {i}", rtol=PARAMETER_RTOL)
        assert_same(g, ref_g, f"generator after round {i}", rtol=PARAMETER_RTOL)


# -- 5. A sampler inside eqx.internal.while_loop. -----------------------------------------

KINDS: list[WhileKind] = ["lax", "bounded", "checkpointed"]


# Each kind of loop under "annotated", "hybrid" and one other strategy in turn (all with
# `--full`).
@pytest.mark.parametrize("kind, strategy", rotated(KINDS, STRATEGIES, ("annotated", "hybrid")))
def test_sampler_output(kind: WhileKind, strategy: str):
    """Sampling: Euler steps of the host-resident score model inside
    `eqx.internal.while_loop(kind=...)`, vmapped over a batch of noise, equal plain
    `eqx.filter_jit`'s samples; the score model's weights are fetched once per call,
    before the loop, never per iteration (a forward pass: one fetch per leaf)."""
    y1, _ = sampler_batch(jax.random.key(BATCH_KEY))
    sample_fn = functools.partial(sample_batch, kind=kind)
    expected = eqx.filter_jit(sample_fn)(score_model(jax.random.key(MODEL_KEY)), y1)
    model = ox.place(score_model(jax.random.key(MODEL_KEY)), strategy)
    sample = ox.filter_jit(sample_fn, strategy=strategy, audit=True)
    if strategy == "offload_activations":
        with pytest.raises(ValueError, match=NOTHING_NAMED):
            sample(model, y1)
        return
    report = ox.audit(sample, model, y1)
    print(report)
    report.assert_no_implicit()
    with ox.no_implicit_transfers():
        samples = sample(model, y1)
    assert_same(samples, expected, "samples")
    if _host_params(strategy):
        assert_fetched_outside_loops(report, at_most=1)
        fetched = {t.what for t in report.select("host-to-device", kind="parameter")}
        assert fetched == {
            f"model.mlp.layers[{i}].{w}" for i in range(3) for w in ("weight", "bias")
        }


def test_fresh_wrapper_new_static_value():
    """A fresh `ox.filter_jit(fn, audit=True)` per configuration, each called with its own
    static argument (the sampler's `kind`, a string), as `eqx.filter_jit(fn)` is called:
    each wrapper's first call compiles once and is not refused as a recompilation of
    another wrapper's program."""
    model = ox.place(score_model(jax.random.key(MODEL_KEY)))
    y1, _ = sampler_batch(jax.random.key(BATCH_KEY))
    for kind in KINDS:
        expected = eqx.filter_jit(sample_batch)(score_model(jax.random.key(MODEL_KEY)), y1, kind)
        samples = ox.filter_jit(sample_batch, audit=True)(model, y1, kind)
        assert_same(samples, expected, f"samples ({kind})")


@pytest.mark.parametrize("kind", ["bounded", "checkpointed"])
def test_sampler_training_fetches(kind: WhileKind):
    """A training step through the sampler loop (the trajectory is
    `test_same_as_plain_equinox[while_sampler_*]`'s): the audit counts each weight's
    fetch once in the forward pass and at most once more to recompute it in the
    backward pass, both outside the loop, not once per Euler step."""
    case = THIRD_PARTY[f"while_sampler_{kind}"]
    model, _ = case.make(jax.random.key(MODEL_KEY))
    model = ox.place(model)
    opt = ox.offload_optimizer(_adam())
    opt_state = ox.place(opt.init(eqx.filter(model, eqx.is_inexact_array)))
    step = offload_step(case, opt, "annotated", donate="all", audit=True)
    report = ox.audit(step, model, opt_state, None, case.batch(jax.random.key(BATCH_KEY)), None)
    print(report)
    report.assert_no_implicit()
    assert_fetched_outside_loops(report, at_most=2)
    forward = report.select("host-to-device", kind="parameter", phase="forward")
    assert len(forward) == 6, report  # three Linear layers, weight and bias


# -- 6. A LLaMA-style decoder's `generate` method with a KV cache. ------------------------

GENERATE_KEY = 1  # a model and prompt whose greedy tokens are not all the same


def _generate_inputs() -> tuple[LlamaDecoder, Int[Array, " 5"]]:
    return kv_cache_decoder(jax.random.key(GENERATE_KEY)), prompt_batch(jax.random.key(1))


def _generate_four(model: LlamaDecoder, prompt: Int[Array, " prompt"]) -> Int[Array, " 4"]:
    return model.generate(prompt, 4)


# Each way of calling it under the model's own declarations and one other strategy in
# turn (all of them with `--full`).
@pytest.mark.parametrize(
    "how, strategy", rotated(["bound_method", "function"], STRATEGIES, ("annotated",))
)
def test_generate(how: str, strategy: str):
    """`ox.filter_jit(model.generate)(prompt)` and
    `ox.filter_jit(lambda m, p: m.generate(p, 4))(model, prompt)`: greedy decoding with a
    KV cache carried by a `jax.lax.scan`, the blocks host-resident. The tokens equal
    plain `eqx.filter_jit`'s; every block weight is fetched outside the decoding loop
    (once for the prompt's pass, at most once more for the loop)."""
    reference_model, prompt = _generate_inputs()
    model = ox.place(reference_model, strategy)
    if how == "bound_method":
        expected = eqx.filter_jit(reference_model.generate)(prompt)
        generate = ox.filter_jit(model.generate, strategy=strategy, audit=True)
        args: tuple = (prompt,)
    else:
        expected = eqx.filter_jit(lambda m, p: m.generate(p, 4))(reference_model, prompt)
        generate = ox.filter_jit(lambda m, p: m.generate(p, 4), strategy=strategy, audit=True)
        args = (model, prompt)
    if strategy == "offload_activations":
        with pytest.raises(ValueError, match=NOTHING_NAMED):
            generate(*args)
        return
    report = ox.audit(generate, *args)
    print(report)
    report.assert_no_implicit()
    with ox.no_implicit_transfers():
        tokens = generate(*args)
    assert_same(tokens, expected, "generated tokens")
    if _host_params(strategy):
        assert_fetched_outside_loops(report, at_most=2)


def test_generate_is_greedy_decoding():
    """Guards the suite itself: with the cache, `generate` gives the tokens that greedy
    decoding with full forward passes gives, and they are not all one token, so the
    comparisons above compare a working decoder."""
    model, prompt = _generate_inputs()
    tokens = prompt
    for _ in range(4):
        tokens = jnp.concatenate([tokens, jnp.argmax(model(tokens)[-1])[None]])
    generated = np.asarray(_generate_four(model, prompt))
    np.testing.assert_array_equal(generated, np.asarray(tokens[prompt.shape[0] :]))
    assert len(set(generated.tolist())) > 1, generated


# -- 8. NumPy float64 batches. ------------------------------------------------------------


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_numpy_batches(strategy: str):
    """What a data loader yields (`np.random.randn`: float64 NumPy arrays) passed
    straight to the step, as to `eqx.filter_jit`, which converts them to float32 device
    arrays on every call: the same trajectory, with everything else donated. No guard
    and no `audit=True` here: those refuse NumPy arguments (the next test)."""
    case = NUMPY_BATCHES
    model, _ = case.make(jax.random.key(MODEL_KEY))
    model = ox.place(model, strategy)
    opt = ox.offload_optimizer(_adam())
    opt_state = ox.place(opt.init(eqx.filter(model, eqx.is_inexact_array)), strategy)
    step = offload_step(case, opt, strategy, donate="all")
    batch = case.batch(jax.random.key(BATCH_KEY))
    assert batch[0].dtype == np.float64 and isinstance(batch[0], np.ndarray)
    if strategy == "offload_activations":
        with pytest.raises(ValueError, match=NOTHING_NAMED):
            step(model, opt_state, None, batch, None)
        return
    trajectory = []
    for _ in range(STEPS):
        model, opt_state, state, loss, grads = step(
            model, opt_state, None, case.batch(jax.random.key(BATCH_KEY)), None
        )
        trajectory.append(tuple(map(snapshot, (model, state, loss, grads))))
    assert_same_trajectory(trajectory, reference_run(case, _adam()))
    assert ("pinned_host" in memories(model)) == _host_params(strategy)


def test_numpy_batches_audit():
    """With `audit=True` a NumPy batch is the documented implicit transfer: an error
    naming the batch's leaf, raised before anything is donated."""
    case = NUMPY_BATCHES
    model, _ = case.make(jax.random.key(MODEL_KEY))
    model = ox.place(model)
    opt = ox.offload_optimizer(_adam())
    opt_state = ox.place(opt.init(eqx.filter(model, eqx.is_inexact_array)))
    step = offload_step(case, opt, "annotated", donate="all", audit=True)
    with pytest.raises(ox.ImplicitTransferError, match=r"batch\[0\].*numpy"):
        step(model, opt_state, None, case.batch(jax.random.key(BATCH_KEY)), None)
    assert not any(
        leaf.is_deleted() for leaf in jax.tree_util.tree_leaves(eqx.filter(model, eqx.is_array))
    )


# -- The models are what the tests say they are. -----------------------------------------


def test_third_party_code_has_no_offload_eqx_inside():
    """Guards the suite itself: the third-party classes' code calls nothing of
    offload_eqx (the annotations are applied from outside, after building), and nothing
    in the module names an activation or writes a region."""
    classes = [
        value
        for value in vars(third_party_families).values()
        if isinstance(value, type) and value.__module__ == "third_party_families"
    ]
    assert len(classes) >= 10
    for cls in classes:
        assert not re.search(r"\box\.", inspect.getsource(cls)), cls.__name__
    source = inspect.getsource(third_party_families)
    assert not re.search(r"ox\.(name|checkpoint|field|activations|scan)\(", source)


def test_sample_is_the_loop():
    """Guards the suite itself: the while loop runs all its Euler steps (the sample is
    not the noise, and it is what an unrolled Python loop gives)."""
    model = score_model(jax.random.key(MODEL_KEY))
    y1, _ = sampler_batch(jax.random.key(BATCH_KEY))
    y = y1
    for i in range(4):
        t = 1.0 - i * 0.25
        y = y + 0.25 * 0.5 * (y + jax.vmap(lambda y: model(jnp.asarray(t), y))(y))
    samples: Float[Array, "4 2"] = sample_batch(model, y1, "lax")
    np.testing.assert_allclose(np.asarray(samples), np.asarray(y), rtol=1e-5, atol=1e-6)
    assert not np.allclose(np.asarray(samples), np.asarray(y1))
