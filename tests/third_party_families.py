"""Third-party model families for the real-client suite (`tests/test_real_models.py`,
`tests/test_third_party.py`): model code written the way other people publish Equinox
models (Equinox's documentation examples, LLaMA- and Mamba-style code), unmodified. The
only offload_eqx touch is an `ox.annotate(model, where, memory="pinned_host")` applied
from outside, after the model is built: no `ox.name`, no `ox.checkpoint`, no `ox.field`
inside the model code. Same `Case` and conventions as `tests/real_models.py`, all tiny
(widths of 2 to 16, two layers, batches of 2 to 4), so that every case compiles under
every strategy on a 2-core CPU.

The Case-shaped families are in `THIRD_PARTY` (trained by `test_same_as_plain_equinox`);
the rest (the GAN's two alternating steps, the sampler's output, `generate`, NumPy
batches) are tested in `tests/test_third_party.py` with the models and helpers here.
"""

import math
from collections.abc import Callable
from typing import Any, Literal

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jaxtyping import Array, Float, Int, PRNGKeyArray
from real_model_families import next_token_loss, tokens_batch
from real_models import Case

import offload_eqx as ox

# -- 1. Equinox's "Stateful operations" example: BatchNorm and SpectralNorm. -------------


class StatefulModel(eqx.Module):
    """The model of Equinox's stateful example (`examples/stateful.ipynb`), narrower: two
    `BatchNorm`s (one "ema", one "batch") and a `SpectralNorm`-wrapped `Linear` keep their
    running statistics and power iterations in an `eqx.nn.State`. Per example; the loss
    `jax.vmap`s it with `axis_name="batch"`."""

    norm1: eqx.nn.BatchNorm
    spectral_linear: eqx.nn.SpectralNorm[eqx.nn.Linear]
    norm2: eqx.nn.BatchNorm
    linear1: eqx.nn.Linear
    linear2: eqx.nn.Linear

    def __init__(self, key: PRNGKeyArray):
        key1, key2, key3, key4 = jax.random.split(key, 4)
        self.norm1 = eqx.nn.BatchNorm(input_size=3, axis_name="batch", mode="ema")
        self.spectral_linear = eqx.nn.SpectralNorm(
            layer=eqx.nn.Linear(in_features=3, out_features=8, key=key1),
            weight_name="weight",
            key=key2,
        )
        self.norm2 = eqx.nn.BatchNorm(input_size=8, axis_name="batch", mode="batch")
        self.linear1 = eqx.nn.Linear(in_features=8, out_features=8, key=key3)
        self.linear2 = eqx.nn.Linear(in_features=8, out_features=3, key=key4)

    def __call__(
        self, x: Float[Array, " 3"], state: eqx.nn.State
    ) -> tuple[Float[Array, " 3"], eqx.nn.State]:
        x, state = self.norm1(x, state)
        x, state = self.spectral_linear(x, state)
        x = jax.nn.relu(x)
        x, state = self.norm2(x, state)
        x = self.linear1(x)
        x = jax.nn.relu(x)
        x = self.linear2(x)
        return x, state


def _annotate_stateful(model: StatefulModel) -> StatefulModel:
    return ox.annotate(model, lambda m: (m.norm1, m.spectral_linear), memory="pinned_host")


def batch_norm_spectral(key: PRNGKeyArray) -> tuple[StatefulModel, eqx.nn.State]:
    """`eqx.nn.make_with_state`, as the example builds it (the model keeps no initial
    state)."""
    model, state = eqx.nn.make_with_state(StatefulModel)(key=key)
    return _annotate_stateful(model), state


def batch_norm_spectral_state(key: PRNGKeyArray) -> tuple[StatefulModel, eqx.nn.State]:
    """`eqx.nn.State(model)` without `make_with_state`: every `StateIndex` keeps its
    `init` arrays (the power iterations' `u`, `v`, the running statistics, a bool flag)
    inside the model, so host-resident modules carry leaves the call never reads (their
    gradients are zero and Adam leaves them unchanged), and the state's keys are the
    indices' `object()` markers."""
    model = StatefulModel(key)
    state = eqx.nn.State(model)
    return _annotate_stateful(model), state


