"""Published Equinox libraries (`tests/published_libraries.py`), installed by the test
session from the pinned versions of the `test` extra, each model used unmodified:

- trained for a few steps under plain `eqx.filter_jit` + optax, and again under
    `ox.filter_jit` with its big modules in host memory (`ox.annotate`) and the optimizer
    offloaded: the same losses, gradients and parameters;
- its gradient compiled for an H100 and a TPU without the hardware (`ox.memory_report`,
    `ox.estimate`), which is where the JAX features these libraries use meet a deviceless
    compile: values made while traced (`eqx.nn.RotaryPositionalEmbedding` in ESM2),
    `eqx.error_if` (Megalodon, diffrax), `eqx.internal.while_loop` (diffrax);
- diffrax's `BacksolveAdjoint` over a host-resident vector field, which carries the
    parameters through a `while_loop`: a `HostUseError` naming them, and its fix.

Left out: equimo and jaxonmodels (they need Python >= 3.12; the project supports 3.11),
e1jax (it installs PyTorch). Megalodon's gradient with host-resident blocks makes XLA:TPU
abort the process (libtpu 0.0.42; `docs/limits.md`), so for the TPU its loss is
compiled, not its gradient.
"""

from typing import Any

import diffrax
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from published_libraries import PUBLISHED
from test_real_models import (
    _adam,
    assert_same_trajectory,
    memories,
    offload_run,
    reference_run,
)

import offload_eqx as ox
from offload_eqx._inspect.memory_report import compiled_report
from offload_eqx._inspect.program_audit import audit_traced_for
from offload_eqx._targets.deviceless import program_of_step
from offload_eqx._targets.targets import get_target

# Seconds on the project's 2-core machine: ESM2 14, Megalodon 21, diffrax 16; the default
# run trains ESM2, `--full` all three.
TRAINED = [pytest.param(n, marks=() if n == "esm2quinox" else pytest.mark.full) for n in PUBLISHED]
# The default run compiles ESM2's gradient for both targets (18 s); `--full` every pair
# (about 45 s more). `tests/test_callbacks.py` compiles each feature these libraries use
# alone, for both targets.
_DEFAULT_DEVICELESS = {("esm2quinox", "h100"), ("esm2quinox", "tpu-v5p")}
DEVICELESS = [
    pytest.param(n, t, marks=() if (n, t) in _DEFAULT_DEVICELESS else pytest.mark.full)
    for n in PUBLISHED
    for t in ("h100", "tpu-v5p")
]


@pytest.mark.parametrize("name", TRAINED)
def test_training_equals_plain_equinox(name: str):
    """Three Adam steps: plain Equinox, then the annotated modules in pinned_host and Adam
    offloaded (`ox.offload_optimizer`), under the transfer guard with `ox.audit`
    finding nothing implicit: the same trajectory."""
    case = PUBLISHED[name]
    reference = reference_run(case, _adam())
    trajectory, report, (model, opt_state) = offload_run(
        case, ox.offload_optimizer(_adam()), "annotated"
    )
    assert_same_trajectory(trajectory, reference, case.rtol)
    assert "pinned_host" in memories(model), memories(model)
    assert "pinned_host" in memories(opt_state), memories(opt_state)
    assert report.total("host-to-device", kind="parameter") > 0, report


def _gradient(name: str):
    case = PUBLISHED[name]

    @ox.filter_jit
    def gradient(model, batch):
        return eqx.filter_value_and_grad(lambda m: case.loss(m, None, batch, None)[0])(model)

    return gradient


def _loss(name: str):
    case = PUBLISHED[name]

    @ox.filter_jit
    def loss(model, batch):
        return case.loss(model, None, batch, None)[0]

    return loss


@pytest.mark.deviceless
@pytest.mark.parametrize("name, target", DEVICELESS)
def test_memory_report_and_estimate_on_deviceless_targets(name: str, target: str):
    """The gradient (with the annotated modules in pinned_host) compiles for the target:
    its memory report holds them as host arguments, and the estimate prices the step."""
    case = PUBLISHED[name]
    model, _ = case.make(jax.random.key(0))
    batch = case.batch(jax.random.key(1))
    aborts = name == "megalodon_jax" and target.startswith("tpu")
    step = _loss(name) if aborts else _gradient(name)
    report = ox.memory_report(step, model, batch, target=target)
    assert report.host["argument"] > 0, report
    estimate = ox.estimate(step, model, batch, target=target)
    assert estimate.seconds > 0, estimate


@pytest.mark.deviceless
def test_esm2_traced_first_for_the_h100_compiles():
    """A plain `eqx.filter_jit` function of ESM2 in a process that has not traced it:
    `eqx.nn.RotaryPositionalEmbedding` makes its tables while the H100's program is
    traced (JAX ran them on the compile-only devices: "'Executable' object has no
    attribute 'local_devices'"). An `ox.filter_jit` step is traced for this machine
    first, which makes the tables here."""
    case = PUBLISHED["esm2quinox"]
    model, _ = case.make(jax.random.key(0))
    batch = case.batch(jax.random.key(1))

    @eqx.filter_jit
    def loss(model, batch):
        return case.loss(model, None, batch, None)[0]

    eqx.clear_caches()  # the rotary tables too, as in a new process
    report = ox.memory_report(loss, model, batch, target="h100")
    assert report.device["output"] == 4, report  # the loss, float32


# -- diffrax's BacksolveAdjoint: the parameters carried through a while_loop ------------


