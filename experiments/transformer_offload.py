"""Offloading a Llama-like decoder: device memory, largest batch, equal losses.

A decoder-only transformer (RMSNorm, rotary attention with q/k/v/o projections, SwiGLU MLP,
layers stacked with `eqx.filter_vmap` and applied with `ox.scan`) written once with
offload_eqx annotations: every weight is an `ox.field` (so strategies may move it), and the
block names its input and its q, k, v projections with `ox.name`, declaring them with
`ox.activations(...)` as the TPU blog does (q/k/v offloaded, everything else recomputed).

The same full training step (loss, gradients, `ox.offload_optimizer(optax.adamw(...))`,
`ox.apply_updates`) is compiled under each strategy:

- `no_remat`: nothing recomputed, everything on the device (`"baseline"`);
- `full_remat`: every value in a layer recomputed (`"remat"`);
- `qkv_offload`: the model's own annotations: q, k, v offloaded, the rest recomputed;
- `offload_state`: parameters and optimizer state in pinned host memory, no remat;
- `hybrid`: parameters and optimizer state on host and q, k, v offloaded.

Three measurements:

1. compile-only (deviceless) for an H100 and a TPU v5p at 1B to 8B parameters in bf16,
   from `jax.ShapeDtypeStruct`s (`eqx.filter_eval_shape`; nothing is allocated): device and
   host bytes per memory space for each strategy;
2. the largest batch that fits the chip under each strategy (H100 80 GB, TPU v5p 95 GiB),
   found with compiles: a line through two measured batches predicts it, bisection confirms
   it, with a bounded number of compiles;
3. a tiny version of the model trained for a few steps on the CPU under each strategy: the
   losses must equal the baseline's (offloading and recomputing change where values live,
   never what they are).

    JAX_PLATFORMS=cpu python experiments/transformer_offload.py --smoke   # ~2-3 minutes
    JAX_PLATFORMS=cpu python experiments/transformer_offload.py --full    # 1B, 3B, 8B

Deviceless compiles need the CUDA plugin and libtpu (`pip install -e .[cuda,tpu]`); a
target whose compiler is missing is skipped with a note. Results go to
`experiments/results/transformer_offload.{json,png}`.
"""

import argparse
import dataclasses
import json
import math
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v5p-8")
os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import offload_eqx as ox  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"

# -- the model --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Config:
    """Shape of the decoder. Heads are full multi-head attention (no grouped keys)."""

    name: str
    vocab: int
    dim: int
    ffn: int
    layers: int
    heads: int
    seq: int

    @property
    def parameters(self) -> int:
        per_layer = 4 * self.dim * self.dim + 3 * self.dim * self.ffn + 2 * self.dim
        return self.layers * per_layer + 2 * self.vocab * self.dim + self.dim


CONFIGS = {
    # Llama-3.2-1B-like widths, full multi-head attention: 1.2B parameters.
    "1B": Config("1B", vocab=32000, dim=2048, ffn=8192, layers=16, heads=16, seq=2048),
    # Llama-3.2-3B-like: 3.4B parameters.
    "3B": Config("3B", vocab=32000, dim=3072, ffn=8192, layers=28, heads=24, seq=2048),
    # Llama-2/3-7B/8B-like (the facts file's 7.8B decoder plus embeddings): 8.0B parameters.
    "8B": Config("8B", vocab=32000, dim=4096, ffn=14336, layers=32, heads=32, seq=2048),
    # Trained on the CPU.
    "tiny": Config("tiny", vocab=256, dim=64, ffn=128, layers=3, heads=4, seq=32),
}


class RMSNorm(eqx.Module):
    """Root-mean-square normalisation, computed in float32 whatever the storage dtype."""

    weight: jax.Array = ox.field(memory="device")
    eps: float = eqx.field(static=True, default=1e-6)

    def __call__(self, x):
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (normed * self.weight.astype(jnp.float32)).astype(x.dtype)