def stateful_loss(model: StatefulModel, state: eqx.nn.State, batch: tuple, key: None):
    """The example's `compute_loss`."""
    xs, ys = batch
    batch_model = jax.vmap(model, axis_name="batch", in_axes=(0, None), out_axes=(0, None))
    pred_ys, state = batch_model(xs, state)
    return jnp.mean((pred_ys - ys) ** 2), state


def stateful_batch(key: PRNGKeyArray) -> tuple[Float[Array, "4 3"], Float[Array, "4 3"]]:
    k_xs, k_ys = jax.random.split(key)
    return jax.random.normal(k_xs, (4, 3)), jax.random.normal(k_ys, (4, 3))


# -- 2. Equinox's RNN example: a GRUCell under jax.lax.scan, a linear head. --------------


class RNN(eqx.Module):
    """The model of Equinox's RNN example (`examples/train_rnn.ipynb`), as published:
    the cell is closed over by the scan body inside `__call__`."""

    hidden_size: int
    cell: eqx.nn.GRUCell
    linear: eqx.nn.Linear
    bias: jax.Array

    def __init__(self, in_size: int, out_size: int, hidden_size: int, *, key: PRNGKeyArray):
        ckey, lkey = jax.random.split(key)
        self.hidden_size = hidden_size
        self.cell = eqx.nn.GRUCell(in_size, hidden_size, key=ckey)
        self.linear = eqx.nn.Linear(hidden_size, out_size, use_bias=False, key=lkey)
        self.bias = jnp.zeros(out_size)

    def __call__(self, input: Float[Array, "time in_size"]) -> Float[Array, " out_size"]:
        hidden = jnp.zeros((self.hidden_size,))

        def f(carry, inp):
            return self.cell(inp, carry), None

        out, _ = jax.lax.scan(f, hidden, input)
        # sigmoid because we're performing binary classification
        return jax.nn.sigmoid(self.linear(out) + self.bias)


def rnn_scan(key: PRNGKeyArray) -> RNN:
    model = RNN(in_size=2, out_size=1, hidden_size=8, key=key)
    return ox.annotate(model, lambda m: m.cell, memory="pinned_host")


def rnn_loss(model: RNN, state: None, batch: tuple, key: None):
    """The example's binary cross-entropy."""
    x, y = batch
    pred_y = jax.vmap(model)(x)[:, 0]
    return -jnp.mean(y * jnp.log(pred_y) + (1 - y) * jnp.log(1 - pred_y)), state


def rnn_batch(key: PRNGKeyArray) -> tuple[Float[Array, "4 8 2"], Float[Array, " 4"]]:
    k_x, k_y = jax.random.split(key)
    labels = jax.random.bernoulli(k_y, 0.5, (4,)).astype(jnp.float32)
    return jax.random.normal(k_x, (4, 8, 2)), labels


# -- 3. Dropout with a key split per example. ---------------------------------------------


class DropoutBlock(eqx.Module):
    linear: eqx.nn.Linear
    dropout: eqx.nn.Dropout

    def __init__(self, in_size: int, out_size: int, *, key: PRNGKeyArray):
        self.linear = eqx.nn.Linear(in_size, out_size, key=key)
        self.dropout = eqx.nn.Dropout(p=0.5)

    def __call__(self, x: Float[Array, " in_size"], *, key: PRNGKeyArray) -> Array:
        return self.dropout(jax.nn.relu(self.linear(x)), key=key)


