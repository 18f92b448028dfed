"""The plan: placements from field metadata, strategies, annotation from outside."""

import re

import equinox as eqx
import jax
import jax.numpy as jnp
from helpers import Block, loop_model, nn_model, scanned_model

import offload_eqx as ox


def test_plan_reads_fields_and_strategies_override_by_role():
    model = scanned_model(jax.random.key(0))
    plan = ox.plan(model)
    assert [(leaf.path, leaf.memory) for leaf in plan.leaves] == [
        ("tree.layers.w1", "pinned_host"),
        ("tree.layers.w2", "pinned_host"),
    ]
    assert plan.activations == {"x": "offload"}
    baseline = ox.plan(model, "baseline")
    assert {leaf.memory for leaf in baseline.leaves} == {"device"}
    assert baseline.activations == {"x": "save"} and baseline.saves_everything
    remat = ox.plan(model, "remat")
    assert remat.activations == {"x": "remat"}


def test_plan_printout_lists_path_shape_dtype_bytes_memory():
    text = str(ox.plan(loop_model(jax.random.key(0)), "hybrid"))
    assert "Plan (strategy 'hybrid')" in text
    rows = [
        r"tree.blocks\[0\].weight +16x16 +float32 +1.00 KiB +pinned_host +pinned_host",
        r"tree.blocks\[0\].bias +16 +float32 +64 B +pinned_host +device",
        r"tree.head +16x4 +float32 +256 B +\(as given\) +-",
    ]
    for row in rows:
        assert re.search(row, text), row
    assert "activations: h=offload" in text


def test_field_placement_covers_whole_subtrees():
    class Outer(eqx.Module):
        blocks: list = ox.field(memory="pinned_host")

    outer = Outer(blocks=[Block(weight=jnp.ones((2, 2)), bias=jnp.ones(2))])
    # The inner field declaration wins over the outer one where both apply.
    assert [leaf.memory for leaf in ox.plan(outer).leaves] == ["pinned_host", "device"]


def test_annotate_from_outside_keeps_behaviour_and_type():
    model = nn_model(jax.random.key(0))
    layer = model.mlp.layers[0]
    assert isinstance(layer, eqx.nn.Linear)
    plan = ox.plan(model)
    memories = {leaf.path: leaf.memory for leaf in plan.leaves}
    assert memories["tree.mlp.layers[0].weight"] == "pinned_host"
    assert memories["tree.mlp.layers[3].weight"] is None  # not annotated: not managed
    assert plan.activations == {"hidden": "offload"}
    plain = eqx.nn.MLP(16, 4, width_size=32, depth=3, key=jax.random.key(0))
    x = jnp.ones(16)
    assert jnp.allclose(model.mlp(x), plain(x))
    # The original is untouched, and annotating twice gives the same (cached) class.
    again = ox.annotate(plain, lambda m: m.layers[0], memory="pinned_host")
    twice = ox.annotate(plain, lambda m: m.layers[0], memory="pinned_host")
    assert type(again.layers[0]) is type(twice.layers[0]) is not eqx.nn.Linear
    assert jax.tree_util.tree_structure(again) == jax.tree_util.tree_structure(twice)
    assert ox.plan(plain).leaves[0].memory is None


def test_annotate_a_single_field():
    plain = eqx.nn.Linear(3, 2, key=jax.random.key(0))
    annotated = ox.annotate(plain, lambda m: m.weight, memory="pinned_host")
    assert [leaf.memory for leaf in ox.plan(annotated).leaves] == ["pinned_host", None]
    placed = ox.place(annotated)
    assert placed.weight.sharding.memory_kind == "pinned_host"
    assert placed.bias.sharding.memory_kind == "device"


def test_a_scans_constants_and_carry_are_read_in_either_jax():
    """jax 0.10 gives a scan's `num_consts` and `num_carry`; jax 0.11 packs its inputs'
    groups into `ft_in` (the first GPU run, on jax 0.11.2, failed `ox.fit` with
    `KeyError: 'num_consts'`)."""
    from offload_eqx._base.primitives import scan_consts_and_carry

    w = jnp.ones(3)
    closed = jax.make_jaxpr(lambda c, xs: jax.lax.scan(lambda c, x: (c * w + x, x), c, xs))(
        jnp.ones(3), jnp.ones((4, 3))
    )
    (scan,) = [e for e in closed.jaxpr.eqns if e.primitive.name == "scan"]
    assert scan_consts_and_carry(scan.params) == (1, 1)

    class Packed:  # jax 0.11's flat tree of (constants, carry, scanned inputs)
        def unpack(self):
            return (["w", "b"], ["c"], ["x1", "x2"])

    assert scan_consts_and_carry({"ft_in": Packed(), "length": 4}) == (2, 1)
