"""Real clients: models written the way Equinox users write them (`tests/real_models.py`,
`tests/real_model_families.py`), trained under every strategy, and compared with the same
code under plain `eqx.filter_jit` + optax (loss, gradients, a 3-step trajectory), with the
transfer guard on, `audit=True` and `ox.audit` finding nothing wrong.

Also: the optax wrappers users reach for, through `ox.offload_optimizer`, and what a
trace-time error leaves behind when everything is donated (nothing is lost).
"""

import dataclasses
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from beartype import beartype
from helpers import rotated
from jaxtyping import PRNGKeyArray, Shaped, jaxtyped
from real_model_families import (
    FAMILIES,
    FAMILY_NAMES,
    FAMILY_OPTIMIZERS,
    bound_method,
    classifier_batch,
)
from real_models import CASES, Case, mlp, mlp_batch, mlp_loss, optax_wrappers
from third_party_families import THIRD_PARTY

import offload_eqx as ox

STRATEGIES = list(ox.STRATEGIES)
ALL_CASES: dict[str, Case] = {**CASES, **FAMILIES, **THIRD_PARTY}
STEPS = 3
MODEL_KEY, BATCH_KEY, STEP_KEY = 0, 1, 2


# -- Comparing runs. -------------------------------------------------------------------


@jaxtyped(typechecker=beartype)
def assert_close(
    ours: Shaped[np.ndarray, "..."],
    reference: Shaped[np.ndarray, "..."],
    what: str,
    scale: float | None = None,
    rtol: float = 1e-6,
):
    """float32: within `rtol` of `scale` (by default the leaf's own); any other dtype
    (bfloat16, integers): bitwise."""
    assert ours.dtype == reference.dtype and ours.shape == reference.shape, what
    if reference.dtype == np.float32:
        if scale is None:
            scale = float(np.max(np.abs(reference), initial=0.0))
        np.testing.assert_allclose(ours, reference, rtol=rtol, atol=rtol * scale, err_msg=what)
    else:
        np.testing.assert_array_equal(ours, reference, err_msg=what)


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """Host copies of every array leaf of a tree, with its key path, taken when made:
    the next step donates (deletes) this step's outputs. bfloat16 stays bfloat16."""

    leaves: list[tuple[str, np.ndarray]]


def _compared(leaf: Any) -> bool:
    """Arrays, and Python or NumPy scalars: a constant that a remat region returns comes
    out of a differentiated program as a Python value (BatchNorm's `first_time` flag is
    `False` after `jax.checkpoint`, `Array(False)` without it, in plain JAX too)."""
    return eqx.is_array(leaf) or isinstance(leaf, (bool, int, float, np.generic))


def snapshot(tree: Any) -> Snapshot:
    if isinstance(tree, Snapshot):
        return tree
    leaves = jax.tree_util.tree_leaves_with_path(eqx.filter(tree, _compared))
    return Snapshot([(jax.tree_util.keystr(path), np.asarray(leaf)) for path, leaf in leaves])


def assert_same(
    ours: Any, reference: Any, what: str, *, rtol: float = 1e-6, whole_tree: bool = False
) -> None:
    """Two trees (or snapshots of trees) hold the same arrays at the same paths. With
    `whole_tree`, float32 leaves are compared within `rtol` of the largest value of the
    whole tree rather than of each leaf: rounding noise is relative to what flows through
    the computation, and a gradient that is mathematically zero (a bias before a
    BatchNorm) is noise of that size in every program."""
    ours_leaves, reference_leaves = snapshot(ours).leaves, snapshot(reference).leaves
    assert [p for p, _ in ours_leaves] == [p for p, _ in reference_leaves], what
    scale = None
    if whole_tree:
        scale = max(
            (
                float(np.max(np.abs(b), initial=0.0))
                for _, b in reference_leaves
                if b.dtype == np.float32
            ),
            default=0.0,
        )
    for (path, a), (_, b) in zip(ours_leaves, reference_leaves):
        assert_close(a, b, f"{what}: {path}", scale, rtol)


def memories(tree: Any) -> set[str]:
    return {
        leaf.sharding.memory_kind
        for leaf in jax.tree_util.tree_leaves(eqx.filter(tree, eqx.is_array))
        if not jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key)
    }


# -- The two training loops: plain Equinox + optax, and offload_eqx. ----------------------


def _inputs(case: Case) -> tuple[list[Any], list[PRNGKeyArray | None]]:
    """A fresh batch and key per step (a donated argument is deleted by its call), all
    created before the transfer guard is switched on."""
    batches = [case.batch(jax.random.key(BATCH_KEY)) for _ in range(STEPS)]
    keys = [
        jax.random.fold_in(jax.random.key(STEP_KEY), i) if case.dropout else None
        for i in range(STEPS)
    ]
    return batches, keys


