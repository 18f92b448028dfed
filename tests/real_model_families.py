"""More model families written the way Equinox users write them (renovation issue 17,
"Equinox as users write it, round two"), for `tests/test_real_models.py`. Same `Case` and
conventions as `tests/real_models.py`: plain `eqx.nn` layers, nothing reshaped for
offload_eqx, the touches a user adds (`ox.annotate` from outside, `ox.name` and a declared
policy), all tiny. The numbered sections follow the issue's list of families; section 9
(annotating a whole `eqx.nn.MLP` field, a `BatchNorm`, a `Shared`, a list field) is
spread over four cases. `FAMILY_NAMES` and `FAMILY_OPTIMIZERS` complete the cases.
"""

from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from jaxtyping import Array, Float, Int, PRNGKeyArray
from real_models import BatchNormNet, Case, batch_norm_loss, mlp_batch, mlp_loss

import offload_eqx as ox


def tokens_batch(key: PRNGKeyArray) -> Int[Array, "4 8"]:
    return jax.random.randint(key, (4, 8), 0, 32)


def next_token_loss(model: Callable, state: None, tokens: Int[Array, "batch seq"], key: None):
    logits = jax.vmap(model)(tokens)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], tokens[:, 1:])
    return loss.mean(), state


def classify_loss(model: Callable, state: None, batch: tuple, key: None):
    inputs, labels = batch
    logits = jax.vmap(model)(inputs)
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean(), state


def regression_loss(model: Callable, state: None, batch: tuple, key: None):
    inputs, targets = batch
    return jnp.mean((jax.vmap(model)(inputs) - targets) ** 2), state


def _classes(key: PRNGKeyArray, shape: tuple[int, ...], classes: int) -> tuple:
    """Inputs of `shape`, and one integer label per example."""
    k_inputs, k_labels = jax.random.split(key)
    return jax.random.normal(k_inputs, shape), jax.random.randint(k_labels, shape[:1], 0, classes)


def _targets(key: PRNGKeyArray, inputs: tuple[int, ...], targets: tuple[int, ...]) -> tuple:
    k_inputs, k_targets = jax.random.split(key)
    return jax.random.normal(k_inputs, inputs), jax.random.normal(k_targets, targets)


# -- 1. A GPT: filter_vmap'd blocks under a plain jax.lax.scan. ---------------------------


class GPTBlock(eqx.Module):
    """Pre-norm causal block; names the MLP's hidden pre-activation "gpt_hidden"."""

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

    def __call__(self, x: Float[Array, "seq width"]) -> Float[Array, "seq width"]:
        mask = jnp.tril(jnp.ones((x.shape[0], x.shape[0]), dtype=bool))
        h = jax.vmap(self.norm1)(x)
        x = x + self.attention(h, h, h, mask=mask)
        h = ox.name(jax.vmap(self.up)(jax.vmap(self.norm2)(x)), "gpt_hidden")
        return x + jax.vmap(self.down)(jax.nn.gelu(h))


class GPT(eqx.Module):
    embedding: eqx.nn.Embedding
    position: eqx.nn.Embedding
    blocks: GPTBlock  # stacked: every leaf has a leading block axis
    norm: eqx.nn.LayerNorm
    head: eqx.nn.Linear

    def __init__(self, vocab=32, seq=8, width=16, heads=2, hidden=32, depth=2, *, key):
        k_embed, k_position, k_blocks, k_head = jax.random.split(key, 4)
        self.embedding = eqx.nn.Embedding(vocab, width, key=k_embed)
        self.position = eqx.nn.Embedding(seq, width, key=k_position)

        def make_block(key):
            return GPTBlock(width, heads, hidden, key=key)

        self.blocks = eqx.filter_vmap(make_block)(jax.random.split(k_blocks, depth))
        self.norm = eqx.nn.LayerNorm(width)
        self.head = eqx.nn.Linear(width, vocab, key=k_head)

    def __call__(self, tokens: Int[Array, " seq"]) -> Float[Array, "seq vocab"]:
        positions = jnp.arange(tokens.shape[0])
        x = jax.vmap(self.embedding)(tokens) + jax.vmap(self.position)(positions)
        dynamic, static = eqx.partition(self.blocks, eqx.is_array)

        def body(x, block_dynamic):
            block = eqx.combine(block_dynamic, static)
            return block(x), None

        x, _ = jax.lax.scan(body, x, dynamic)
        return jax.vmap(self.head)(jax.vmap(self.norm)(x))


