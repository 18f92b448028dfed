"""Models shared by the tests: each is written once, with offload_eqx annotations, and
run under every strategy."""

from collections.abc import Callable
from typing import Any, cast

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec
from jaxtyping import Array, Float

import offload_eqx as ox

# -- 1. The seed workload: a scanned stack of two matmuls, activation "x" named. -------


class SeedLayer(eqx.Module):
    """One layer of the seed workload, `(x @ w1) @ w2`, naming its input "x"."""

    w1: Float[Array, "layers width hidden"] = ox.field(memory="pinned_host")
    w2: Float[Array, "layers hidden width"] = ox.field(memory="pinned_host")

    def __call__(self, x):
        x = ox.name(x, "x")
        return (x @ self.w1) @ self.w2


class Layer(SeedLayer):
    """The seed layer with a tanh between the matmuls (trained in the equivalence tests)."""

    def __call__(self, x):
        x = ox.name(x, "x")
        return jnp.tanh(x @ self.w1) @ self.w2


class ScannedModel(eqx.Module):
    layers: SeedLayer  # stacked: every leaf has the layer axis first
    activations: ox.Activations = ox.activations(x="offload")

    def __call__(self, x):
        return ox.scan(self.layers, x)


def seed_model(
    layers: int = 10,
    width: int = 256,
    hidden: int = 1024,
    *,
    abstract: bool = True,
    memory: str = "pinned_host",
    spec: PartitionSpec | None = None,
    sharding: jax.sharding.Sharding | None = None,
) -> ScannedModel:
    """The seed workload (float32): w1 `layers x width x hidden`, w2 `layers x hidden x width`.

    `abstract`: `ShapeDtypeStruct`s (with `sharding`, if given) rather than zeros. The weights
    are in `memory` with `spec` (an `ox.annotate` of the layers, unless the defaults).
    """
    shapes = (layers, width, hidden), (layers, hidden, width)
    w1: Any  # a ShapeDtypeStruct stands for an array of its shape: nothing is allocated
    w2: Any
    if abstract:
        w1, w2 = (jax.ShapeDtypeStruct(s, jnp.float32, sharding=sharding) for s in shapes)
    else:
        w1, w2 = (jnp.zeros(s, jnp.float32) for s in shapes)
    model = ScannedModel(layers=SeedLayer(w1=w1, w2=w2))
    if memory != "pinned_host" or spec is not None:
        model = ox.annotate(model, lambda m: m.layers, memory=memory, spec=spec)
    return model


def scanned_model(key, depth=3, width=16, hidden=32) -> ScannedModel:
    """The seed workload with the tanh layer and random weights."""
    k1, k2 = jax.random.split(key)
    w1 = jax.random.normal(k1, (depth, width, hidden)) / np.sqrt(width)
    w2 = jax.random.normal(k2, (depth, hidden, width)) / np.sqrt(hidden)
    return ScannedModel(layers=Layer(w1=w1, w2=w2))


# -- 2. A Python loop of `ox.checkpoint`ed blocks. --------------------------------------


class Block(eqx.Module):
    weight: jax.Array = ox.field(memory="pinned_host")
    bias: jax.Array = ox.field(memory="device")
    activations: ox.Activations = ox.activations(h="save")

    def __call__(self, x):
        h = ox.name(x @ self.weight + self.bias, "h")
        return x + jax.nn.gelu(h)


class LoopModel(eqx.Module):
    blocks: list[Block]
    head: jax.Array  # not managed: stays on the device under every strategy

    def __call__(self, x):
        for block in self.blocks:
            x = ox.checkpoint(block, x)
        return x @ self.head


def loop_model(key, depth=3, width=16) -> LoopModel:
    keys = jax.random.split(key, depth + 1)
    blocks = [
        Block(
            weight=jax.random.normal(k, (width, width)) / np.sqrt(width),
            bias=jnp.full((width,), 0.1),
        )
        for k in keys[:-1]
    ]
    return LoopModel(blocks=blocks, head=jax.random.normal(keys[-1], (width, 4)))


# -- 3. An attention block naming q, k, v. ----------------------------------------------


