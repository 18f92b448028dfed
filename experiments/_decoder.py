"""The Llama-like decoder of `transformer_offload.py`, written once with offload_eqx annotations.

RMSNorm, rotary attention with q/k/v/o projections (computed by `jax.nn.dot_product_attention`,
with cuDNN's fused kernel on GPU targets, or by Pallas splash attention on TPU targets:
`Config.attention`, `attention_for(target)`) and a SwiGLU MLP; the layers are stacked
with `eqx.filter_vmap` and applied with `ox.scan`, the embedding and the head each called
through `ox.checkpoint`. Every weight is an `ox.field`, so a strategy may move it; the block
names its input and its q, k, v projections with `ox.name` and declares them with
`ox.activations(...)` as the TPU blog does (q/k/v offloaded, everything else recomputed).

Also here: the configurations (1B to 70B, and a tiny one for the CPU), the strategies the
experiment compares, the AdamW optimizer for each, the full training step, and the model
and optimizer state as `jax.ShapeDtypeStruct`s. Public API only, importable from tests:

    sys.path.insert(0, "experiments"); import _decoder
"""

import contextlib
import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

import offload_eqx as ox

# -- the model --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Config:
    """Shape of the decoder. `kv_heads` below `heads` is grouped-query attention (each
    key/value head serves `heads // kv_heads` query heads); by default every head has its
    own keys and values."""

    name: str
    vocab: int
    dim: int
    ffn: int
    layers: int
    heads: int
    seq: int
    kv_heads: int | None = None
    # How attention is computed (`ATTENTION`); `attention_for(target)` picks the fused
    # kernel a user would call there.
    attention: str = "xla"

    @property
    def kv_dim(self) -> int:
        """Width of the k and v projections."""
        return self.dim // self.heads * (self.kv_heads or self.heads)

    @property
    def parameters(self) -> int:
        attention = 2 * self.dim * self.dim + 2 * self.dim * self.kv_dim
        per_layer = attention + 3 * self.dim * self.ffn + 2 * self.dim
        return self.layers * per_layer + 2 * self.vocab * self.dim + self.dim


CONFIGS = {
    # Llama-3.2-1B-like widths, full multi-head attention: 1.2B parameters.
    "1B": Config("1B", vocab=32000, dim=2048, ffn=8192, layers=16, heads=16, seq=2048),
    # Llama-3.2-3B-like: 3.4B parameters.
    "3B": Config("3B", vocab=32000, dim=3072, ffn=8192, layers=28, heads=24, seq=2048),
    # Llama-2/3-7B/8B-like (the facts file's 7.8B decoder plus embeddings): 8.0B parameters.
    "8B": Config("8B", vocab=32000, dim=4096, ffn=14336, layers=32, heads=32, seq=2048),
    # Llama-2-13B's shape (the TPU blog's MaxText run), untied embeddings: 13.0B parameters.
    "13B": Config("13B", vocab=32000, dim=5120, ffn=13824, layers=40, heads=40, seq=2048),
    # LLaMA-33B's shape (Touvron et al. 2023, "LLaMA: Open and Efficient Foundation
    # Language Models", table 2: the "30B" model; dim 6656, 52 heads, 60 layers, SwiGLU
    # hidden 17920, 2,048-token context): 32.5B parameters.
    "30B": Config("30B", vocab=32000, dim=6656, ffn=17920, layers=60, heads=52, seq=2048),
    # Llama-2-70B's shape: 64 query heads sharing 8 key/value heads, 68.98B parameters.
    "70B": Config(
        "70B", vocab=32000, dim=8192, ffn=28672, layers=80, heads=64, seq=4096, kv_heads=8
    ),
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


# -- attention --------------------------------------------------------------------------

# "xla": `jax.nn.dot_product_attention` as XLA fuses it (what runs on a CPU); "cudnn": the
# same call with cuDNN's fused kernel (GPU targets); "splash": Pallas splash attention
# (TPU targets, as MaxText calls it); "manual": the scores written out in float32, the
# decoder's attention before it called a kernel (kept for comparison).
ATTENTION = ("xla", "cudnn", "splash", "manual")


def attention_for(target: str) -> str:
    """The attention kernel a user calls on `target`: cuDNN on GPUs, splash attention on
    TPUs, XLA's own elsewhere."""
    platform = ox.TARGETS[target].platform
    return {"cuda": "cudnn", "tpu": "splash"}.get(platform, "xla")


def with_attention(config: "Config", target: str) -> "Config":
    return dataclasses.replace(config, attention=attention_for(target))


@functools.cache
def _splash_kernel(heads: int, seq: int):
    from jax.experimental.pallas.ops.tpu.splash_attention import (
        splash_attention_kernel as splash,
        splash_attention_mask as masks,
    )

    # Built concretely even when first asked for inside a trace: the kernel is cached, and
    # its block-mask arrays made under a trace would be that trace's values, leaked.
    with jax.ensure_compile_time_eval():
        return _make_splash_kernel(heads, seq, splash, masks)


def _make_splash_kernel(heads: int, seq: int, splash: Any, masks: Any):
    mask = masks.MultiHeadMask([masks.CausalMask((seq, seq)) for _ in range(heads)])
    block = min(512, seq)
    sizes = splash.BlockSizes(
        block_q=block, block_kv=block, block_kv_compute=block, block_q_dkv=block,
        block_kv_dkv=block, block_kv_dkv_compute=block, block_q_dq=block, block_kv_dq=block,
    )  # fmt: skip
    return splash.make_splash_mha(mask, head_shards=1, q_seq_shards=1, block_sizes=sizes)


def _manual_attention(q, k, v):
    head_dim, seq = q.shape[-1], q.shape[1]
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) / math.sqrt(head_dim)
    causal = jnp.tril(jnp.ones((seq, seq), dtype=bool))
    scores = jnp.where(causal, scores, jnp.finfo(jnp.float32).min)
    weights = jax.nn.softmax(scores, axis=-1).astype(q.dtype)
    return jnp.einsum("bhqk,bkhd->bqhd", weights, v)