class DropoutMLP(eqx.Module):
    """Blocks that each drop half their outputs with their own key; the host-resident
    blocks bring their regions, which must recompute the same mask in the backward pass."""

    blocks: list[DropoutBlock]
    head: eqx.nn.Linear

    def __init__(self, features=8, width=16, outputs=4, depth=2, *, key):
        k_head, *k_blocks = jax.random.split(key, 1 + depth)
        sizes = [features] + [width] * depth
        self.blocks = [DropoutBlock(i, o, key=k) for i, o, k in zip(sizes, sizes[1:], k_blocks)]
        self.head = eqx.nn.Linear(width, outputs, key=k_head)

    def __call__(self, x: Float[Array, " features"], *, key: PRNGKeyArray) -> Array:
        for block, block_key in zip(self.blocks, jax.random.split(key, len(self.blocks))):
            x = block(x, key=block_key)
        return self.head(x)


def dropout_mlp(key: PRNGKeyArray) -> DropoutMLP:
    return ox.annotate(DropoutMLP(key=key), lambda m: m.blocks, memory="pinned_host")


def dropout_loss(model: DropoutMLP, state: None, x: Float[Array, "batch 8"], key: PRNGKeyArray):
    keys = jax.random.split(key, x.shape[0])
    return jnp.mean(jax.vmap(model)(x, key=keys) ** 2), state


def dropout_batch(key: PRNGKeyArray) -> Float[Array, "4 8"]:
    return jax.random.normal(key, (4, 8))


# -- 4. A GAN: generator and discriminator (tested in tests/test_third_party.py). --------

LATENT = 4
DATA = 2
GAN_BATCH = 4


class Generator(eqx.Module):
    """Like the generator of Equinox's DCGAN example, with `Linear` for the transposed
    convolutions: an `eqx.nn.Sequential` of layers and `Lambda` activations."""

    layers: eqx.nn.Sequential

    def __init__(self, *, key: PRNGKeyArray):
        key1, key2 = jax.random.split(key)
        self.layers = eqx.nn.Sequential(
            [
                eqx.nn.Linear(LATENT, 8, key=key1),
                eqx.nn.Lambda(jax.nn.relu),
                eqx.nn.Linear(8, DATA, key=key2),
                eqx.nn.Lambda(jnp.tanh),
            ]
        )

    def __call__(self, z: Float[Array, " latent"]) -> Float[Array, " data"]:
        return self.layers(z)


class Discriminator(eqx.Module):
    layers: eqx.nn.Sequential

    def __init__(self, *, key: PRNGKeyArray):
        key1, key2 = jax.random.split(key)
        self.layers = eqx.nn.Sequential(
            [
                eqx.nn.Linear(DATA, 8, key=key1),
                eqx.nn.Lambda(jax.nn.leaky_relu),
                eqx.nn.Linear(8, 1, key=key2),
            ]
        )

    def __call__(self, x: Float[Array, " data"]) -> Float[Array, ""]:
        return self.layers(x)[0]


def gan(key: PRNGKeyArray) -> tuple[Generator, Discriminator]:
    """One layer of each annotated into pinned_host from outside."""
    k_generator, k_discriminator = jax.random.split(key)
    generator = Generator(key=k_generator)
    discriminator = Discriminator(key=k_discriminator)
    generator = ox.annotate(generator, lambda g: g.layers[0], memory="pinned_host")
    discriminator = ox.annotate(discriminator, lambda d: d.layers[2], memory="pinned_host")
    return generator, discriminator


def gan_batch(key: PRNGKeyArray) -> Float[Array, "4 2"]:
    """The real data: a point cloud around (1, -1)."""
    return jnp.array([1.0, -1.0]) + 0.1 * jax.random.normal(key, (GAN_BATCH, DATA))