class Attention(eqx.Module):
    heads: int = eqx.field(
        static=True
    )  # before ox.field(...)s: type checkers read those as defaults
    wq: jax.Array = ox.field(memory="pinned_host")
    wk: jax.Array = ox.field(memory="pinned_host")
    wv: jax.Array = ox.field(memory="pinned_host")
    wo: jax.Array = ox.field(memory="device")

    def __call__(self, x):
        seq, width = x.shape
        split = lambda t: t.reshape(seq, self.heads, width // self.heads)  # noqa: E731
        q = split(ox.name(x @ self.wq, "q"))
        k = split(ox.name(x @ self.wk, "k"))
        v = split(ox.name(x @ self.wv, "v"))
        scores = jnp.einsum("qhd,khd->hqk", q, k) / np.sqrt(width // self.heads)
        mask = jnp.tril(jnp.ones((seq, seq), dtype=bool))
        scores = jnp.where(mask, scores, -1e9)
        out = jnp.einsum("hqk,khd->qhd", jax.nn.softmax(scores, axis=-1), v)
        return x + out.reshape(seq, width) @ self.wo


class AttentionModel(eqx.Module):
    layers: Attention
    activations: ox.Activations = ox.activations(q="offload", k="offload", v="remat")

    def __call__(self, x):
        return ox.scan(self.layers, x)


def attention_model(key, depth=2, width=16, heads=2) -> AttentionModel:
    def make(k):
        ks = jax.random.split(k, 4)
        w = [jax.random.normal(ki, (width, width)) / np.sqrt(width) for ki in ks]
        return Attention(wq=w[0], wk=w[1], wv=w[2], wo=w[3], heads=heads)

    return AttentionModel(layers=eqx.filter_vmap(make)(jax.random.split(key, depth)))


# -- 4. eqx.nn layers that we cannot edit, annotated from outside. ----------------------


class Hidden(eqx.Module):
    """Glue written by the user around a layer it cannot edit: names the layer's output."""

    layer: eqx.nn.Linear

    def __call__(self, x):
        return jax.nn.relu(ox.name(self.layer(x), "hidden"))


class NNModel(eqx.Module):
    mlp: eqx.nn.MLP
    norm: eqx.nn.LayerNorm

    def __call__(self, x):
        def row(x):
            x = self.norm(x)
            for layer in self.mlp.layers[:-1]:
                x = ox.checkpoint(Hidden(layer), x)
            return self.mlp.layers[-1](x)

        return jax.vmap(row)(x)


def nn_model(key, width=16) -> NNModel:
    mlp = eqx.nn.MLP(width, 4, width_size=32, depth=3, key=key)
    model = NNModel(mlp=mlp, norm=eqx.nn.LayerNorm(width))
    model = ox.annotate(model, lambda m: m.mlp.layers[:-1], memory="pinned_host")
    model = ox.annotate(model, lambda m: m, activations={"hidden": "offload"})
    return model


# -- The training step shared by every model. ------------------------------------------

MODELS: dict[str, Callable[[Any], eqx.Module]] = {
    "scanned": scanned_model,
    "loop": loop_model,
    "attention": attention_model,
    "eqx_nn": nn_model,
}
INPUT_SHAPES = {"scanned": (8, 16), "loop": (8, 16), "attention": (8, 16), "eqx_nn": (8, 16)}


class HostSquare(eqx.Module):
    """One layer `tanh(x @ w)` with its weight in host memory and its input named `x`."""

    w: jax.Array = ox.field(memory="pinned_host")

    def __call__(self, x):
        return jnp.tanh(ox.name(x, "x") @ self.w)


class HostStack(eqx.Module):
    """Stacked `HostSquare` layers run by `ox.scan`, `x` recomputed."""

    layers: HostSquare
    activations: ox.Activations = ox.activations(x="remat")

    def __call__(self, x):
        return ox.scan(self.layers, x)


def loss_fn(model, x):
    return jnp.mean(model(x) ** 2)


def make_optimizer() -> optax.GradientTransformation:
    return ox.offload_optimizer(optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2)))


def make_step(opt, strategy, **jit_kwargs):
    @ox.filter_jit(strategy=strategy, **jit_kwargs)
    def step(model, opt_state, x):
        loss, grads = eqx.filter_value_and_grad(loss_fn)(model, x)
        updates, opt_state = opt.update(grads, opt_state, model)
        return ox.apply_updates(model, updates), opt_state, loss

    return step


def to_numpy(tree):
    """Host numpy copies of every array leaf (for comparisons)."""
    return jax.tree_util.tree_map(np.asarray, eqx.filter(tree, eqx.is_array))


def assert_close_to_scale(ours, reference) -> None:
    """Every array leaf within 1e-6 of the reference leaf's scale: a host update rounds
    differently (an element near zero of a layer of scale 0.4 was 1.1e-7 off on one
    machine, against 1e-7 allowed absolutely), and a wrong update moves a parameter by
    about the learning rate, 1e-2."""
    for (path, a), b in zip(
        jax.tree_util.tree_leaves_with_path(to_numpy(ours)),
        jax.tree_util.tree_leaves(to_numpy(reference)),
    ):
        scale = float(np.max(np.abs(b), initial=0.0))
        np.testing.assert_allclose(
            a, b, rtol=1e-6, atol=1e-6 * scale, err_msg=jax.tree_util.keystr(path)
        )