def rotary(x, positions):
    """Rotary position embedding over the last axis of `x` (batch, seq, heads, head_dim)."""
    half = x.shape[-1] // 2
    frequencies = 1.0 / (10000.0 ** (jnp.arange(half, dtype=jnp.float32) / half))
    angles = positions[:, None].astype(jnp.float32) * frequencies[None, :]  # (seq, half)
    sin = jnp.sin(angles)[None, :, None, :].astype(x.dtype)
    cos = jnp.cos(angles)[None, :, None, :].astype(x.dtype)
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)


class Block(eqx.Module):
    """One decoder layer. Stacked along axis 0 by `eqx.filter_vmap`, applied by `ox.scan`."""

    attention_norm: RMSNorm
    wq: jax.Array = ox.field(memory="device")
    wk: jax.Array = ox.field(memory="device")
    wv: jax.Array = ox.field(memory="device")
    wo: jax.Array = ox.field(memory="device")
    mlp_norm: RMSNorm
    w_gate: jax.Array = ox.field(memory="device")
    w_up: jax.Array = ox.field(memory="device")
    w_down: jax.Array = ox.field(memory="device")
    heads: int = eqx.field(static=True, default=1)
    # The TPU blog's choice: q, k, v projections go to host memory after the forward pass
    # and come back for the backward pass; every other value of the layer is recomputed.
    # The layer input is named too, so a strategy can offload it; by default it is
    # recomputed, which costs nothing (the scan keeps the carry anyway).
    activations: ox.Activations = ox.activations(
        block_input="remat", q="offload", k="offload", v="offload"
    )

    def __call__(self, x):
        x = ox.name(x, "block_input")
        batch, seq, dim = x.shape
        head_dim = dim // self.heads
        h = self.attention_norm(x)
        q = ox.name(h @ self.wq, "q")
        k = ox.name(h @ self.wk, "k")
        v = ox.name(h @ self.wv, "v")
        split = (batch, seq, self.heads, head_dim)
        positions = jnp.arange(seq)
        q = rotary(q.reshape(split), positions)
        k = rotary(k.reshape(split), positions)
        v = v.reshape(split)
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) / math.sqrt(head_dim)
        causal = jnp.tril(jnp.ones((seq, seq), dtype=bool))
        scores = jnp.where(causal, scores, jnp.finfo(jnp.float32).min)
        weights = jax.nn.softmax(scores, axis=-1).astype(x.dtype)
        attended = jnp.einsum("bhqk,bkhd->bqhd", weights, v).reshape(batch, seq, dim)
        x = x + attended @ self.wo
        h = self.mlp_norm(x)
        return x + (jax.nn.silu(h @ self.w_gate) * (h @ self.w_up)) @ self.w_down


class Embedding(eqx.Module):
    """Token embedding; called through `ox.checkpoint` so that it may live on the host."""

    weight: jax.Array = ox.field(memory="device")

    def __call__(self, tokens):
        return jnp.take(self.weight, tokens, axis=0)


class Head(eqx.Module):
    """Final norm and unembedding, returning float32 logits."""

    norm: RMSNorm
    weight: jax.Array = ox.field(memory="device")

    def __call__(self, x):
        return (self.norm(x) @ self.weight).astype(jnp.float32)


class Decoder(eqx.Module):
    embedding: Embedding
    layers: Block  # every leaf has a leading layer axis
    head: Head

    def __call__(self, tokens):
        # Embedding and head run in their own regions: a region is where host-resident
        # weights are fetched, so they can be offloaded like the layers' weights.
        x = ox.checkpoint(self.embedding, tokens)
        x = ox.scan(self.layers, x)
        return ox.checkpoint(self.head, x)