@eqx.filter_value_and_grad(has_aux=True)
def compute_grads_discriminator(
    discriminator: Discriminator,
    generator: Generator,
    real_batch: Float[Array, "batch data"],
    key: PRNGKeyArray,
):
    """The DCGAN example's discriminator loss: fakes labelled 0, real data 1."""
    key, subkey = jax.random.split(key)
    noise = jax.random.normal(subkey, (real_batch.shape[0], LATENT))
    fake_batch = jax.vmap(generator)(noise)
    fake_labels = jnp.zeros(real_batch.shape[0])
    real_labels = jnp.ones(real_batch.shape[0])
    loss1 = optax.sigmoid_binary_cross_entropy(jax.vmap(discriminator)(fake_batch), fake_labels)
    loss2 = optax.sigmoid_binary_cross_entropy(jax.vmap(discriminator)(real_batch), real_labels)
    return (loss1.mean() + loss2.mean()) / 2, key


@eqx.filter_value_and_grad(has_aux=True)
def compute_grads_generator(generator: Generator, discriminator: Discriminator, key: PRNGKeyArray):
    """The DCGAN example's generator loss: fakes labelled 1 (the batch size is a global,
    as in the example)."""
    key, subkey = jax.random.split(key)
    noise = jax.random.normal(subkey, (GAN_BATCH, LATENT))
    pred_y = jax.vmap(discriminator)(jax.vmap(generator)(noise))
    return optax.sigmoid_binary_cross_entropy(pred_y, jnp.ones(GAN_BATCH)).mean(), key


def step_discriminator(
    discriminator: Discriminator,
    generator: Generator,
    real_batch: Float[Array, "batch data"],
    discriminator_optimizer: Any,
    discriminator_opt_state: Any,
    key: PRNGKeyArray,
    apply_updates: Callable[[Any, Any], Any],
):
    """The DCGAN example's discriminator step: the optimizer is an argument (static),
    the key is threaded through. `apply_updates` is `eqx.apply_updates` or
    `ox.apply_updates` (the only difference between the two runs)."""
    (loss, key), grads = compute_grads_discriminator(discriminator, generator, real_batch, key)
    updates, opt_state = discriminator_optimizer.update(
        grads, discriminator_opt_state, discriminator
    )
    discriminator = apply_updates(discriminator, updates)
    return loss, discriminator, opt_state, key


def step_generator(
    generator: Generator,
    discriminator: Discriminator,
    generator_optimizer: Any,
    generator_opt_state: Any,
    key: PRNGKeyArray,
    apply_updates: Callable[[Any, Any], Any],
):
    (loss, key), grads = compute_grads_generator(generator, discriminator, key)
    updates, opt_state = generator_optimizer.update(grads, generator_opt_state, generator)
    generator = apply_updates(generator, updates)
    return loss, generator, opt_state, key


# -- 5. A sampler under eqx.internal.while_loop (score-based diffusion, Euler steps). ----

WhileKind = Literal["lax", "bounded", "checkpointed"]
SAMPLER_STEPS = 4


class ScoreModel(eqx.Module):
    """Like the score model of Equinox's score-based diffusion example, with an MLP for
    the Mixer: `model(t, y)` takes the time and the noisy point."""

    mlp: eqx.nn.MLP

    def __init__(self, dim: int = 2, *, key: PRNGKeyArray):
        self.mlp = eqx.nn.MLP(dim + 1, dim, width_size=16, depth=2, key=key)

    def __call__(self, t: Float[Array, ""], y: Float[Array, " dim"]) -> Float[Array, " dim"]:
        return self.mlp(jnp.concatenate([y, t[None]]))


def score_model(key: PRNGKeyArray) -> ScoreModel:
    return ox.annotate(ScoreModel(key=key), lambda m: m.mlp, memory="pinned_host")


def euler_sample(
    model: ScoreModel, y1: Float[Array, " dim"], kind: WhileKind, steps: int = SAMPLER_STEPS
) -> Float[Array, " dim"]:
    """The reverse-time probability-flow ODE of a VP SDE with beta = 1, integrated from
    t = 1 to t = 0 with `steps` Euler steps inside `eqx.internal.while_loop`, the model
    closed over by the body (as diffrax's own loops do)."""
    dt = 1.0 / steps

    def cond_fun(carry):
        i, _ = carry
        return i < steps

    def body_fun(carry):
        i, y = carry
        t = 1.0 - i * dt
        drift = -0.5 * (y + model(t, y))
        return i + 1, y - dt * drift

    init = (jnp.array(0), y1)
    _, y0 = eqx.internal.while_loop(cond_fun, body_fun, init, max_steps=steps, kind=kind)
    return y0