def attention(q, k, v, kind: str):
    """Causal attention of `q` (batch, seq, heads, head_dim) over `k`, `v` (batch, seq,
    kv_heads, head_dim), computed as `kind` says (`ATTENTION`)."""
    heads, kv_heads = q.shape[2], k.shape[2]
    if kind in ("xla", "cudnn"):  # grouped-query attention natively
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=kind)
    if kv_heads != heads:  # each k/v head serves a group of query heads
        k = jnp.repeat(k, heads // kv_heads, axis=2)
        v = jnp.repeat(v, heads // kv_heads, axis=2)
    if kind == "manual":
        return _manual_attention(q, k, v)
    if kind != "splash":
        raise ValueError(f"attention {kind!r}; expected one of {ATTENTION}")
    # Splash takes heads first and does not scale the scores itself.
    q = q / jnp.asarray(math.sqrt(q.shape[-1]), q.dtype)
    q, k, v = (x.transpose(0, 2, 1, 3) for x in (q, k, v))
    out = _by_batch_shard(jax.vmap(_splash_kernel(heads, q.shape[2])))(q, k, v)
    return out.transpose(0, 2, 1, 3)


def _by_batch_shard(kernel: Callable) -> Callable:
    """`kernel` on each device's sequences when a mesh is in context (as `make_step`
    sets one): XLA cannot partition a Pallas kernel, so it runs in a `shard_map` with the
    batch split over every mesh axis, as the tokens are (as MaxText calls splash
    attention). Off a mesh, `kernel` itself."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return kernel
    batch = P(mesh.axis_names)
    return jax.shard_map(kernel, mesh=mesh, in_specs=batch, out_specs=batch, check_vma=False)


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
    kv_heads: int | None = eqx.field(static=True, default=None)  # None: as many as `heads`
    attention: str = eqx.field(static=True, default="xla")  # one of `ATTENTION`
    # The TPU blog's choice: q, k, v projections go to host memory after the forward pass
    # and come back for the backward pass; every other value of the layer is recomputed.
    # The layer input is named too, so a strategy can offload it (MaxText's
    # `decoder_layer_input=offload`); by default "remat", which for a layer's input
    # recomputes nothing: `ox.scan` keeps it on the device as the layer's residual.
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
        kv_heads = self.kv_heads or self.heads
        positions = jnp.arange(seq)
        q = rotary(q.reshape(batch, seq, self.heads, head_dim), positions)
        k = rotary(k.reshape(batch, seq, kv_heads, head_dim), positions)
        v = v.reshape(batch, seq, kv_heads, head_dim)
        attended = attention(q, k, v, self.attention).reshape(batch, seq, dim)
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
    d, f, kv = config.dim, config.ffn, config.kv_dim

    def normal(key, shape, fan_in):
        return (jax.random.normal(key, shape, jnp.float32) / math.sqrt(fan_in)).astype(dtype)

    def make_block(key):
        keys = jax.random.split(key, 7)
        return Block(
            attention_norm=RMSNorm(jnp.ones((d,), dtype)),
            wq=normal(keys[0], (d, d), d),
            wk=normal(keys[1], (d, kv), d),
            wv=normal(keys[2], (d, kv), d),
            wo=normal(keys[3], (d, d), d),
            mlp_norm=RMSNorm(jnp.ones((d,), dtype)),
            w_gate=normal(keys[4], (d, f), d),
            w_up=normal(keys[5], (d, f), d),
            w_down=normal(keys[6], (f, d), f),
            heads=config.heads,
            kv_heads=config.kv_heads,
            attention=config.attention,
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


def make_optimizer(
    layers: int | None = None, update_on: str = "device"
) -> optax.GradientTransformationExtraArgs:
    """AdamW with its state offloaded. With `layers`, the update streams stacked leaves one
    layer slice at a time (`ox.offload_optimizer(..., stream="layer", layers=layers)`);
    without, the update fetches the whole state (`ox.offload_optimizer(adamw)`), or with
    `update_on="host"` runs on the host, where the state stays
    (`ox.offload_optimizer(adamw, update_on="host")`)."""
    adamw = optax.adamw(1e-3, weight_decay=0.01)
    if layers is not None:
        return ox.offload_optimizer(adamw, stream="layer", layers=layers)
    return ox.offload_optimizer(adamw, update_on=update_on)


def make_step(optimizer, strategy, mesh=None) -> Callable[..., Any]:
    """The full training step under one strategy: loss, gradients, update, apply.

    `ox.update_and_apply` runs the update and applies it in one per-layer loop when the
    optimizer streams by layer (parameters are never fetched whole), and is `update` then
    `ox.apply_updates` otherwise. On a `mesh` the loss is traced with the mesh in context
    (`jax.sharding.use_abstract_mesh`), so that a Pallas kernel runs per device."""

    @ox.filter_jit(strategy=strategy, donate="all", mesh=mesh)
    def step(model, opt_state, tokens):
        with _mesh_context(mesh):
            loss, grads = eqx.filter_value_and_grad(loss_fn)(model, tokens)
        model, opt_state = ox.update_and_apply(optimizer, grads, opt_state, model)
        return model, opt_state, loss

    return step


def _mesh_context(mesh: Any) -> Any:
    if mesh is None:
        return contextlib.nullcontext()
    return jax.sharding.use_abstract_mesh(getattr(mesh, "abstract_mesh", mesh))


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
    # `hybrid` with the whole-state update of `ox.offload_optimizer`, for comparison.
    "hybrid_whole_state": ox.Strategy(
        "hybrid_whole_state", params="pinned_host", optimizer="pinned_host"
    ),
    # `hybrid` with the update on the host (`ox.offload_optimizer(adamw,
    # update_on="host")`): the state never crosses the link, the host-resident parameters
    # are updated on the host, so only the gradients move. XLA:TPU refuses it.
    "hybrid_host_update": ox.Strategy(
        "hybrid_host_update", params="pinned_host", optimizer="pinned_host"
    ),
}

# Strategies whose update streams the stacked leaves layer by layer; the others use
# `ox.offload_optimizer` (on the device strategies its state simply stays on the device).
STREAMING = frozenset({"offload_state", "hybrid"})
# Strategies whose update runs on the host.
HOST_UPDATE = frozenset({"hybrid_host_update"})


def _optimizer_kind(strategy: str | None) -> str:
    if strategy in STREAMING:
        return "layer"
    return "host" if strategy in HOST_UPDATE else "whole"


def _make(kind: str, config: Config) -> Any:
    if kind == "layer":
        return make_optimizer(config.layers)
    return make_optimizer(update_on="host" if kind == "host" else "device")


def optimizer_for(strategy: str, config: Config) -> Any:
    return _make(_optimizer_kind(strategy), config)


def _abstract(tree: Any) -> Any:
    """Array leaves as bare `ShapeDtypeStruct`s: no sharding, so the memory report places
    them on the target from the plan rather than on this machine's CPU."""
    return jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype) if eqx.is_array(x) else x, tree
    )


def abstract_state(config: Config, strategy: str | None = None) -> tuple[Decoder, Any]:
    """The bf16 model and the optimizer state of `strategy` (the layer-streaming
    optimizer's for a strategy in `STREAMING`, the host update's for one in `HOST_UPDATE`,
    the whole-state one's otherwise) as `ShapeDtypeStruct`s: nothing allocated."""
    return _abstract_state(config, _optimizer_kind(strategy))


@functools.cache
def _abstract_state(config: Config, kind: str) -> tuple[Decoder, Any]:
    # Cached: every strategy and batch probe of one configuration reuses them.
    model = _abstract(eqx.filter_eval_shape(make_decoder, config, jax.random.key(0)))
    opt_state = _abstract(eqx.filter_eval_shape(_make(kind, config).init, model))
    return model, opt_state
