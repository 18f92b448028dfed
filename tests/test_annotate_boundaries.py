"""Activations of code you did not write: `ox.annotate(model, where, inputs=..., outputs=...)`
names the input or output of modules selected from outside (a library's blocks), so that
a policy offloads, saves or recomputes it, and the audit names the module it belongs to.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest
from real_model_families import next_token_loss
from third_party_families import LlamaDecoder

import offload_eqx as ox

_KEY = jax.random.key(0)
_TOKENS = jax.random.randint(jax.random.key(1), (2, 8), 0, 32)


def _loss(model, tokens):
    return next_token_loss(model, None, tokens, None)[0]


_GRADS = eqx.filter_grad(_loss)


def _decoder(**annotation) -> LlamaDecoder:
    return ox.annotate(LlamaDecoder(key=_KEY), lambda m: m.blocks, **annotation)


def _activation_rows(report, name):
    return [t for t in report.transfers if t.kind == "activation" and t.what == name]


def _assert_same(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        assert jnp.allclose(jax.device_get(x), jax.device_get(y), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("memory", [None, "pinned_host"])
def test_block_inputs_of_a_library_model_are_offloaded_by_path(memory):
    """The LLaMA-style decoder's blocks (a list, called in a Python loop, each returning
    `(x, cache)`, under `jax.vmap` of the whole model) unmodified: each block's input
    goes to the host in the forward pass and comes back in the backward pass, one row
    per block, named by the block's path; the gradients are those of plain Equinox."""
    model = _decoder(memory=memory, inputs="x_in", activations={"x_in": "offload"})
    report = ox.audit(ox.filter_jit(_GRADS), model, _TOKENS)
    rows = _activation_rows(report, "x_in")
    where = {(t.direction, t.where) for t in rows}
    assert where == {
        ("device-to-host", "model.blocks[0]"),
        ("device-to-host", "model.blocks[1]"),
        ("host-to-device", "model.blocks[0] > remat"),
        ("host-to-device", "model.blocks[1] > remat"),
    }
    assert all(t.shape == (2, 8, 16) and t.phase != "call" for t in rows)
    assert report.total("d2h", "x_in") == report.total("h2d", "x_in") == 2 * 2 * 8 * 16 * 4
    expected = eqx.filter_jit(_GRADS)(LlamaDecoder(key=_KEY), _TOKENS)
    _assert_same(ox.filter_jit(_GRADS)(model, _TOKENS), expected)


def test_block_outputs_are_offloaded_where_the_next_block_takes_them():
    """A name given to each block's output applies where the next block's region takes
    it (a region's output is not its own residual): the last block's output goes to the
    final norm outside any region, and stays."""
    model = _decoder(outputs="x_out", activations={"x_out": "offload"})
    report = ox.audit(ox.filter_jit(_GRADS), model, _TOKENS)
    assert {t.where for t in _activation_rows(report, "x_out") if t.direction.startswith("d")} == {
        "model.blocks[1]"
    }
    _assert_same(
        ox.filter_jit(_GRADS)(model, _TOKENS),
        eqx.filter_jit(_GRADS)(LlamaDecoder(key=_KEY), _TOKENS),
    )


@pytest.mark.parametrize(
    ("strategy", "moved"),
    [
        ("annotated", True),
        ("remat", False),
        ("baseline", False),
        ("offload_activations", True),
        (ox.Strategy("keep", names={"x_in": "save"}), False),
        (ox.Strategy("split", names={"x_in": ("save", 1, "offload")}), True),
    ],
)
def test_strategies_switch_the_declared_inputs(strategy, moved):
    """The name is a name like any other: the strategy decides its policy."""
    model = _decoder(inputs="x_in", activations={"x_in": "offload"})
    report = ox.audit(ox.filter_jit(_GRADS, strategy=strategy), model, _TOKENS)
    assert bool(report.total("d2h", "x_in")) is moved


class _Layer(eqx.Module):
    linear: eqx.nn.Linear

    def __call__(self, x):
        return x + jnp.tanh(self.linear(x))


class _Stack(eqx.Module):
    layers: _Layer

    def __call__(self, x):
        return ox.scan(self.layers, x)


def _stack(width: int = 8, depth: int = 4) -> _Stack:
    make = lambda k: _Layer(eqx.nn.Linear(width, width, key=k))  # noqa: E731
    return _Stack(eqx.filter_vmap(make)(jax.random.split(_KEY, depth)))


def test_a_stacked_block_names_its_carry_inside_the_scan():
    """Under `ox.scan` the annotated layer runs inside the scan's region: its input (the
    carry) is named there, once per layer."""
    model = ox.annotate(
        _stack(), lambda m: m.layers, inputs="carry", activations={"carry": "offload"}
    )
    x = jnp.ones((8,))
    grads = eqx.filter_grad(lambda m, x: jnp.sum(m(x) ** 2))
    report = ox.audit(ox.filter_jit(grads), model, x)
    offloaded = [t for t in _activation_rows(report, "carry") if t.direction == "device-to-host"]
    assert sum(t.count for t in offloaded) == 4
    _assert_same(ox.filter_jit(grads)(model, x), eqx.filter_jit(grads)(_stack(), x))


@pytest.mark.deviceless
def test_offloaded_layer_inputs_leave_the_h100s_memory():
    """Compiled for an H100: the scanned layers' inputs offloaded take device memory off
    the step, and as much lands in host memory."""
    model = _stack(width=512, depth=6)
    x = jax.ShapeDtypeStruct((1024, 512), jnp.float32)
    grads = eqx.filter_grad(lambda m, x: jnp.mean(jax.vmap(m)(x) ** 2))
    reports = {
        policy: ox.memory_report(
            ox.filter_jit(grads),
            ox.annotate(model, lambda m: m.layers, inputs="carry", activations={"carry": policy}),
            x,
            target="h100",
        )
        for policy in ("save", "offload")
    }
    layer_inputs = 6 * 1024 * 512 * 4
    assert reports["offload"].host["temp"] >= layer_inputs - 1024 * 512 * 4
    assert reports["save"].device["temp"] - reports["offload"].device["temp"] >= layer_inputs / 2


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"inputs": ""}, "ox.annotate(inputs=...) was given the activation name ''"),
        ({"outputs": ""}, "ox.annotate(outputs=...) was given the activation name ''"),
        ({}, "none of `memory=`, `activations=`, `inputs=` or `outputs=`"),
    ],
)
def test_bad_boundary_names_are_refused_before_any_work(kwargs, message):
    model = LlamaDecoder(key=_KEY)
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        ox.annotate(model, lambda m: m.blocks, **kwargs)


def test_boundary_names_on_a_field_are_refused():
    with pytest.raises(ValueError, match=r"inputs and outputs are declared on modules"):
        ox.annotate(LlamaDecoder(key=_KEY), lambda m: m.blocks[0].wq.weight, inputs="x")


def test_integer_inputs_are_not_named():
    """Tokens are not activations: the embedding's declared input name is never produced,
    which is the error every unproduced name gets, not a silent no-op."""
    model = ox.annotate(
        LlamaDecoder(key=_KEY),
        lambda m: m.embedding,
        inputs="tokens",
        activations={"tokens": "offload"},
    )
    with pytest.raises(ValueError, match=r"'tokens' is declared 'offload'.*never produces it"):
        ox.filter_jit(_GRADS)(model, _TOKENS)
