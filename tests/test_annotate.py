"""`ox.annotate` on the modules users do not write: every `eqx.nn` module, whatever
non-array fields it has, and lists of blocks (issue 17, items 1 and 2)."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import offload_eqx as ox


class Net(eqx.Module):
    mlp: eqx.nn.MLP
    norm: eqx.nn.BatchNorm
    shared: eqx.nn.Shared

    def __init__(self, key):
        k_mlp, k_embed, k_head = jax.random.split(key, 3)
        self.mlp = eqx.nn.MLP(4, 4, 8, 2, key=k_mlp)
        self.norm = eqx.nn.BatchNorm(4, axis_name="batch", mode="batch")
        embedding = eqx.nn.Embedding(6, 4, key=k_embed)
        head = eqx.nn.Linear(4, 6, use_bias=False, key=k_head)
        self.shared = eqx.nn.Shared(
            (embedding, head), lambda pair: pair[1].weight, lambda pair: pair[0].weight
        )


def _memories(tree) -> dict[str, str | None]:
    return {leaf.path: leaf.memory for leaf in ox.plan(tree).leaves}


@pytest.mark.parametrize("field", ["mlp", "norm", "shared"])
def test_a_memory_applies_to_the_arrays_under_an_eqx_nn_module(field):
    """`eqx.nn.MLP` holds an activation function, `BatchNorm` an axis name, `Shared` two
    functions: a memory applies to their arrays, the other fields are left alone (each
    was 'holds <function>, not an array')."""
    net = Net(jax.random.key(0))
    annotated = ox.annotate(net, lambda m: getattr(m, field), memory="pinned_host")
    memories = _memories(annotated)
    mine = {p: m for p, m in memories.items() if p.startswith(f"tree.{field}.")}
    others = {p: m for p, m in memories.items() if not p.startswith(f"tree.{field}.")}
    # BatchNorm's initial state (`eqx.nn.StateIndex(...).init`) is not a parameter.
    params = {p: m for p, m in mine.items() if ".init" not in p}
    assert params and set(params.values()) == {"pinned_host"}, memories
    assert set(others.values()) == {None}, memories
    assert all(m is None for p, m in mine.items() if ".init" in p), memories
    # The functions and the axis name are untouched, and the module computes as before.
    assert annotated.mlp.activation is net.mlp.activation
    assert annotated.norm.axis_name == "batch"
    placed = ox.place(annotated)
    x = jnp.linspace(-1.0, 1.0, 4)
    np.testing.assert_allclose(
        ox.filter_jit(lambda m, x: m.mlp(x))(placed, x), net.mlp(x), rtol=1e-6
    )


class Stack(eqx.Module):
    blocks: list

    def __call__(self, x):
        for block in self.blocks:
            x = jnp.tanh(block(x))
        return x


def _stack() -> Stack:
    keys = jax.random.split(jax.random.key(1), 4)
    return Stack([eqx.nn.Linear(64, 64, key=k) for k in keys])


def test_selecting_a_list_selects_its_elements():
    """`lambda m: m.blocks` on a Python list of blocks annotates each block (each brings
    its own region, fetching one block at a time), as `m.blocks[:]` does; it used to make
    the whole model one region, fetching every block at once."""
    whole = ox.annotate(_stack(), lambda m: m.blocks, memory="pinned_host")
    sliced = ox.annotate(_stack(), lambda m: m.blocks[:], memory="pinned_host")
    assert type(whole) is Stack  # the model itself brings no region
    assert [type(b) for b in whole.blocks] == [type(b) for b in sliced.blocks]
    assert all(isinstance(b, eqx.nn.Linear) for b in whole.blocks)
    assert ox.plan(whole) == ox.plan(sliced)

    grad = ox.filter_jit(eqx.filter_grad(lambda m, x: jnp.sum(m(x))))
    x = jnp.ones(64)
    report = ox.audit(grad, ox.place(whole), x)
    # One region per block: each block's weight is fetched by itself, in the forward and
    # again in the backward pass.
    fetched = [
        t
        for t in report.select("host-to-device", kind="parameter")
        if t.what == "m.blocks[2].weight"
    ]
    assert [t.phase for t in fetched] == ["forward", "backward"], report
    expected = eqx.filter_grad(lambda m, x: jnp.sum(m(x)))(_stack(), x)
    got = grad(ox.place(whole), x)
    np.testing.assert_allclose(got.blocks[3].weight, expected.blocks[3].weight, rtol=1e-5)


def test_a_list_with_array_free_modules_annotates_only_the_ones_with_arrays():
    """`eqx.nn.Sequential` mixes layers with `eqx.nn.Lambda` (no arrays): only layers
    holding arrays are annotated."""
    model = eqx.nn.Sequential(
        [eqx.nn.Linear(3, 3, key=jax.random.key(0)), eqx.nn.Lambda(jax.nn.relu)]
    )
    annotated = ox.annotate(model, lambda m: m.layers, memory="pinned_host")
    assert type(annotated.layers[1]) is eqx.nn.Lambda
    assert {leaf.memory for leaf in ox.plan(annotated).leaves} == {"pinned_host"}


@pytest.mark.deviceless
def test_a_list_field_compiles_like_its_elements_on_h100():
    """The issue's measurement: a list selected whole used to need more device memory
    than its elements selected one by one (410,600 B against 317,520 B)."""
    grad = ox.filter_jit(eqx.filter_grad(lambda m, x: jnp.sum(m(x))))
    x = jnp.ones(64)
    totals = [
        ox.memory_report(
            grad, ox.place(ox.annotate(_stack(), where, memory="pinned_host")), x, target="h100"
        ).total
        for where in (lambda m: m.blocks, lambda m: m.blocks[:])
    ]
    assert totals[0] == totals[1], totals