def rotated(
    cases: Any,
    strategies: Any,
    kept: tuple[str, ...],
    case_id: Callable[[Any], str] = str,
    group: str | None = None,
    turn: bool = True,
) -> list:
    """`(case, strategy)` parameters for every case under every strategy. Without `--full`
    each case runs under the `kept` strategies and one of the others in turn (the rest are
    marked `full`), so every strategy still meets cases in the default run; with
    `turn=False`, under the `kept` strategies only. With `group`, a case's strategies
    share one pytest-xdist worker (`--dist loadgroup`), so what the test caches per case
    (a reference run) is computed once."""
    others = [s for s in strategies if s not in kept] if turn else []
    params = []
    for i, case in enumerate(cases):
        marks = [pytest.mark.xdist_group(f"{group}:{case_id(case)}")] if group else []
        for strategy in strategies:
            default = strategy in kept or (others and strategy == others[i % len(others)])
            params.append(
                pytest.param(
                    case,
                    strategy,
                    marks=marks if default else [*marks, pytest.mark.full],
                    id=f"{case_id(case)}-{strategy}",
                )
            )
    return params


# -- float32 masters for a bfloat16 model, from the definition -----------------------------


def to_bf16(tree):
    """Every floating-point array leaf of `tree` in bfloat16."""
    return jax.tree_util.tree_map(
        lambda x: x.astype(jnp.bfloat16) if eqx.is_inexact_array(x) else x, tree
    )


def masters_reference(
    model32, loss, x, tx, steps: int, delay: bool = False, grad=None, jit: bool = False
):
    """Plain JAX + optax: float32 masters, the bfloat16 model cast from them, `tx` on the
    masters (updates in float32), `delay`: each step applies the previous step's
    gradients, the last ones applied at the end. Returns the masters. `grad(model, x)`:
    the gradients (`jax.grad(loss)` by default). `jit`: each update one `jax.jit` (XLA
    compiles it as one program, rounding as it does in a step), else run op by op."""
    grad = jax.grad(loss) if grad is None else grad
    masters = eqx.filter(model32, eqx.is_array)
    state, pending = tx.init(masters), None

    def update(grads, state, masters):
        updates, state = tx.update(grads, state, masters)
        return optax.apply_updates(masters, updates), state

    update = jax.jit(update) if jit else update
    for _ in range(steps):
        model = to_bf16(eqx.combine(masters, model32))
        grads = eqx.filter(grad(model, x), eqx.is_array)
        grads = jax.tree_util.tree_map(lambda g: g.astype(jnp.float32), grads)
        if delay:
            grads, pending = pending, grads
            if grads is None:
                continue
        masters, state = update(grads, state, masters)
    if pending is not None:
        masters, state = update(pending, state, masters)
    return masters


def splash_step(heads: int, length: int, block: int) -> Callable:
    """Gradients of causal splash attention (Pallas, TPU targets) over q, k, v of
    (batch, heads, length, head_dim), in blocks of `block` a side."""
    from jax.experimental.pallas.ops.tpu.splash_attention import (
        splash_attention_kernel as splash,
        splash_attention_mask as masks,
    )

    mask = masks.MultiHeadMask([masks.CausalMask((length, length)) for _ in range(heads)])
    sizes = splash.BlockSizes(
        block_q=block, block_kv=block, block_kv_compute=block, block_q_dkv=block,
        block_kv_dkv=block, block_kv_dkv_compute=block, block_q_dq=block, block_kv_dq=block,
    )  # fmt: skip
    kernel = splash.make_splash_mha(mask, head_shards=1, q_seq_shards=1, block_sizes=sizes)

    def step(q, k, v):
        def loss(q, k, v):
            out = cast(jax.Array, jax.vmap(kernel)(q, k, v))
            return out.astype(jnp.float32).sum()

        return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

    return step


try:  # JAX's host-computation transform: `compute_on2` in jax 0.10, `compute_on` from 0.11
    from jax.experimental.compute_on import compute_on2 as _compute_on
except ImportError:
    from jax.experimental.compute_on import compute_on as _compute_on  # type: ignore
_compute_on: Any = _compute_on


def computed_on_host(f: Callable, out: Any = jax.memory.Space.Device) -> Callable:
    """`f` as one host computation (JAX's `compute_on` transform, `device_host`), its
    results in memory `out` (device memory unless told)."""
    return _compute_on(f, compute_type="device_host", out_memory_spaces=out)