def gpt_scan(key: PRNGKeyArray) -> GPT:
    model = ox.annotate(GPT(key=key), lambda m: m.blocks, memory="pinned_host")
    return ox.annotate(model, lambda m: m, activations={"gpt_hidden": "offload"})


# -- 2. and 9c. Tied embeddings through eqx.nn.Shared (the Equinox docs' recipe). ---------


class TiedLM(eqx.Module):
    shared: eqx.nn.Shared
    mixer: eqx.nn.MLP
    norm: eqx.nn.LayerNorm

    def __init__(self, vocab=32, width=16, *, key):
        k_embed, k_head, k_mixer = jax.random.split(key, 3)
        embedding = eqx.nn.Embedding(vocab, width, key=k_embed)
        linear = eqx.nn.Linear(width, vocab, use_bias=False, key=k_head)
        where = lambda embed_and_lin: embed_and_lin[1].weight  # noqa: E731 (the docs' recipe)
        get = lambda embed_and_lin: embed_and_lin[0].weight  # noqa: E731
        self.shared = eqx.nn.Shared((embedding, linear), where, get)
        self.mixer = eqx.nn.MLP(width, width, width_size=32, depth=1, key=k_mixer)
        self.norm = eqx.nn.LayerNorm(width)

    def __call__(self, tokens: Int[Array, " seq"]) -> Float[Array, "seq vocab"]:
        embedding, linear = self.shared()
        x = jax.vmap(embedding)(tokens)
        x = x + jax.vmap(self.mixer)(x)
        return jax.vmap(linear)(jax.vmap(self.norm)(x))


def tied_embeddings(key: PRNGKeyArray) -> TiedLM:
    return ox.annotate(TiedLM(key=key), lambda m: m.mixer.layers[0], memory="pinned_host")


def annotate_shared(key: PRNGKeyArray) -> TiedLM:
    return ox.annotate(TiedLM(key=key), lambda m: m.shared, memory="pinned_host")


# -- 3. Fine-tuning the attention weights only; the rest frozen, in host memory. ----------


class FineTuneBlock(eqx.Module):
    norm1: eqx.nn.LayerNorm
    attention: eqx.nn.MultiheadAttention
    norm2: eqx.nn.LayerNorm
    mlp: eqx.nn.MLP

    def __init__(self, width: int, heads: int, *, key: PRNGKeyArray):
        k_attention, k_mlp = jax.random.split(key)
        self.norm1 = eqx.nn.LayerNorm(width)
        self.attention = eqx.nn.MultiheadAttention(heads, width, key=k_attention)
        self.norm2 = eqx.nn.LayerNorm(width)
        self.mlp = eqx.nn.MLP(width, width, width_size=2 * width, depth=1, key=k_mlp)

    def __call__(self, x: Float[Array, "seq width"]) -> Float[Array, "seq width"]:
        h = jax.vmap(self.norm1)(x)
        x = x + self.attention(h, h, h)
        return x + jax.vmap(self.mlp)(jax.vmap(self.norm2)(x))


