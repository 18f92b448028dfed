"""Host-resident layers sliced by two nested scans: stacked `eqx.nn.Linear`s inside
stacked blocks, each level a `jax.lax.scan`, the inner Linears annotated `pinned_host`.

XLA:GPU cannot compile the gradient of such a slice of a slice (its host offloader fails
with `INTERNAL: during context [end-of-post-layout_assignment]`, in plain JAX too), so a
step traced for it is refused before compiling, naming the leaves and the fix; the fixes
(the outer block annotated, or the outer loop an `ox.scan`) compile, with one block's
layers on the device at a time. The forward pass alone, and the CPU, compile the nested
slices as they are; on the CPU training equals plain Equinox. A `jax.lax.scan` over
training steps around a differentiated scan of host layers is one level, and compiles.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
import pytest
from real_models import Case
from test_real_models import assert_same_trajectory, offload_run, reference_run

import offload_eqx as ox

DIM, INNER, OUTER, BATCH = 64, 3, 4, 8


class Block(eqx.Module):
    layers: eqx.nn.Linear  # INNER stacked layers

    def __call__(self, x):
        dynamic, static = eqx.partition(self.layers, eqx.is_array)

        def step(x, layer):
            return jnp.tanh(eqx.combine(layer, static)(x)), None

        return jax.lax.scan(step, x, dynamic)[0]


class Model(eqx.Module):
    blocks: Block  # OUTER stacked blocks
    outer_scan: bool = eqx.field(static=True, default=False)

    def __call__(self, x):
        if self.outer_scan:
            return ox.scan(self.blocks, x)
        dynamic, static = eqx.partition(self.blocks, eqx.is_array)

        def step(x, block):
            return eqx.combine(block, static)(x), None

        return jax.lax.scan(step, x, dynamic)[0]


def make(key, dim: int = DIM, annotate: str = "inner", outer_scan: bool = False) -> Model:
    def block(key):
        keys = jax.random.split(key, INNER)
        return Block(eqx.filter_vmap(lambda k: eqx.nn.Linear(dim, dim, key=k))(keys))

    model = Model(eqx.filter_vmap(block)(jax.random.split(key, OUTER)), outer_scan)
    where = {"inner": lambda m: m.blocks.layers, "outer": lambda m: m.blocks}
    return ox.annotate(model, where[annotate], memory="pinned_host")


def loss(model, state, batch, key):
    return jnp.mean(jax.vmap(model)(batch) ** 2), state


@ox.filter_jit
def gradient(model, x):
    return eqx.filter_value_and_grad(lambda m: loss(m, None, x, None)[0])(model)


@ox.filter_jit
def forward(model, x):
    return loss(model, None, x, None)[0]


def _batch(dim: int = DIM) -> jax.Array:
    return jax.random.normal(jax.random.key(1), (BATCH, dim))


@pytest.mark.deviceless
def test_h100_refuses_the_gradient_of_nested_host_slices_before_compiling():
    with pytest.raises(ox.ContractError) as error:
        ox.memory_report(gradient, make(jax.random.key(0)), _batch(), target="h100")
    message = str(error.value)
    for part in (
        "`model.blocks.layers.weight` (shape (4, 3, 64, 64), sliced to (64, 64))",
        "`model.blocks.layers.bias`",
        "end-of-post-layout_assignment",
        "ox.annotate(model, lambda m: m.blocks, memory='pinned_host')",
        "ox.scan(model.blocks, x)",
        "memory='device'",
    ):
        assert part in message, message
    assert [v.rule for v in error.value.violations] == ["host leaf in nested loops"] * 2


@pytest.mark.deviceless
def test_h100_compiles_the_forward_pass_of_nested_host_slices():
    report = ox.memory_report(forward, make(jax.random.key(0)), _batch(), target="h100")
    assert report.host["argument"] >= OUTER * INNER * DIM * DIM * 4


@pytest.mark.deviceless
@pytest.mark.parametrize("fix", ["outer block annotated", "outer ox.scan"])
def test_h100_fixes_compile_with_one_block_on_the_device_at_a_time(fix: str):
    dim = 512
    model = make(
        jax.random.key(0), dim, *(("outer", False) if "annotated" in fix else ("inner", True))
    )
    report = ox.memory_report(gradient, model, _batch(dim), target="h100")
    weights = OUTER * INNER * dim * dim * 4
    assert report.host["argument"] >= weights
    # One block's layers and their gradient: a quarter of the weights each.
    assert report.device["temp"] < weights, report


def test_cpu_training_of_nested_host_slices_equals_plain_equinox():
    case = Case(lambda key: make(key), loss, lambda key: jax.random.normal(key, (BATCH, DIM)))
    adam = optax.adam(1e-2)
    reference = reference_run(case, adam)
    trajectory, report, _ = offload_run(case, ox.offload_optimizer(optax.adam(1e-2)), "annotated")
    assert_same_trajectory(trajectory, reference, rtol=0.0)
    assert report.total("host-to-device", kind="parameter") > 0, report


@pytest.mark.deviceless
def test_h100_compiles_a_scan_over_training_steps_around_host_layers():
    """The loop over training steps carries the host-resident layers, and each step's
    gradient runs one scan backward: one level of slicing, which XLA:GPU compiles. Only
    loops inside the differentiated function count."""
    block = ox.annotate(make(jax.random.key(0)).blocks, lambda b: b.layers, memory="pinned_host")
    block = jax.tree.map(lambda x: x[0], block)  # one block: its 3 stacked layers
    opt = ox.offload_optimizer(optax.adam(1e-3))
    opt_state = ox.place(opt.init(eqx.filter(block, eqx.is_inexact_array)))

    @ox.filter_jit
    def train(block, opt_state, batches):
        params, static = eqx.partition(block, eqx.is_array)

        def step(carry, x):
            block = eqx.combine(carry[0], static)
            grads = eqx.filter_grad(lambda b: jnp.mean(jax.vmap(b)(x) ** 2))(block)
            block, opt_state = ox.update_and_apply(opt, grads, carry[1], block)
            return (eqx.filter(block, eqx.is_array), opt_state), None

        (params, opt_state), _ = jax.lax.scan(step, (params, opt_state), batches)
        return eqx.combine(params, static), opt_state

    batches = jax.random.normal(jax.random.key(1), (2, BATCH, DIM))
    report = ox.memory_report(train, ox.place(block), opt_state, batches, target="h100")
    assert report.host["argument"] >= INNER * DIM * DIM * 4