def sample_batch(
    model: ScoreModel, y1: Float[Array, "batch dim"], kind: WhileKind
) -> Float[Array, "batch dim"]:
    return jax.vmap(lambda y: euler_sample(model, y, kind))(y1)


def sampler_loss(kind: WhileKind) -> Callable[..., tuple[Array, None]]:
    """Trains the score model through the sampler: the samples of fixed noise should
    land on fixed targets (reverse mode through the loop: "bounded" or "checkpointed")."""

    def loss(model: ScoreModel, state: None, batch: tuple, key: None):
        y1, targets = batch
        return jnp.mean((sample_batch(model, y1, kind) - targets) ** 2), state

    return loss


def sampler_batch(key: PRNGKeyArray) -> tuple[Float[Array, "4 2"], Float[Array, "4 2"]]:
    k_noise, k_targets = jax.random.split(key)
    return jax.random.normal(k_noise, (4, 2)), jax.random.normal(k_targets, (4, 2))


# -- 6. A LLaMA-style decoder with a KV cache and a `generate` method. --------------------

KVCache = tuple[Float[Array, "length heads head_dim"], Float[Array, "length heads head_dim"]]


class RMSNorm(eqx.Module):
    weight: Float[Array, " width"]
    eps: float = eqx.field(static=True)

    def __init__(self, width: int, eps: float = 1e-6):
        self.weight = jnp.ones(width)
        self.eps = eps

    def __call__(self, x: Float[Array, "... width"]) -> Float[Array, "... width"]:
        scale = jax.lax.rsqrt(jnp.mean(x**2, axis=-1, keepdims=True) + self.eps)
        return x * scale * self.weight


def rope(x: Float[Array, "seq heads head_dim"], positions: Int[Array, " seq"]) -> Array:
    """Rotary position embedding (the rotate-half form)."""
    half = x.shape[-1] // 2
    freqs = 1.0 / (10000.0 ** (jnp.arange(half) / half))
    angles = positions[:, None] * freqs[None, :]
    cos, sin = jnp.cos(angles)[:, None, :], jnp.sin(angles)[:, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)


