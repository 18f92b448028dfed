"""Models written the way Equinox users write them, for the real-client suite
(`tests/test_real_models.py`).

Each model is plain Equinox (`eqx.nn` layers, Python lists of blocks, `jax.vmap` over
examples, `eqx.nn.Dropout` with typed keys, `eqx.nn.State`), with the few offload_eqx
touches a user would add: an `ox.annotate` from outside on modules they cannot edit, an
`ox.field` on a module they wrote, an `ox.checkpoint` around a block call, an `ox.name`
on a value and an `ox.activations` declaring its policy. All of them are small: the
suite compiles every model under every strategy on a 2-core CPU.

A `Case` bundles a model with its loss and inputs so that one training step serves
every model:

    (loss, state), grads = eqx.filter_value_and_grad(case.loss, has_aux=True)(
        trainable, frozen, state, batch, key
    )

`state` is the `eqx.nn.State` of a model with `BatchNorm` (`None` otherwise); `key` is a
typed PRNG key (`jax.random.key`) for models with dropout (`None` otherwise); `frozen`
is what `case.filter_spec` leaves out of training (the Equinox FAQ's way of freezing).
"""

import dataclasses
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jaxtyping import Array, BFloat16, Float, Int, PRNGKeyArray

import offload_eqx as ox

# -- 1. An unmodified eqx.nn.MLP, one layer annotated into host memory from outside. ----


def mlp(key: PRNGKeyArray) -> eqx.nn.MLP:
    """`eqx.nn.MLP(8 -> 16 -> 16 -> 4)`; its middle layer lives in pinned_host. The model
    is called as `mlp(x)`, with no `ox.checkpoint` anywhere: the annotated layer brings
    its own region (renovation issue 9, item 4)."""
    model = eqx.nn.MLP(8, 4, width_size=16, depth=2, key=key)
    return ox.annotate(model, lambda m: m.layers[1], memory="pinned_host")


def mlp_loss(model: eqx.nn.MLP, state: None, x: Float[Array, "batch 8"], key: None):
    return jnp.mean(jax.vmap(model)(x) ** 2), state


def mlp_batch(key: PRNGKeyArray) -> Float[Array, "4 8"]:
    return jax.random.normal(key, (4, 8))


# -- 2. A BERT-like encoder: a Python list of blocks, dropout with typed keys. -----------


class EncoderBlock(eqx.Module):
    """Post-norm transformer encoder block, written with `eqx.nn` only. Its output is
    named "block_output" (a block's output, the next block's input)."""

    attention: eqx.nn.MultiheadAttention
    norm1: eqx.nn.LayerNorm
    norm2: eqx.nn.LayerNorm
    up: eqx.nn.Linear
    down: eqx.nn.Linear
    dropout: eqx.nn.Dropout

    def __init__(self, width: int, heads: int, hidden: int, *, key: PRNGKeyArray):
        k_attention, k_up, k_down = jax.random.split(key, 3)
        self.attention = eqx.nn.MultiheadAttention(heads, width, key=k_attention)
        self.norm1 = eqx.nn.LayerNorm(width)
        self.norm2 = eqx.nn.LayerNorm(width)
        self.up = eqx.nn.Linear(width, hidden, key=k_up)
        self.down = eqx.nn.Linear(hidden, width, key=k_down)
        self.dropout = eqx.nn.Dropout(p=0.1)

    def __call__(
        self, x: Float[Array, "seq width"], *, key: PRNGKeyArray
    ) -> Float[Array, "seq width"]:
        k_attention, k_mlp = jax.random.split(key)
        h = self.attention(x, x, x)
        x = jax.vmap(self.norm1)(x + self.dropout(h, key=k_attention))
        h = jax.vmap(self.down)(jax.nn.gelu(jax.vmap(self.up)(x)))
        x = jax.vmap(self.norm2)(x + self.dropout(h, key=k_mlp))
        return ox.name(x, "block_output")