def make_decoder(config: Config, key, dtype=jnp.bfloat16) -> Decoder:
    """Initialise a decoder (scaled normal weights, unit norms) in `dtype`."""
    d, f = config.dim, config.ffn

    def normal(key, shape, fan_in):
        return (jax.random.normal(key, shape, jnp.float32) / math.sqrt(fan_in)).astype(dtype)

    def make_block(key):
        keys = jax.random.split(key, 7)
        return Block(
            attention_norm=RMSNorm(jnp.ones((d,), dtype)),
            wq=normal(keys[0], (d, d), d),
            wk=normal(keys[1], (d, d), d),
            wv=normal(keys[2], (d, d), d),
            wo=normal(keys[3], (d, d), d),
            mlp_norm=RMSNorm(jnp.ones((d,), dtype)),
            w_gate=normal(keys[4], (d, f), d),
            w_up=normal(keys[5], (d, f), d),
            w_down=normal(keys[6], (f, d), f),
            heads=config.heads,
        )

    k_embed, k_layers, k_head = jax.random.split(key, 3)
    return Decoder(
        embedding=Embedding(normal(k_embed, (config.vocab, d), 1)),
        layers=eqx.filter_vmap(make_block)(jax.random.split(k_layers, config.layers)),
        head=Head(RMSNorm(jnp.ones((d,), dtype)), normal(k_head, (d, config.vocab), d)),
    )


def loss_fn(model: Decoder, tokens):
    """Next-token cross-entropy, in float32."""
    logits = model(tokens[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


def make_optimizer() -> optax.GradientTransformation:
    return ox.offload_optimizer(optax.adamw(1e-3, weight_decay=0.01))


def make_step(optimizer, strategy, mesh=None) -> Callable[..., Any]:
    """The full training step under one strategy: loss, gradients, update, apply."""

    @ox.filter_jit(strategy=strategy, donate="all", mesh=mesh)
    def step(model, opt_state, tokens):
        loss, grads = eqx.filter_value_and_grad(loss_fn)(model, tokens)
        updates, opt_state = optimizer.update(grads, opt_state, model)
        return ox.apply_updates(model, updates), opt_state, loss

    return step


# -- strategies -------------------------------------------------------------------------

STRATEGIES: dict[str, ox.Strategy] = {
    "no_remat": ox.STRATEGIES["baseline"],
    "full_remat": ox.STRATEGIES["remat"],
    # The model's own activation annotations (q, k, v offloaded), every leaf on the device.
    "qkv_offload": ox.Strategy("qkv_offload", params="device", optimizer="device"),
    "offload_state": ox.Strategy(
        "offload_state", params="pinned_host", optimizer="pinned_host", activations="save"
    ),
    # Everything together: state on the host, q/k/v offloaded as annotated.
    "hybrid": ox.Strategy("hybrid", params="pinned_host", optimizer="pinned_host"),
}


# -- 3. equal losses on the CPU ---------------------------------------------------------


def train_on_cpu(steps: int = 4, batch: int = 4, config: Config = CONFIGS["tiny"]) -> dict:
    """Train the tiny decoder `steps` steps under each strategy from the same start."""
    tokens = jax.random.randint(jax.random.key(1), (batch, config.seq + 1), 0, config.vocab)
    optimizer = make_optimizer()
    losses: dict[str, list[float]] = {}
    for name, strategy in STRATEGIES.items():
        # A fresh model per strategy: the step donates its arguments, so the buffers of a
        # shared model would be gone after the first strategy.
        model = make_decoder(config, jax.random.key(0), dtype=jnp.float32)
        opt_state = optimizer.init(model)
        step = make_step(optimizer, strategy)
        history = []
        for _ in range(steps):
            model, opt_state, loss = step(model, opt_state, tokens)
            history.append(float(loss))
        losses[name] = history
    reference = np.asarray(losses["no_remat"])
    differences = {
        name: float(np.max(np.abs(np.asarray(h) - reference) / np.abs(reference)))
        for name, h in losses.items()
    }
    return {"config": dataclasses.asdict(config), "losses": losses, "max_rel_diff": differences}


if __name__ == "__main__":
    print(train_on_cpu())