class LlamaBlock(eqx.Module):
    """Pre-norm block: RMSNorm, causal attention with RoPE over a KV cache, RMSNorm,
    SwiGLU. `x` holds the tokens at positions `start, start + 1, ...`; their keys and
    values are written into the cache there, and each attends to the cache up to its
    own position (training: an empty cache of the sequence's length and `start = 0`)."""

    attention_norm: RMSNorm
    wq: eqx.nn.Linear
    wk: eqx.nn.Linear
    wv: eqx.nn.Linear
    wo: eqx.nn.Linear
    ffn_norm: RMSNorm
    w1: eqx.nn.Linear
    w2: eqx.nn.Linear
    w3: eqx.nn.Linear
    heads: int = eqx.field(static=True)

    def __init__(self, width: int, heads: int, hidden: int, *, key: PRNGKeyArray):
        kq, kk, kv, ko, k1, k2, k3 = jax.random.split(key, 7)
        self.attention_norm = RMSNorm(width)
        self.wq = eqx.nn.Linear(width, width, use_bias=False, key=kq)
        self.wk = eqx.nn.Linear(width, width, use_bias=False, key=kk)
        self.wv = eqx.nn.Linear(width, width, use_bias=False, key=kv)
        self.wo = eqx.nn.Linear(width, width, use_bias=False, key=ko)
        self.ffn_norm = RMSNorm(width)
        self.w1 = eqx.nn.Linear(width, hidden, use_bias=False, key=k1)
        self.w2 = eqx.nn.Linear(hidden, width, use_bias=False, key=k2)
        self.w3 = eqx.nn.Linear(width, hidden, use_bias=False, key=k3)
        self.heads = heads

    def __call__(
        self, x: Float[Array, "seq width"], cache: KVCache, start: Int[Array, ""]
    ) -> tuple[Float[Array, "seq width"], KVCache]:
        seq, width = x.shape
        head_dim = width // self.heads
        positions = start + jnp.arange(seq)
        h = self.attention_norm(x)
        q = jax.vmap(self.wq)(h).reshape(seq, self.heads, head_dim)
        k = jax.vmap(self.wk)(h).reshape(seq, self.heads, head_dim)
        v = jax.vmap(self.wv)(h).reshape(seq, self.heads, head_dim)
        q, k = rope(q, positions), rope(k, positions)
        k_cache = jax.lax.dynamic_update_slice_in_dim(cache[0], k, start, axis=0)
        v_cache = jax.lax.dynamic_update_slice_in_dim(cache[1], v, start, axis=0)
        mask = jnp.arange(k_cache.shape[0])[None, :] <= positions[:, None]
        scores = jnp.einsum("qhd,khd->hqk", q, k_cache) / math.sqrt(head_dim)
        scores = jnp.where(mask[None], scores, jnp.finfo(scores.dtype).min)
        weights = jax.nn.softmax(scores, axis=-1)
        out = jnp.einsum("hqk,khd->qhd", weights, v_cache).reshape(seq, width)
        x = x + jax.vmap(self.wo)(out)
        h = self.ffn_norm(x)
        x = x + jax.vmap(self.w2)(jax.nn.silu(jax.vmap(self.w1)(h)) * jax.vmap(self.w3)(h))
        return x, (k_cache, v_cache)


class LlamaDecoder(eqx.Module):
    embedding: eqx.nn.Embedding
    blocks: list[LlamaBlock]
    norm: RMSNorm
    head: eqx.nn.Linear
    heads: int = eqx.field(static=True)

    def __init__(self, vocab=32, width=16, heads=2, hidden=32, depth=2, *, key):
        k_embed, k_head, *k_blocks = jax.random.split(key, 2 + depth)
        self.embedding = eqx.nn.Embedding(vocab, width, key=k_embed)
        self.blocks = [LlamaBlock(width, heads, hidden, key=k) for k in k_blocks]
        self.norm = RMSNorm(width)
        self.head = eqx.nn.Linear(width, vocab, use_bias=False, key=k_head)
        self.heads = heads

    def empty_cache(self, length: int) -> list[KVCache]:
        head_dim = self.embedding.weight.shape[1] // self.heads
        shape = (length, self.heads, head_dim)
        return [(jnp.zeros(shape), jnp.zeros(shape)) for _ in self.blocks]

    def forward(
        self, tokens: Int[Array, " seq"], caches: list[KVCache], start: Int[Array, ""]
    ) -> tuple[Float[Array, "seq vocab"], list[KVCache]]:
        x = jax.vmap(self.embedding)(tokens)
        new_caches = []
        for block, cache in zip(self.blocks, caches):
            x, cache = block(x, cache, start)
            new_caches.append(cache)
        return jax.vmap(self.head)(self.norm(x)), new_caches

    def __call__(self, tokens: Int[Array, " seq"]) -> Float[Array, "seq vocab"]:
        logits, _ = self.forward(tokens, self.empty_cache(tokens.shape[0]), jnp.array(0))
        return logits

    def generate(self, prompt: Int[Array, " prompt"], steps: int = 4) -> Int[Array, " steps"]:
        """Greedy decoding: the prompt fills the cache in one pass, then each new token is
        one `forward` of a single position, in a `jax.lax.scan` whose carry holds the
        token, its position and the caches."""
        caches = self.empty_cache(prompt.shape[0] + steps)
        logits, caches = self.forward(prompt, caches, jnp.array(0))
        first = jnp.argmax(logits[-1])

        def decode(carry, _):
            token, position, caches = carry
            logits, caches = self.forward(token[None], caches, position)
            return (jnp.argmax(logits[-1]), position + 1, caches), token

        init = (first, jnp.array(prompt.shape[0]), caches)
        _, tokens = jax.lax.scan(decode, init, length=steps)
        return tokens