def _gradients(case: Case, model, state, batch, key):
    """`(loss, state), grads` of the trainable part, the frozen part held fixed."""
    trainable, frozen = eqx.partition(model, case.filter_spec(model))

    def loss(trainable, frozen, state, batch, key):
        return case.loss(eqx.combine(trainable, frozen), state, batch, key)

    return eqx.filter_value_and_grad(loss, has_aux=True)(trainable, frozen, state, batch, key)


def reference_run(case: Case, tx: Any) -> list[tuple]:
    """Plain `eqx.filter_jit` + optax, as a user writes it without offload_eqx. Returns,
    per step, (model, state, loss, grads)."""
    model, state = case.make(jax.random.key(MODEL_KEY))
    opt_state = tx.init(eqx.filter(model, case.filter_spec(model)))

    @eqx.filter_jit
    def step(model, opt_state, state, batch, key):
        (loss, state), grads = _gradients(case, model, state, batch, key)
        params = eqx.filter(model, case.filter_spec(model))
        updates, opt_state = tx.update(grads, opt_state, params)
        return eqx.apply_updates(model, updates), opt_state, state, loss, grads

    batches, keys = _inputs(case)
    trajectory = []
    for batch, key in zip(batches, keys):
        model, opt_state, state, loss, grads = step(model, opt_state, state, batch, key)
        trajectory.append(tuple(map(snapshot, (model, state, loss, grads))))
    return trajectory


def offload_step(case: Case, opt: Any, strategy: str, *, fused: bool = False, **jit_kwargs):
    """The same step under `ox.filter_jit`: `opt.update` + `ox.apply_updates`, or
    `ox.update_and_apply` when `fused`."""

    @ox.filter_jit(strategy=strategy, **jit_kwargs)
    def step(model, opt_state, state, batch, key):
        (loss, state), grads = _gradients(case, model, state, batch, key)
        if fused:
            model, opt_state = ox.update_and_apply(opt, grads, opt_state, model)
        else:
            params = eqx.filter(model, case.filter_spec(model))
            updates, opt_state = opt.update(grads, opt_state, params)
            model = ox.apply_updates(model, updates)
        return model, opt_state, state, loss, grads

    return step


def offload_run(case: Case, opt: Any, strategy: str, *, fused: bool = False):
    """Place, init, audit, then train under the guard with everything donated. Returns
    the trajectory, the audit report and the final (model, opt_state)."""
    model, state = case.make(jax.random.key(MODEL_KEY))
    model = ox.place(model, strategy)
    # `opt.init` cannot know the step's strategy: `ox.place` puts the state where it wants.
    opt_state = ox.place(opt.init(eqx.filter(model, case.filter_spec(model))), strategy)
    step = offload_step(case, opt, strategy, fused=fused, donate="all", audit=True)
    batches, keys = _inputs(case)

    # Static audit of the step (raises ContractError on any broken contract), then the
    # same calls under the transfer guard: no implicit transfer may happen or be reported.
    report = ox.audit(step, model, opt_state, state, batches[0], keys[0])
    report.assert_no_implicit()
    trajectory = []
    with ox.no_implicit_transfers():
        for batch, key in zip(batches, keys):
            model, opt_state, state, loss, grads = step(model, opt_state, state, batch, key)
            trajectory.append(tuple(map(snapshot, (model, state, loss, grads))))
    return trajectory, report, (model, opt_state)


# Parameters and state after optimizer steps agree to 1e-5 of their scale, the losses and
# every step's gradients to 1e-6: a program that rematerialises (a region, a strategy)
# rounds differently, and the optimizer turns a gradient's last bits into more than 1e-6
# of a parameter (Adam divides by the gradient's magnitude). A wrong gradient or update
# moves a parameter by about the learning rate, 1e-2: three orders above either bound.
PARAMETER_RTOL = 1e-5


def assert_same_trajectory(ours: list[tuple], reference: list[tuple], rtol: float = 1e-6):
    """The gradients (within `rtol` of the largest gradient) and the loss of every step,
    and the parameters and state after it (within `PARAMETER_RTOL`, or `rtol` if larger)
    agree."""
    after = max(rtol, PARAMETER_RTOL)
    for i, ((model, state, loss, grads), (ref_model, ref_state, ref_loss, ref_grads)) in enumerate(
        zip(ours, reference)
    ):
        assert_same(grads, ref_grads, f"gradients of step {i}", rtol=rtol, whole_tree=True)
        assert_same(loss, ref_loss, f"loss of step {i}", rtol=rtol)
        assert_same(model, ref_model, f"parameters after step {i}", rtol=after)
        assert_same(state, ref_state, f"eqx.nn.State after step {i}", rtol=after)