class LinearField(eqx.Module):
    linear: eqx.nn.Linear

    def __call__(self, t, y, args):
        return jnp.tanh(self.linear(y))


def _linear_field() -> LinearField:
    return LinearField(eqx.nn.Linear(2, 2, key=jax.random.key(0)))


def _backsolve_loss(model: LinearField, y0: jax.Array, solver) -> jax.Array:
    def final(y):
        term = diffrax.ODETerm(model)
        adjoint = diffrax.BacksolveAdjoint()
        ys = diffrax.diffeqsolve(term, solver, 0.0, 1.0, 0.1, y, adjoint=adjoint).ys
        assert ys is not None  # saved at t1, diffrax's default
        return ys[-1]

    return jnp.sum(jax.vmap(final)(y0) ** 2)


@pytest.mark.parametrize("solver", [diffrax.Euler(), diffrax.Tsit5()], ids=["Euler", "Tsit5"])
def test_backsolve_adjoint_over_a_host_resident_field_names_the_leaves(solver):
    """Euler meets the host-typed gradient in an addition; Tsit5 in the loop's carry
    (JAX: "while_loop body function carry input and carry output must have equal
    types"). Both are the same fault, said the same way: a `HostUseError` naming the
    leaves and the fix, `ox.fetch`."""
    model = ox.annotate(_linear_field(), lambda m: m.linear, memory="pinned_host")
    y0 = jax.random.normal(jax.random.key(1), (4, 2))

    def loss(model, y0):
        return _backsolve_loss(model, y0, solver)

    with pytest.raises(ox.HostUseError, match=r"`model\.linear\.weight`.*ox\.fetch") as error:
        ox.filter_jit(eqx.filter_grad(loss))(model, y0)
    # The search for the others stops after 1.5 s once one is found (`_jit/host_use.py`):
    # a trace through Tsit5's backward solve can take that long.
    assert "model.linear.weight" in error.value.paths
    assert set(error.value.paths) <= {"model.linear.weight", "model.linear.bias"}


@pytest.mark.full  # 6 s: two more compiles of the backward solve
def test_backsolve_adjoint_over_a_fetched_field_is_plain_equinox():
    """The fix the error gives: `ox.fetch(model)` before the solve, once; the gradient
    is plain Equinox's, and stays in host memory."""
    field = _linear_field()
    model = ox.annotate(field, lambda m: m.linear, memory="pinned_host")
    y0 = jax.random.normal(jax.random.key(1), (4, 2))

    def loss(model, y0):
        return _backsolve_loss(model, y0, diffrax.Tsit5())

    def loss_fetched(model, y0):
        return loss(ox.fetch(model), y0)

    ours = ox.filter_jit(eqx.filter_grad(loss_fetched))(model, y0)
    theirs = eqx.filter_jit(eqx.filter_grad(loss))(field, y0)
    assert memories(ours) == {"pinned_host"}
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6)


# -- ESM2 with the optimizer update on the host -------------------------------------------


def _host_update_step(tx: Any):
    """ESM2's training step with `tx` on the host (`update_on="host"`), and its
    arguments: the layers in pinned_host, the final norm and logit head where the plan
    leaves them (on the device)."""
    case = PUBLISHED["esm2quinox"]
    opt = ox.offload_optimizer(tx, update_on="host")

    def train_step(model, opt_state, batch):
        grads = eqx.filter_grad(lambda m: case.loss(m, None, batch, None)[0])(model)
        return ox.update_and_apply(opt, grads, opt_state, model)

    model = ox.place(case.make(jax.random.key(0))[0])
    opt_state = ox.place(opt.init(eqx.filter(model, eqx.is_inexact_array)))
    step = ox.filter_jit(train_step, donate="all")
    return step, (model, opt_state, case.batch(jax.random.key(1)))


def test_esm2_host_update_reads_the_device_weights_weight_decay_reads():
    """AdamW's weight decay reads every weight: those the plan leaves on the device are
    sent to the host update, once a step (`device-to-host input`, the audit guide's
    kinds); plain Adam sends none of them."""
    step, args = _host_update_step(optax.adamw(1e-3, weight_decay=0.1))
    read = ox.audit(step, *args).select("d2h", kind="input")
    assert {t.phase for t in read} == {"update"}, read
    assert {t.what.split(".")[1] for t in read} == {"layer_norm", "logit_head"}, read
    assert (len(read), sum(t.bytes for t in read)) == (8, 3588), read
    step, args = _host_update_step(optax.adam(1e-3))
    assert ox.audit(step, *args).select(kind="input") == []


@pytest.mark.deviceless
@pytest.mark.full  # 33 s: ESM2's training step compiled for the H100
def test_esm2_host_update_is_one_host_call_per_group_of_parameters_on_the_h100():
    """On XLA:GPU the host update is split into chained host calls, one per parameter,
    merged in order while a call's results stay within the largest parameter's bytes
    (`_host/split.py`): ESM2's 24 parameters make 6 calls, the three largest stacked
    weights one each. XLA:GPU compiles each traced host computation as one call of its
    own and merges none."""
    step, args = _host_update_step(optax.adamw(1e-3, weight_decay=0.1))
    parameters = len(jax.tree.leaves(eqx.filter(args[0], eqx.is_inexact_array)))
    report = audit_traced_for("cuda", step, args, {})[0]
    traced = report.host_computations
    _, compiled = compiled_report(program_of_step(step, args, {}), get_target("h100"), "step")
    calls = compiled.as_text().count(" custom-call-start(")
    assert (parameters, len(traced), calls) == (24, 6, 6), (parameters, traced, calls)