def kv_cache_decoder(key: PRNGKeyArray) -> LlamaDecoder:
    return ox.annotate(LlamaDecoder(key=key), lambda m: m.blocks, memory="pinned_host")


def prompt_batch(key: PRNGKeyArray) -> Int[Array, " 5"]:
    return jax.random.randint(key, (5,), 0, 32)


# -- 7. Mamba-like blocks that checkpoint on their own. -----------------------------------


class MambaBlock(eqx.Module):
    """A Mamba-style block (as in mamba-minimal): in-projection, causal depthwise
    convolution, selective scan, gated out-projection. `__call__` wraps the selective
    scan in its own `jax.checkpoint`, passing `A_log` as an explicit input and closing
    over the rest of the block (`x_proj`, `dt_proj`, `D`)."""

    norm: RMSNorm
    in_proj: eqx.nn.Linear
    conv: eqx.nn.Conv1d
    x_proj: eqx.nn.Linear
    dt_proj: eqx.nn.Linear
    A_log: Float[Array, "inner state"]
    D: Float[Array, " inner"]
    out_proj: eqx.nn.Linear
    dt_rank: int = eqx.field(static=True)

    def __init__(self, width=8, inner=16, state=4, dt_rank=2, *, key):
        k_in, k_conv, k_x, k_dt, k_out = jax.random.split(key, 5)
        self.norm = RMSNorm(width)
        self.in_proj = eqx.nn.Linear(width, 2 * inner, use_bias=False, key=k_in)
        self.conv = eqx.nn.Conv1d(
            inner, inner, kernel_size=3, padding=((2, 0),), groups=inner, key=k_conv
        )
        self.x_proj = eqx.nn.Linear(inner, dt_rank + 2 * state, use_bias=False, key=k_x)
        self.dt_proj = eqx.nn.Linear(dt_rank, inner, key=k_dt)
        self.A_log = jnp.log(jnp.tile(jnp.arange(1, state + 1, dtype=jnp.float32), (inner, 1)))
        self.D = jnp.ones(inner)
        self.out_proj = eqx.nn.Linear(inner, width, use_bias=False, key=k_out)
        self.dt_rank = dt_rank

    def ssm(
        self, u: Float[Array, "seq inner"], A_log: Float[Array, "inner state"]
    ) -> Float[Array, "seq inner"]:
        A = -jnp.exp(A_log)
        state = A.shape[1]
        delta, B, C = jnp.split(
            jax.vmap(self.x_proj)(u), [self.dt_rank, self.dt_rank + state], axis=-1
        )
        delta = jax.nn.softplus(jax.vmap(self.dt_proj)(delta))
        dA = jnp.exp(delta[..., None] * A)  # (seq, inner, state)
        dBu = delta[..., None] * B[:, None, :] * u[..., None]

        def step(h, inputs):
            dA, dBu, C = inputs
            h = dA * h + dBu
            return h, h @ C

        _, y = jax.lax.scan(step, jnp.zeros(A.shape), (dA, dBu, C))
        return y + u * self.D

    def __call__(self, x: Float[Array, "seq width"]) -> Float[Array, "seq width"]:
        u, z = jnp.split(jax.vmap(self.in_proj)(self.norm(x)), 2, axis=-1)
        u = jax.nn.silu(self.conv(u.T).T)

        @jax.checkpoint
        def selective_scan(u, A_log):
            return self.ssm(u, A_log)

        y = selective_scan(u, self.A_log)
        return x + jax.vmap(self.out_proj)(y * jax.nn.silu(z))