class FineTuneTransformer(eqx.Module):
    embedding: eqx.nn.Embedding
    blocks: list[FineTuneBlock]
    head: eqx.nn.Linear

    def __init__(self, vocab=32, width=16, heads=2, depth=2, classes=3, *, key):
        k_embed, k_head, *k_blocks = jax.random.split(key, 2 + depth)
        self.embedding = eqx.nn.Embedding(vocab, width, key=k_embed)
        self.blocks = [FineTuneBlock(width, heads, key=k) for k in k_blocks]
        self.head = eqx.nn.Linear(width, classes, key=k_head)

    def __call__(self, tokens: Int[Array, " seq"]) -> Float[Array, " classes"]:
        x = jax.vmap(self.embedding)(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(jnp.mean(x, axis=0))


def _frozen_modules(m: FineTuneTransformer) -> list:
    return [m.embedding, m.head] + [layer for b in m.blocks for layer in (b.norm1, b.norm2, b.mlp)]


def finetune_attention(key: PRNGKeyArray) -> FineTuneTransformer:
    model = FineTuneTransformer(key=key)
    return ox.annotate(model, _frozen_modules, memory="pinned_host")


def attention_only(model: FineTuneTransformer) -> Any:
    """The Equinox FAQ's filter spec: False everywhere, True on the attention arrays."""
    spec = jax.tree_util.tree_map(lambda _: False, model)
    return eqx.tree_at(
        lambda s: [b.attention for b in s.blocks],
        spec,
        replace=[jax.tree_util.tree_map(eqx.is_inexact_array, b.attention) for b in model.blocks],
    )


def finetune_batch(key: PRNGKeyArray) -> tuple[Int[Array, "4 8"], Int[Array, " 4"]]:
    return tokens_batch(key), jax.random.randint(jax.random.fold_in(key, 1), (4,), 0, 3)


# -- 4. An LSTMCell scanned over 32 steps with a plain jax.lax.scan. ----------------------


class LSTMClassifier(eqx.Module):
    cell: eqx.nn.LSTMCell
    head: eqx.nn.Linear

    def __init__(self, features=4, hidden=8, classes=3, *, key):
        k_cell, k_head = jax.random.split(key)
        self.cell = eqx.nn.LSTMCell(features, hidden, key=k_cell)
        self.head = eqx.nn.Linear(hidden, classes, key=k_head)

    def __call__(self, xs: Float[Array, "time features"]) -> Float[Array, " classes"]:
        def step(state, x):
            return self.cell(x, state), None

        init = (jnp.zeros(self.cell.hidden_size), jnp.zeros(self.cell.hidden_size))
        (h, _), _ = jax.lax.scan(step, init, xs)
        return self.head(h)


def lstm_scan(key: PRNGKeyArray) -> LSTMClassifier:
    return ox.annotate(LSTMClassifier(key=key), lambda m: m.cell, memory="pinned_host")


# -- 5. A small UNet. ---------------------------------------------------------------------


class UNet(eqx.Module):
    stem: eqx.nn.Conv2d
    norm1: eqx.nn.GroupNorm
    down: eqx.nn.Conv2d
    norm2: eqx.nn.GroupNorm
    middle: eqx.nn.Conv2d
    up: eqx.nn.ConvTranspose2d
    out: eqx.nn.Conv2d

    def __init__(self, channels=2, width=8, *, key):
        k_stem, k_down, k_middle, k_up, k_out = jax.random.split(key, 5)
        self.stem = eqx.nn.Conv2d(channels, width, 3, padding=1, key=k_stem)
        self.norm1 = eqx.nn.GroupNorm(4, width)
        self.down = eqx.nn.Conv2d(width, 2 * width, 3, stride=2, padding=1, key=k_down)
        self.norm2 = eqx.nn.GroupNorm(4, 2 * width)
        self.middle = eqx.nn.Conv2d(2 * width, 2 * width, 3, padding=1, key=k_middle)
        self.up = eqx.nn.ConvTranspose2d(2 * width, width, 2, stride=2, key=k_up)
        self.out = eqx.nn.Conv2d(2 * width, channels, 1, key=k_out)

    def __call__(self, x: Float[Array, "channels 8 8"]) -> Float[Array, "channels 8 8"]:
        skip = jax.nn.relu(self.norm1(self.stem(x)))  # (width, 8, 8)
        h = jax.nn.relu(self.norm2(self.down(skip)))  # (2 width, 4, 4)
        h = h + jax.nn.relu(self.middle(h))
        h = self.up(h)  # (width, 8, 8)
        return self.out(jnp.concatenate([h, skip], axis=0))


def unet(key: PRNGKeyArray) -> UNet:
    return ox.annotate(UNet(key=key), lambda m: (m.norm2, m.middle, m.up), memory="pinned_host")


# -- 6. bfloat16 compute over float32 master weights. -------------------------------------


def half(tree: Any) -> Any:
    """A bfloat16 compute copy of a module's float32 (master) weights."""
    cast = lambda x: x.astype(jnp.bfloat16) if eqx.is_inexact_array(x) else x  # noqa: E731
    return jax.tree_util.tree_map(cast, tree)


class HalfBlock(eqx.Module):
    norm: eqx.nn.LayerNorm
    up: eqx.nn.Linear
    down: eqx.nn.Linear

    def __init__(self, width: int, hidden: int, *, key: PRNGKeyArray):
        k_up, k_down = jax.random.split(key)
        self.norm = eqx.nn.LayerNorm(width)
        self.up = eqx.nn.Linear(width, hidden, key=k_up)
        self.down = eqx.nn.Linear(hidden, width, key=k_down)

    def __call__(self, x: Array) -> Array:
        block = half(self)
        return x + block.down(jax.nn.gelu(block.up(block.norm(x))))


class HalfNet(eqx.Module):
    embed: eqx.nn.Linear
    blocks: list[HalfBlock]
    head: eqx.nn.Linear

    def __init__(self, features=8, width=16, hidden=32, depth=2, outputs=4, *, key):
        k_embed, k_head, *k_blocks = jax.random.split(key, 2 + depth)
        self.embed = eqx.nn.Linear(features, width, key=k_embed)
        self.blocks = [HalfBlock(width, hidden, key=k) for k in k_blocks]
        self.head = eqx.nn.Linear(width, outputs, key=k_head)

    def __call__(self, x: Float[Array, " features"]) -> Float[Array, " outputs"]:
        x = half(self.embed)(x.astype(jnp.bfloat16))
        for block in self.blocks:
            x = block(x)
        return half(self.head)(x).astype(jnp.float32)  # the loss is computed in float32


def bf16_compute(key: PRNGKeyArray) -> HalfNet:
    return ox.annotate(HalfNet(key=key), lambda m: m.blocks, memory="pinned_host")


# -- 8. A method that is not __call__. ----------------------------------------------------


class Classifier(eqx.Module):
    encoder: eqx.nn.MLP
    head: eqx.nn.Linear

    def __init__(self, features=8, width=16, classes=4, *, key):
        k_encoder, k_head = jax.random.split(key)
        self.encoder = eqx.nn.MLP(features, width, width_size=16, depth=1, key=k_encoder)
        self.head = eqx.nn.Linear(width, classes, key=k_head)

    def features(self, x: Float[Array, " features"]) -> Float[Array, " width"]:
        return jnp.tanh(self.encoder(x))

    def __call__(self, x: Float[Array, "batch features"]) -> Float[Array, "batch classes"]:
        return jax.vmap(self.head)(jax.vmap(self.features)(x))

    def loss(self, x: Float[Array, "batch features"], labels: Int[Array, " batch"]) -> Array:
        return optax.softmax_cross_entropy_with_integer_labels(self(x), labels).mean()


def bound_method(key: PRNGKeyArray) -> Classifier:
    return ox.annotate(Classifier(key=key), lambda m: m.head, memory="pinned_host")


def bound_method_loss(model: Classifier, state: None, batch: tuple, key: None):
    return model.loss(*batch), state


def classifier_batch(key: PRNGKeyArray) -> tuple:
    return _classes(key, (4, 8), 4)


# -- 9. ox.annotate on a whole eqx.nn.MLP field, a BatchNorm, a Python list field. --------


class MLPField(eqx.Module):
    embed: eqx.nn.Linear
    mlp: eqx.nn.MLP

    def __init__(self, *, key: PRNGKeyArray):
        k_embed, k_mlp = jax.random.split(key)
        self.embed = eqx.nn.Linear(8, 16, key=k_embed)
        self.mlp = eqx.nn.MLP(16, 4, width_size=16, depth=2, key=k_mlp)

    def __call__(self, x: Float[Array, " 8"]) -> Float[Array, " 4"]:
        return self.mlp(jax.nn.relu(self.embed(x)))


def annotate_mlp(key: PRNGKeyArray) -> MLPField:
    return ox.annotate(MLPField(key=key), lambda m: m.mlp, memory="pinned_host")


def annotate_batch_norm(key: PRNGKeyArray) -> tuple[BatchNormNet, eqx.nn.State]:
    model, state = eqx.nn.make_with_state(BatchNormNet)(key=key)
    return ox.annotate(model, lambda m: m.norm, memory="pinned_host"), state


class ListNet(eqx.Module):
    embed: eqx.nn.Linear
    blocks: list[eqx.nn.Linear]
    head: eqx.nn.Linear

    def __init__(self, depth=3, *, key: PRNGKeyArray):
        k_embed, k_head, *k_blocks = jax.random.split(key, 2 + depth)
        self.embed = eqx.nn.Linear(8, 16, key=k_embed)
        self.blocks = [eqx.nn.Linear(16, 16, key=k) for k in k_blocks]
        self.head = eqx.nn.Linear(16, 4, key=k_head)

    def __call__(self, x: Float[Array, " 8"]) -> Float[Array, " 4"]:
        x = self.embed(x)
        for block in self.blocks:
            x = x + jnp.tanh(block(x))
        return self.head(x)


def annotate_list(key: PRNGKeyArray) -> ListNet:
    return ox.annotate(ListNet(key=key), lambda m: m.blocks, memory="pinned_host")


# -- 7. Gradient accumulation with optax.MultiSteps (see `FAMILY_OPTIMIZERS`). ----------


def multi_steps(key: PRNGKeyArray) -> ListNet:
    return ox.annotate(ListNet(key=key), lambda m: m.embed, memory="pinned_host")


# -- 10. An L2 penalty on a host-resident leaf, in the loss. ------------------------------


class StackedLinear(eqx.Module):
    embed: eqx.nn.Linear
    layers: eqx.nn.Linear  # stacked: weight (depth, 16, 16)
    head: eqx.nn.Linear

    def __init__(self, depth=3, *, key: PRNGKeyArray):
        k_embed, k_layers, k_head = jax.random.split(key, 3)
        self.embed = eqx.nn.Linear(8, 16, key=k_embed)

        def make_layer(key):
            return eqx.nn.Linear(16, 16, key=key)

        self.layers = eqx.filter_vmap(make_layer)(jax.random.split(k_layers, depth))
        self.head = eqx.nn.Linear(16, 4, key=k_head)

    def __call__(self, x: Float[Array, " 8"]) -> Float[Array, " 4"]:
        return self.head(ox.scan(self.layers, self.embed(x)))


def l2_penalty(key: PRNGKeyArray) -> StackedLinear:
    return ox.annotate(StackedLinear(key=key), lambda m: m.layers, memory="pinned_host")


def l2_penalty_loss(model: StackedLinear, state: None, x: Float[Array, "batch 8"], key: None):
    """The penalty reads the host-resident stack outside any region, so it fetches it
    there with `ox.fetch` (a no-op on device arrays; plain Equinox runs it too). Without
    it, the step is a `HostUseError` naming the leaf and the line
    (`tests/test_host_leaves_in_user_code.py`)."""
    loss = jnp.mean(jax.vmap(model)(x) ** 2)
    return loss + 1e-3 * jnp.sum(ox.fetch(model.layers.weight) ** 2), state


# -- The cases. ----------------------------------------------------------------------------

FAMILIES: dict[str, Case] = {
    "gpt_scan": Case(gpt_scan, next_token_loss, tokens_batch),
    "tied_embeddings": Case(tied_embeddings, next_token_loss, tokens_batch),
    "finetune_attention": Case(
        finetune_attention, classify_loss, finetune_batch, filter_spec=attention_only
    ),
    "lstm_scan": Case(lstm_scan, classify_loss, lambda key: _classes(key, (4, 32, 4), 3)),
    "unet": Case(unet, regression_loss, lambda key: _targets(key, (2, 2, 8, 8), (2, 2, 8, 8))),
    "bf16_compute": Case(
        bf16_compute, regression_loss, lambda key: _targets(key, (4, 8), (4, 4)), rtol=2e-2
    ),
    "multi_steps": Case(multi_steps, mlp_loss, mlp_batch),
    "bound_method": Case(bound_method, bound_method_loss, classifier_batch),
    "annotate_mlp": Case(annotate_mlp, mlp_loss, mlp_batch),
    "annotate_batch_norm": Case(annotate_batch_norm, batch_norm_loss, mlp_batch),
    "annotate_shared": Case(annotate_shared, next_token_loss, tokens_batch),
    "annotate_list": Case(annotate_list, mlp_loss, mlp_batch),
    "l2_penalty": Case(l2_penalty, l2_penalty_loss, mlp_batch),
}

# Activations each family declares "offload" (the others declare no names).
FAMILY_NAMES: dict[str, str] = {"gpt_scan": "gpt_hidden"}

# The optax transformation each family trains with, when it is not `optax.adam(1e-2)`.
FAMILY_OPTIMIZERS: dict[str, Callable[[], Any]] = {
    "multi_steps": lambda: optax.MultiSteps(optax.adam(1e-2), every_k_schedule=2),
}