class Encoder(eqx.Module):
    """Token embedding, a Python list of blocks each called through `ox.checkpoint`, mean
    pooling and a classifier head. Per example: the step `jax.vmap`s it over the batch."""

    embedding: eqx.nn.Embedding
    position: Float[Array, "seq width"]
    head: eqx.nn.Linear
    blocks: list[EncoderBlock] = ox.field(memory="device")  # offloaded by offload_params
    activations: ox.Activations = ox.activations(block_output="offload")

    def __init__(self, vocab=32, seq=8, width=16, heads=2, hidden=32, depth=2, classes=3, *, key):
        k_embed, k_position, k_head, *k_blocks = jax.random.split(key, 3 + depth)
        self.embedding = eqx.nn.Embedding(vocab, width, key=k_embed)
        self.position = 0.02 * jax.random.normal(k_position, (seq, width))
        self.blocks = [EncoderBlock(width, heads, hidden, key=k) for k in k_blocks]
        self.head = eqx.nn.Linear(width, classes, key=k_head)

    def __call__(
        self, tokens: Int[Array, " seq"], *, key: PRNGKeyArray
    ) -> Float[Array, " classes"]:
        x = jax.vmap(self.embedding)(tokens) + self.position
        for block, block_key in zip(self.blocks, jax.random.split(key, len(self.blocks))):
            x = ox.checkpoint(block, x, key=block_key)
        return self.head(jnp.mean(x, axis=0))


def encoder(key: PRNGKeyArray) -> Encoder:
    return Encoder(key=key)


def encoder_loss(model: Encoder, state: None, batch: tuple, key: PRNGKeyArray):
    tokens, labels = batch
    logits = jax.vmap(model)(tokens, key=jax.random.split(key, tokens.shape[0]))
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean(), state


def encoder_batch(key: PRNGKeyArray) -> tuple[Int[Array, "4 8"], Int[Array, " 4"]]:
    k_tokens, k_labels = jax.random.split(key)
    return jax.random.randint(k_tokens, (4, 8), 0, 32), jax.random.randint(k_labels, (4,), 0, 3)


# -- 3. A ViT: Conv2d patches under jax.vmap, blocks annotated into host memory. ---------


class ViTBlock(eqx.Module):
    """Pre-norm block; names the MLP's hidden pre-activation "mlp_hidden"."""

    norm1: eqx.nn.LayerNorm
    attention: eqx.nn.MultiheadAttention
    norm2: eqx.nn.LayerNorm
    up: eqx.nn.Linear
    down: eqx.nn.Linear

    def __init__(self, width: int, heads: int, hidden: int, *, key: PRNGKeyArray):
        k_attention, k_up, k_down = jax.random.split(key, 3)
        self.norm1 = eqx.nn.LayerNorm(width)
        self.attention = eqx.nn.MultiheadAttention(heads, width, key=k_attention)
        self.norm2 = eqx.nn.LayerNorm(width)
        self.up = eqx.nn.Linear(width, hidden, key=k_up)
        self.down = eqx.nn.Linear(hidden, width, key=k_down)

    def __call__(self, x: Float[Array, "tokens width"]) -> Float[Array, "tokens width"]:
        h = jax.vmap(self.norm1)(x)
        x = x + self.attention(h, h, h)
        h = ox.name(jax.vmap(self.up)(jax.vmap(self.norm2)(x)), "mlp_hidden")
        return x + jax.vmap(self.down)(jax.nn.gelu(h))