_REFERENCES: dict[tuple[str, str], list[tuple]] = {}


def _transformation(name: str, optimizer: str) -> Any:
    """`optimizer` is a key of `optax_wrappers()`, or "own": the case's own optimizer
    (`optax.adam(1e-2)` unless `FAMILY_OPTIMIZERS` says otherwise). A fresh instance."""
    if optimizer != "own":
        return optax_wrappers()[optimizer]
    return FAMILY_OPTIMIZERS.get(name, _adam)()


def _adam() -> Any:
    """Adam with `eps=1e-3`. With the default 1e-8 an element whose gradient is near zero
    moves by lr * g / (|g| + eps), which turns the 1e-10 by which a rematerialised program
    rounds that gradient differently into 1e-6 of the parameter's scale (the encoder under
    hybrid, on this machine): the comparison would measure Adam's conditioning, not
    offload_eqx. Every gradient is compared at 1e-6 anyway."""
    return optax.adam(1e-2, eps=1e-3)


def _reference(name: str, optimizer: str = "own") -> list[tuple]:
    """The plain run of model `name` with `optimizer`, computed once per session."""
    if (name, optimizer) not in _REFERENCES:
        tx = _transformation(name, optimizer)
        _REFERENCES[name, optimizer] = reference_run(ALL_CASES[name], tx)
    return _REFERENCES[name, optimizer]


# -- 1. Every model, every strategy. -------------------------------------------------------

# Where each model's annotations put things under the default strategy ("annotated").
DECLARES_HOST_PARAMS = {"mlp", "vit", "batch_norm", "odd_leaves", *FAMILIES, *THIRD_PARTY}
# Declared "offload" by the model.
NAMES = {"encoder": "block_output", "vit": "mlp_hidden", **FAMILY_NAMES}


# Each family under its own declarations ("annotated"), as its users would run it; under
# every other strategy with `--full`. The other strategies meet these models in the
# default run through `test_bound_method_as_the_function`, `test_optax_wrappers`, the
# equivalence tests' models (each under one other strategy in turn) and the optimizer's.
@pytest.mark.parametrize(
    "name, strategy",
    rotated(ALL_CASES, STRATEGIES, ("annotated",), group="real_models", turn=False),
)
def test_same_as_plain_equinox(name: str, strategy: str):
    case = ALL_CASES[name]
    opt = ox.offload_optimizer(_transformation(name, "own"))
    if strategy == "offload_activations" and name not in NAMES:
        # Nothing named, so nothing to offload: the README's rule is an error, and it
        # says what to write (hybrid, by contrast, still offloads parameters and state).
        with pytest.raises(
            ValueError,
            match=r"'offload_activations'.*no module declares any activation names.*ox.name",
        ):
            offload_run(case, opt, strategy)
        return
    trajectory, report, (model, opt_state) = offload_run(case, opt, strategy)
    assert_same_trajectory(trajectory, _reference(name), case.rtol)

    # The strategy really moved what it says it moves (nothing is a silent no-op), and
    # the outputs came back where the plan keeps them.
    spec = ox.STRATEGIES[strategy]
    host_params = spec.params == "pinned_host" or (
        spec.params == "annotated" and name in DECLARES_HOST_PARAMS
    )
    assert ("pinned_host" in memories(model)) == host_params, memories(model)
    assert ("pinned_host" in memories(opt_state)) == (spec.optimizer != "device")
    if host_params:
        assert report.total("host-to-device", kind="parameter") > 0, report
    if name in NAMES and spec.activations in ("offload", "annotated"):
        offloaded = report.select("device-to-host", NAMES[name], kind="activation")
        assert offloaded, f"{NAMES[name]!r} is declared 'offload' but is never offloaded:\n{report}"


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_bound_method_as_the_function(strategy: str):
    """`ox.filter_jit(model.__call__)`: the bound method's module is partitioned like an
    argument (its arrays traced and planned, not baked in), and the call gives
    `eqx.filter_jit(model.__call__)`'s logits, with the guard on and nothing implicit."""
    x, _ = classifier_batch(jax.random.key(BATCH_KEY))
    expected = eqx.filter_jit(bound_method(jax.random.key(MODEL_KEY)).__call__)(x)
    model = ox.place(bound_method(jax.random.key(MODEL_KEY)), strategy)
    forward = ox.filter_jit(model.__call__, strategy=strategy, audit=True)
    if strategy == "offload_activations":  # the model names nothing: refused, as above
        with pytest.raises(ValueError, match=r"'offload_activations'.*no module declares"):
            forward(x)
        return
    report = ox.audit(forward, x)
    report.assert_no_implicit()
    with ox.no_implicit_transfers():
        logits = forward(x)
    assert_same(logits, expected, "logits")
    if ox.STRATEGIES[strategy].params != "device":  # the head is declared pinned_host
        assert report.total("host-to-device", kind="parameter") > 0, report