class Mamba(eqx.Module):
    """Embedding, blocks, RMSNorm, head. With `gradient_checkpointing` (a config flag, as
    third-party models have) each block call is also wrapped in `eqx.filter_checkpoint`,
    around the block's own `jax.checkpoint`."""

    embedding: eqx.nn.Embedding
    blocks: list[MambaBlock]
    norm: RMSNorm
    head: eqx.nn.Linear
    gradient_checkpointing: bool = eqx.field(static=True)

    def __init__(self, vocab=32, width=8, depth=2, gradient_checkpointing=False, *, key):
        k_embed, k_head, *k_blocks = jax.random.split(key, 2 + depth)
        self.embedding = eqx.nn.Embedding(vocab, width, key=k_embed)
        self.blocks = [MambaBlock(width, key=k) for k in k_blocks]
        self.norm = RMSNorm(width)
        self.head = eqx.nn.Linear(width, vocab, key=k_head)
        self.gradient_checkpointing = gradient_checkpointing

    def __call__(self, tokens: Int[Array, " seq"]) -> Float[Array, "seq vocab"]:
        x = jax.vmap(self.embedding)(tokens)
        for block in self.blocks:
            x = eqx.filter_checkpoint(block)(x) if self.gradient_checkpointing else block(x)
        return jax.vmap(self.head)(self.norm(x))


def own_checkpoint_block(key: PRNGKeyArray) -> Mamba:
    return ox.annotate(Mamba(key=key), lambda m: m.blocks, memory="pinned_host")


def own_filter_checkpoint(key: PRNGKeyArray) -> Mamba:
    model = Mamba(gradient_checkpointing=True, key=key)
    return ox.annotate(model, lambda m: m.blocks, memory="pinned_host")


# -- 8. NumPy float64 batches, as data loaders yield them (tests/test_third_party.py). ----


def numpy_mlp(key: PRNGKeyArray) -> eqx.nn.MLP:
    model = eqx.nn.MLP(6, 3, width_size=16, depth=2, key=key)
    return ox.annotate(model, lambda m: m.layers[1], memory="pinned_host")


def numpy_loss(model: eqx.nn.MLP, state: None, batch: tuple, key: None):
    x, y = batch
    return jnp.mean((jax.vmap(model)(x) - y) ** 2), state


def numpy_batch(key: Any = None) -> tuple[np.ndarray, np.ndarray]:
    """`np.random.randn` arrays: float64, in host memory, not `jax.Array`s. `key` is
    ignored (the suite's steps all take the same batch)."""
    rng = np.random.RandomState(0)
    return rng.randn(4, 6), rng.randn(4, 3)


NUMPY_BATCHES = Case(numpy_mlp, numpy_loss, numpy_batch)


# -- The cases. ----------------------------------------------------------------------------

THIRD_PARTY: dict[str, Case] = {
    "batch_norm_spectral": Case(batch_norm_spectral, stateful_loss, stateful_batch),
    "batch_norm_spectral_state": Case(batch_norm_spectral_state, stateful_loss, stateful_batch),
    "rnn_scan": Case(rnn_scan, rnn_loss, rnn_batch),
    "dropout_mlp": Case(dropout_mlp, dropout_loss, dropout_batch, dropout=True),
    "while_sampler_bounded": Case(score_model, sampler_loss("bounded"), sampler_batch),
    "while_sampler_checkpointed": Case(score_model, sampler_loss("checkpointed"), sampler_batch),
    "kv_cache_decoder": Case(kv_cache_decoder, next_token_loss, tokens_batch),
    "own_checkpoint_block": Case(own_checkpoint_block, next_token_loss, tokens_batch),
    "own_filter_checkpoint": Case(own_filter_checkpoint, next_token_loss, tokens_batch),
}