class ViT(eqx.Module):
    patches: eqx.nn.Conv2d
    position: Float[Array, "tokens width"]
    blocks: list[ViTBlock]
    norm: eqx.nn.LayerNorm
    head: eqx.nn.Linear

    def __init__(self, channels=3, size=8, patch=4, width=16, heads=2, hidden=32, depth=1,
                 classes=5, *, key):  # fmt: skip
        k_patches, k_position, k_head, *k_blocks = jax.random.split(key, 3 + depth)
        tokens = (size // patch) ** 2
        self.patches = eqx.nn.Conv2d(channels, width, patch, stride=patch, key=k_patches)
        self.position = 0.02 * jax.random.normal(k_position, (tokens, width))
        self.blocks = [ViTBlock(width, heads, hidden, key=k) for k in k_blocks]
        self.norm = eqx.nn.LayerNorm(width)
        self.head = eqx.nn.Linear(width, classes, key=k_head)

    def __call__(self, image: Float[Array, "channels height width"]) -> Float[Array, " classes"]:
        x = self.patches(image)  # (width, height / patch, width / patch)
        x = x.reshape(x.shape[0], -1).T + self.position
        for block in self.blocks:
            x = block(x)  # annotated: the block brings its own region
        return self.head(self.norm(jnp.mean(x, axis=0)))


def vit(key: PRNGKeyArray) -> ViT:
    model = ViT(key=key)
    model = ox.annotate(model, lambda m: m.blocks, memory="pinned_host")
    return ox.annotate(model, lambda m: m, activations={"mlp_hidden": "offload"})


def vit_loss(model: ViT, state: None, batch: tuple, key: None):
    images, labels = batch
    logits = jax.vmap(model)(images)
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean(), state


def vit_batch(key: PRNGKeyArray) -> tuple[Float[Array, "2 3 8 8"], Int[Array, " 2"]]:
    k_images, k_labels = jax.random.split(key)
    return jax.random.normal(k_images, (2, 3, 8, 8)), jax.random.randint(k_labels, (2,), 0, 5)


# -- 4. BatchNorm with eqx.nn.State, threaded through the step. ---------------------------


class BatchNormNet(eqx.Module):
    first: eqx.nn.Linear
    norm: eqx.nn.BatchNorm
    second: eqx.nn.Linear

    def __init__(self, *, key: PRNGKeyArray):
        k_first, k_second = jax.random.split(key)
        self.first = eqx.nn.Linear(8, 16, key=k_first)
        self.norm = eqx.nn.BatchNorm(16, axis_name="batch", mode="ema")
        self.second = eqx.nn.Linear(16, 4, key=k_second)

    def __call__(self, x: Float[Array, " 8"], state: eqx.nn.State):
        x, state = self.norm(self.first(x), state)
        return self.second(jax.nn.relu(x)), state


def batch_norm_net(key: PRNGKeyArray) -> tuple[BatchNormNet, eqx.nn.State]:
    model, state = eqx.nn.make_with_state(BatchNormNet)(key=key)
    return ox.annotate(model, lambda m: m.second, memory="pinned_host"), state


def batch_norm_loss(
    model: BatchNormNet, state: eqx.nn.State, x: Float[Array, "batch 8"], key: None
):
    batched = jax.vmap(model, axis_name="batch", in_axes=(0, None), out_axes=(0, None))
    y, state = batched(x, state)
    return jnp.mean(y**2), state


# -- 5. Odd leaves: int, bool, str, callable, static, frozen and bfloat16 leaves. --------


class OddLeaves(eqx.Module):
    """Every kind of leaf an Equinox model carries besides float32 weights. Its own
    `__call__` uses its host-resident `weight` (no sub-module, no region written)."""

    frozen: Float[Array, "5 8"]  # left out of training by the filter spec
    index: Int[Array, " 4"]  # an int32 array leaf: not differentiable
    bias: Float[Array, " 8"]
    repeats: int  # a Python int leaf (static under filter_jit)
    use_bias: bool
    label: str
    activation: Callable[[Array], Array]
    size: int = eqx.field(static=True)  # before the ox.fields: type checkers read them as defaults
    weight: Float[Array, "8 8"] = ox.field(memory="pinned_host")
    half: BFloat16[Array, "8 8"] = ox.field(memory="device")  # offloaded by offload_params

    def __call__(self, x: Float[Array, "4 8"]) -> Float[Array, "4 8"]:
        h = self.activation(x @ self.weight)
        h = (h.astype(jnp.bfloat16) @ self.half).astype(jnp.float32)
        h = h + self.frozen[self.index]
        for _ in range(self.repeats):
            h = jnp.tanh(h)
        if self.use_bias:
            h = h + self.bias
        return h if self.label == "odd" else -h


def odd_leaves(key: PRNGKeyArray) -> OddLeaves:
    k_weight, k_half, k_frozen = jax.random.split(key, 3)
    return OddLeaves(
        size=8,
        weight=jax.random.normal(k_weight, (8, 8)) / np.sqrt(8),
        half=(jax.random.normal(k_half, (8, 8)) / np.sqrt(8)).astype(jnp.bfloat16),
        frozen=jax.random.normal(k_frozen, (5, 8)),
        index=jnp.array([0, 2, 4, 1], dtype=jnp.int32),
        bias=jnp.full((8,), 0.1),
        repeats=2,
        use_bias=True,
        label="odd",
        activation=jax.nn.gelu,
    )


def odd_leaves_spec(model: OddLeaves) -> Any:
    """Train every floating leaf but `frozen` (the Equinox FAQ's freezing recipe)."""
    spec = jax.tree_util.tree_map(eqx.is_inexact_array, model)
    return eqx.tree_at(lambda m: m.frozen, spec, replace=False)


def odd_leaves_loss(model: OddLeaves, state: None, x: Float[Array, "4 8"], key: None):
    return jnp.mean(model(x) ** 2), state


def odd_leaves_batch(key: PRNGKeyArray) -> Float[Array, "4 8"]:
    return jax.random.normal(key, (4, 8))


# -- The cases. ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Case:
    """A model, its loss, a batch and what to train. `build(key)` returns the model, or
    `(model, state)` for a model with `eqx.nn.State`."""

    build: Callable[[PRNGKeyArray], Any]
    loss: Callable[..., tuple[Array, Any]]
    batch: Callable[[PRNGKeyArray], Any]
    dropout: bool = False  # the step takes a typed key
    filter_spec: Callable[[Any], Any] = lambda model: eqx.is_inexact_array
    # float32 results agree within this (relative to their scale); bfloat16 compute
    # rounds at 2**-8, and a rematerialised program rounds where it recomputes.
    rtol: float = 1e-6

    def make(self, key: PRNGKeyArray) -> tuple[Any, Any]:
        built = self.build(key)
        return built if isinstance(built, tuple) else (built, None)


CASES: dict[str, Case] = {
    "mlp": Case(mlp, mlp_loss, mlp_batch),
    "encoder": Case(encoder, encoder_loss, encoder_batch, dropout=True),
    "vit": Case(vit, vit_loss, vit_batch),
    "batch_norm": Case(batch_norm_net, batch_norm_loss, mlp_batch),
    "odd_leaves": Case(odd_leaves, odd_leaves_loss, odd_leaves_batch, filter_spec=odd_leaves_spec),
}


def optax_wrappers() -> dict[str, Any]:
    """The optax wrappers a user reaches for, each a fresh instance."""

    def matrices(params):
        return jax.tree_util.tree_map(lambda x: x.ndim > 1, params)

    def labels(params):
        return jax.tree_util.tree_map(lambda x: "matrix" if x.ndim > 1 else "vector", params)

    return {
        "chain_clip_adamw": optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2)),
        "adamw_mask": optax.adamw(1e-2, weight_decay=1e-2, mask=matrices),
        "inject_hyperparams": optax.inject_hyperparams(optax.adam)(learning_rate=1e-2),
        "multi_steps": optax.MultiSteps(optax.adam(1e-2), every_k_schedule=2),
        "multi_transform": optax.multi_transform(
            {"matrix": optax.adam(1e-2), "vector": optax.sgd(1e-2)}, labels
        ),
        "apply_if_finite": optax.apply_if_finite(optax.adam(1e-2), max_consecutive_errors=3),
    }