def test_annotated_mlp_called_on_one_example():
    """`mlp(x)` on a single example, no vmap, no region written: the host-resident
    middle layer is fetched by the region the annotated layer brings."""
    model = ox.place(mlp(jax.random.key(MODEL_KEY)))
    assert model.layers[1].weight.sharding.memory_kind == "pinned_host"
    x = jax.random.normal(jax.random.key(BATCH_KEY), (8,))

    @ox.filter_jit(audit=True)
    def loss_and_grad(model, x):
        return eqx.filter_value_and_grad(lambda m: jnp.sum(m(x) ** 2))(model)

    report = ox.audit(loss_and_grad, model, x)
    fetched = {t.what for t in report.select("host-to-device", kind="parameter")}
    assert fetched == {"model.layers[1].weight", "model.layers[1].bias"}, report
    with ox.no_implicit_transfers():
        loss, grads = loss_and_grad(model, x)
    reference = eqx.filter_jit(
        lambda m, x: eqx.filter_value_and_grad(lambda m: jnp.sum(m(x) ** 2))(m)
    )(mlp(jax.random.key(MODEL_KEY)), x)
    assert_same((loss, grads), reference, "loss and gradients")


# -- 2. optax wrappers through ox.offload_optimizer. ---------------------------------------


# The optimizer sees four situations: its state on the device or the host, times
# gradients that are device- or host-typed (host-resident parameters). One strategy each
# (the other three strategies differ from baseline in activations only).
OPTIMIZER_STRATEGIES = ["baseline", "offload_optimizer", "offload_params", "hybrid"]


@pytest.mark.parametrize("strategy", OPTIMIZER_STRATEGIES)
@pytest.mark.parametrize("wrapper", list(optax_wrappers()))
def test_optax_wrappers(wrapper: str, strategy: str):
    """Every wrapper, offloaded, gives plain optax's trajectory, through
    `ox.update_and_apply` (any optax transformation)."""
    opt = ox.offload_optimizer(optax_wrappers()[wrapper])
    trajectory, _, (_, opt_state) = offload_run(CASES["mlp"], opt, strategy, fused=True)
    assert_same_trajectory(trajectory, _reference("mlp", wrapper))
    assert ("pinned_host" in memories(opt_state)) == (ox.STRATEGIES[strategy].optimizer != "device")


@pytest.mark.parametrize("strategy", ["offload_optimizer", "hybrid"])
@pytest.mark.parametrize("fused", [False, True], ids=["update", "update_and_apply"])
def test_leaf_stream(strategy: str, fused: bool):
    """`stream="leaf"`: the global transform once, then one leaf's update at a time; the
    result is `chain(global, per_leaf)`'s within float32 rounding."""
    opt = ox.offload_optimizer(
        optax.adamw(1e-2), stream="leaf", global_transform=optax.clip_by_global_norm(1.0)
    )
    trajectory, _, _ = offload_run(CASES["mlp"], opt, strategy, fused=fused)
    assert_same_trajectory(trajectory, _reference("mlp", "chain_clip_adamw"))


# -- 3. After a trace-time error, nothing donated is lost. --------------------------------


def _bad_shape(batch: Any) -> Any:
    return jnp.ones((4, 9))  # the MLP takes 8 features


def _bad_structure(batch: Any) -> Any:
    return {"x": batch}


BAD_INPUTS: dict[str, tuple[Callable[[Any], Any], str]] = {
    "shape": (_bad_shape, r"dot_general|shape|9"),
    "structure": (_bad_structure, r"dict|mapping|vmap|axis"),
}


def _fresh_mlp(strategy: str):
    case = CASES["mlp"]
    model, state = case.make(jax.random.key(MODEL_KEY))
    model = ox.place(model, strategy)
    opt = ox.offload_optimizer(optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2)))
    opt_state = opt.init(eqx.filter(model, eqx.is_inexact_array))
    step = offload_step(case, opt, strategy, donate="all")
    return step, model, opt_state


def _alive(tree: Any) -> bool:
    return not any(
        leaf.is_deleted() for leaf in jax.tree_util.tree_leaves(eqx.filter(tree, eqx.is_array))
    )


@pytest.mark.parametrize("strategy", ["annotated", "hybrid"])
@pytest.mark.parametrize("after_good_call", [False, True], ids=["first_call", "later_call"])
@pytest.mark.parametrize("bad", list(BAD_INPUTS))
def test_state_after_error(bad: str, after_good_call: bool, strategy: str):
    """A bad batch raises at trace time, before anything is donated: the user's model
    and optimizer state are intact, and the next good step equals a run that never saw
    the error (bitwise)."""
    make_bad, message = BAD_INPUTS[bad]
    good = [mlp_batch(jax.random.key(BATCH_KEY)) for _ in range(3)]
    bad_batch = make_bad(mlp_batch(jax.random.key(BATCH_KEY)))

    step, model, opt_state = _fresh_mlp(strategy)
    calls = 2 if after_good_call else 1
    for batch in good[:calls]:
        model, opt_state, _, fresh_loss, _ = step(model, opt_state, None, batch, None)
    fresh = (model, opt_state, fresh_loss)

    step, model, opt_state = _fresh_mlp(strategy)
    if after_good_call:
        model, opt_state, _, _, _ = step(model, opt_state, None, good[2], None)
    with pytest.raises(Exception, match=message):
        step(model, opt_state, None, bad_batch, None)
    assert _alive(model), "the model was deleted by a call that raised"
    assert _alive(opt_state), "the optimizer state was deleted by a call that raised"
    model, opt_state, _, loss, _ = step(model, opt_state, None, good[0], None)
    ours, theirs = snapshot((model, opt_state, loss)).leaves, snapshot(fresh).leaves
    assert [path for path, _ in ours] == [path for path, _ in theirs]
    for (path, a), (_, b) in zip(ours, theirs):
        np.testing.assert_array_equal(a, b, err_msg=path)


@pytest.mark.parametrize("strategy", ["annotated", "hybrid"])
def test_state_after_error_foreign_optimizer_state(strategy: str):
    """Optimizer state initialised for another model: an error, and both the model and
    the (wrong) state survive it."""
    step, model, opt_state = _fresh_mlp(strategy)
    other = ox.place(eqx.nn.MLP(8, 4, width_size=32, depth=1, key=jax.random.key(5)), strategy)
    opt = ox.offload_optimizer(optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2)))
    foreign = opt.init(eqx.filter(other, eqx.is_inexact_array))
    with pytest.raises(Exception, match=r"opt_state|optimizer state|structure|shape"):
        step(model, foreign, None, mlp_batch(jax.random.key(BATCH_KEY)), None)
    assert _alive(model) and _alive(foreign)
    model, opt_state, _, loss, _ = step(model, opt_state, None, mlp_batch(jax.random.key(1)), None)
    assert np.isfinite(float(loss))


def test_state_after_error_wrong_key():
    """The encoder's dropout key of the wrong kind (a raw uint32 key of the wrong shape):
    an error; the model survives and trains on."""
    case = CASES["encoder"]
    model, _ = case.make(jax.random.key(MODEL_KEY))
    model = ox.place(model, "hybrid")
    opt = ox.offload_optimizer(optax.adam(1e-2))
    opt_state = opt.init(eqx.filter(model, eqx.is_inexact_array))
    step = offload_step(case, opt, "hybrid", donate="all")
    batch = case.batch(jax.random.key(BATCH_KEY))
    with pytest.raises(Exception, match=r"key|shape|dtype"):
        step(model, opt_state, None, batch, jnp.zeros((3,), jnp.uint32))
    assert _alive(model) and _alive(opt_state)
    model, opt_state, _, loss, _ = step(
        model, opt_state, None, case.batch(jax.random.key(BATCH_KEY)), jax.random.key(STEP_KEY)
    )
    assert np.isfinite(float(loss))


def test_mlp_loss_is_the_model_loss():
    """Guards the suite itself: the loss the cases train is the model's output, so a
    change that breaks the model cannot pass by comparing two broken runs."""
    model = mlp(jax.random.key(MODEL_KEY))
    x = mlp_batch(jax.random.key(BATCH_KEY))
    loss, _ = mlp_loss(model, None, x, None)
    expected = np.mean(np.stack([np.asarray(model(row)) for row in x]) ** 2)
    np.testing.assert_allclose(float(loss), expected, rtol=1e-6)
