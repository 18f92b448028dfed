"""Offloading a Llama-like decoder: device memory, largest batch, equal losses.

A decoder-only transformer (RMSNorm, rotary attention with q/k/v/o projections, SwiGLU MLP,
layers stacked with `eqx.filter_vmap` and applied with `ox.scan`) written once with
offload_eqx annotations: every weight is an `ox.field` (so strategies may move it), and the
block names its input and its q, k, v projections with `ox.name`, declaring them with
`ox.activations(...)` as the TPU blog does (q/k/v offloaded, everything else recomputed).

The same full training step (loss, gradients, AdamW, applying the updates) is compiled
under each strategy; the state-offloading strategies `offload_state` and `hybrid` use
`ox.sequential_offload_optimizer(optax.adamw(...), layers=...)` and its `update_and_apply`
(the stacked leaves' state, gradients and parameters stream through the device one layer
at a time), the others `ox.offload_optimizer(optax.adamw(...))` and `ox.apply_updates`:

- `no_remat`: nothing recomputed, everything on the device (`"baseline"`);
- `full_remat`: every value in a layer recomputed (`"remat"`);
- `qkv_offload`: the model's own annotations: q, k, v offloaded, the rest recomputed;
- `offload_state`: parameters and optimizer state in pinned host memory, no remat;
- `hybrid`: parameters and optimizer state on host and q, k, v offloaded;
- `hybrid_whole_state`: `hybrid` with `ox.offload_optimizer`, whose update fetches the
  whole state (for comparison).

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

    JAX_PLATFORMS=cpu python experiments/transformer_offload.py --smoke   # ~2 min, idle 2 cores
    JAX_PLATFORMS=cpu python experiments/transformer_offload.py --full    # 1B, 3B, 8B: ~1 h
    ... --configs 8B --targets h100 --strategies hybrid --probes 5 --tag mine   # one slice

A TPU v5p compile of this step takes 20-40 s on an idle 2-core machine (up to 140 s when
busy), an H100 one 3-4 s (up to 20 s). What the measurements showed (jax 0.10.2):

- with `ox.offload_optimizer` the device peak of the state-offloading strategies is the
  optimizer update, run on the whole state at once (parameters, gradients and both Adam
  moments on the device together): 63.9 GB for the 8B model, whatever the batch
  (`hybrid_whole_state`). Streaming the update layer by layer removes that peak: `hybrid`
  needs 2.22 GB at batch 1 on an H100, and the activations set the peak again;
- XLA:TPU (libtpu 0.0.42) crashes compiling any step of this model with host-resident
  parameters (`offload_state`, `hybrid`), shown as "compiler crashed"; the smaller seed-like
  models compile.

Deviceless compiles need the CUDA plugin and libtpu (`pip install -e .[cuda,tpu]`); a
target whose compiler is missing is skipped with a note. Results go to
`experiments/results/transformer_offload[_TAG].{json,png}`.
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


def make_optimizer(layers: int | None = None) -> Any:
    """AdamW. With `layers`, the streaming optimizer (`ox.sequential_offload_optimizer(...,
    layers=layers)`, one layer slice of a stacked leaf on the device at a time); without,
    `ox.offload_optimizer`, which fetches the whole state for the update."""
    adamw = optax.adamw(1e-3, weight_decay=0.01)
    if layers is not None:
        return ox.sequential_offload_optimizer(adamw, layers=layers)
    return ox.offload_optimizer(adamw)


def make_step(optimizer, strategy, mesh=None) -> Callable[..., Any]:
    """The full training step under one strategy: loss, gradients, update, apply (in one
    per-layer loop when the optimizer streams: `update_and_apply`)."""

    @ox.filter_jit(strategy=strategy, donate="all", mesh=mesh)
    def step(model, opt_state, tokens):
        loss, grads = eqx.filter_value_and_grad(loss_fn)(model, tokens)
        if hasattr(optimizer, "update_and_apply"):
            model, opt_state = optimizer.update_and_apply(grads, opt_state, model)
            return model, opt_state, loss
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
    # `hybrid` with the whole-state update of `ox.offload_optimizer`, for comparison.
    "hybrid_whole_state": ox.Strategy(
        "hybrid_whole_state", params="pinned_host", optimizer="pinned_host"
    ),
}

# Strategies whose update streams the stacked leaves layer by layer; the others use
# `ox.offload_optimizer` (on the device strategies its state simply stays on the device).
STREAMING = frozenset({"offload_state", "hybrid"})


def optimizer_for(strategy: str, config: Config) -> Any:
    return make_optimizer(config.layers if strategy in STREAMING else None)


# Bytes a program may use on one chip: the H100's from the `GpuTargetConfig` that
# offload_eqx ships for it (80 GB HBM3 less what the driver reserves), the v5p's 95 GiB HBM.
CAPACITY = {"h100": 84_978_434_048, "tpu-v5p": 95 * 2**30}
GB = 1e9


def _memory_report() -> Callable[..., Any]:
    """`ox.memory_report`, wherever the package exposes it."""
    report = getattr(ox, "memory_report", None)
    if report is None:
        from offload_eqx._memory import memory_report as report
    return report


def _abstract(tree: Any) -> Any:
    """Array leaves as bare `ShapeDtypeStruct`s: no sharding, so the memory report places
    them on the target from the plan rather than on this machine's CPU."""
    return jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype) if eqx.is_array(x) else x, tree
    )


def abstract_state(config: Config, strategy: str | None = None) -> tuple[Decoder, Any]:
    """The bf16 model and its optimizer state (`ox.offload_optimizer`'s, or the streaming
    optimizer's for a strategy in `STREAMING`) as `ShapeDtypeStruct`s: nothing allocated."""
    model = _abstract(eqx.filter_eval_shape(make_decoder, config, jax.random.key(0)))
    optimizer = make_optimizer() if strategy is None else optimizer_for(strategy, config)
    opt_state = _abstract(eqx.filter_eval_shape(optimizer.init, model))
    return model, opt_state


def _out_of_memory(error: Exception) -> bool:
    text = str(error)
    return "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower()


def measure(config: Config, target: str, strategy: str, batch: int, state=None) -> dict:
    """Compile the full step for `target` at `batch` and read its memory per space.

    `fits` is false when the compiler refuses (out of memory) or the device total
    (temp + argument + output - alias) exceeds the chip's capacity.
    """
    model, opt_state = state if state is not None else abstract_state(config, strategy)
    if strategy in STREAMING and not isinstance(opt_state.inner, ox.SequentialState):
        # A state from `abstract_state(config)` (the whole-state optimizer's): rebuild it.
        model, opt_state = abstract_state(config, strategy)
    tokens = jax.ShapeDtypeStruct((batch, config.seq + 1), jnp.int32)
    step = make_step(optimizer_for(strategy, config), STRATEGIES[strategy])
    start = time.perf_counter()
    try:
        report = _memory_report()(step, model, opt_state, tokens, target=target, name=strategy)
    except Exception as error:
        # The TPU compiler refuses programs larger than HBM; at huge batches the GPU
        # compiler can fail to tile a GEMM. Either way the batch does not fit. Other
        # failures are compiler bugs (XLA:TPU crashes on the hybrid step, see the
        # README): recorded and shown, so that one strategy does not end the run.
        if not _out_of_memory(error):
            print(
                f"    {target} {strategy} batch {batch}: compile failed: "
                f"{str(error).splitlines()[0][:160]}",
                flush=True,
            )
        return {
            "error": str(error).split("\n")[0][:300],
            "out_of_memory": _out_of_memory(error),
            "batch": batch,
            "fits": False,
            "total": None,
            "host_total": None,
            "device": None,
            "host": None,
            "compile_s": time.perf_counter() - start,
        }
    return {
        "batch": batch,
        "fits": report.total <= CAPACITY[target],
        "total": report.total,
        "host_total": report.host_total,
        "device": dict(report.device),
        "host": dict(report.host),
        "compile_s": time.perf_counter() - start,
    }


def largest_batch(
    measure_at: Callable[[int], dict], capacity: int, first: dict, budget: int
) -> dict:
    """The largest batch whose step fits `capacity`, with at most `budget` more compiles.

    Device memory is nearly linear in the batch, so each probe is the batch where the line
    through the two nearest measurements meets the capacity (a secant step), kept strictly
    inside the bracket [largest fit + 1, smallest misfit - 1]; bisection takes over when
    there is no line (a refused compile). `exact` says the bracket closed.
    """
    probes = {first["batch"]: first}

    def predicted() -> int | None:
        # The line through the bracket's ends when both were measured (regula falsi),
        # otherwise through the two measurements nearest the capacity.
        measured = [(b, m["total"]) for b, m in probes.items() if m["total"] is not None]
        fits = [(b, t) for b, t in measured if probes[b]["fits"]]
        misfits = [(b, t) for b, t in measured if not probes[b]["fits"]]
        if fits and misfits:
            (b1, t1), (b2, t2) = max(fits), min(misfits)
        elif len(measured) >= 2:
            (b1, t1), (b2, t2) = sorted(measured, key=lambda bt: abs(bt[1] - capacity))[:2]
        else:
            return None
        slope = (t2 - t1) / (b2 - b1)
        return int(b1 + (capacity - t1) // slope) if slope > 0 else None

    for _ in range(budget):
        fit = [b for b, m in probes.items() if m["fits"]]
        misfit = [b for b, m in probes.items() if not m["fits"]]
        low = max(fit, default=0)
        high = min(misfit, default=None)
        if high is not None and high <= low + 1:
            break
        candidate = predicted()
        if candidate is None or candidate <= low or (high is not None and candidate >= high):
            # No usable line: double, or bisect the bracket.
            candidate = 2 * max(low, 1) if high is None else (low + high) // 2
        candidate = max(candidate, low + 1)
        if high is None:
            # Never jump more than 64x past the largest fit: a nearly flat line (memory
            # that hardly grows with the batch) would otherwise predict batches so large
            # that the GPU compiler fails to tile the GEMMs.
            candidate = min(candidate, 64 * max(low, 1))
        else:
            candidate = min(candidate, high - 1)
        probes[candidate] = measure_at(candidate)
    fit = [b for b, m in probes.items() if m["fits"]]
    misfit = [b for b, m in probes.items() if not m["fits"]]
    best = max(fit, default=0)
    return {
        "max_batch": best,
        "exact": bool(misfit) and min(misfit) == best + 1,
        # Where the line meets the capacity: the answer when the budget ran out first.
        "predicted": predicted(),
        "total_at_max": probes[best]["total"] if best else None,
        "probes": [
            {"batch": b, "fits": m["fits"], "total": m["total"], "compile_s": m["compile_s"]}
            for b, m in sorted(probes.items())
        ],
    }


def deviceless(
    config: Config,
    targets: list[str],
    budget: dict[str, int],
    strategies: dict[str, list[str]] | None = None,
) -> list[dict]:
    """Memory at batch 1 and the largest batch (with `budget[target]` more compiles), per
    target and strategy (`strategies[target]`, all by default)."""
    states = {kind: abstract_state(config, kind) for kind in ("no_remat", "hybrid")}
    rows = []
    for target in targets:
        for strategy in (strategies or {}).get(target, list(STRATEGIES)):
            state = states["hybrid" if strategy in STREAMING else "no_remat"]

            def measure_at(batch, target=target, strategy=strategy, state=state):
                return measure(config, target, strategy, batch, state)

            first = measure_at(1)
            row = {"config": config.name, "target": target, "strategy": strategy, **first}
            row["search"] = largest_batch(measure_at, CAPACITY[target], first, budget[target])
            rows.append(row)
            print(
                f"  {config.name} {target:8s} {strategy:14s} batch 1: "
                f"{_gb(first['total'])} GB device, {_gb(first['host_total'])} GB host, "
                f"{first['compile_s']:.1f} s; max batch {row['search']['max_batch']}"
                f" ({len(row['search']['probes'])} compiles)",
                flush=True,
            )
    return rows


# -- 3. equal losses on the CPU ---------------------------------------------------------


def train_on_cpu(steps: int = 4, batch: int = 4, config: Config = CONFIGS["tiny"]) -> dict:
    """Train the tiny decoder `steps` steps under each strategy from the same start, in
    float32, and compare each strategy's losses with the baseline's (`no_remat`)."""
    tokens = jax.random.randint(jax.random.key(1), (batch, config.seq + 1), 0, config.vocab)
    losses: dict[str, list[float]] = {}
    for name, strategy in STRATEGIES.items():
        optimizer = optimizer_for(name, config)
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
        name: float(np.max(np.abs(np.asarray(history) - reference) / np.abs(reference)))
        for name, history in losses.items()
    }
    return {
        "config": dataclasses.asdict(config),
        "steps": steps,
        "batch": batch,
        "losses": losses,
        "max_rel_diff": differences,
    }


# -- reporting --------------------------------------------------------------------------


def _gb(n: int | None) -> str:
    return "-" if n is None else f"{n / GB:.2f}"


def _table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    line = lambda r: "| " + " | ".join(str(c).ljust(w) for c, w in zip(r, widths)) + " |"  # noqa: E731
    return "\n".join(
        [line(header), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, rows)]
    )


def memory_table(rows: list[dict]) -> str:
    header = [
        "config",
        "target",
        "strategy",
        "temp GB",
        "argument GB",
        "output GB",
        "alias GB",
        "device total GB",
        "host total GB",
        "compile s",
    ]
    body = []
    for r in rows:
        d = r["device"] or {}
        body.append(
            [
                r["config"],
                r["target"],
                r["strategy"],
                _gb(d.get("temp")),
                _gb(d.get("argument")),
                _gb(d.get("output")),
                _gb(d.get("alias")),
                _gb(r["total"]) if "error" not in r else _failure(r),
                _gb(r["host_total"]),
                f"{r['compile_s']:.1f}",
            ]
        )
    return _table(header, body)


def _failure(row: dict) -> str:
    return "refused: out of memory" if row.get("out_of_memory") else "compiler crashed"


def _predicted(batch: int | None) -> str:
    # A flat line (a peak set by the optimizer update, not by activations) meets the
    # capacity at absurd batches; the search never probes past 64x the largest fit.
    if batch is None:
        return "-"
    return "> 1000 (flat)" if batch > 1000 else str(batch)


def batch_table(rows: list[dict]) -> str:
    header = [
        "config",
        "target",
        "capacity GB",
        "strategy",
        "max batch",
        "line predicts",
        "device GB at max",
        "compiles",
        "probes (batch: device GB, x = does not fit)",
    ]
    body = []
    for r in rows:
        s = r["search"]
        probes = ", ".join(
            f"{p['batch']}: {_gb(p['total'])}{'' if p['fits'] else ' x'}" for p in s["probes"]
        )
        best = str(s["max_batch"]) + ("" if s["exact"] else " (at least)")
        if "error" in r and not r.get("out_of_memory"):
            best = "- (compiler crashed)"
        body.append(
            [
                r["config"],
                r["target"],
                _gb(CAPACITY[r["target"]]),
                r["strategy"],
                best,
                _predicted(s["predicted"]),
                _gb(s["total_at_max"]),
                str(len(s["probes"])),
                probes,
            ]
        )
    return _table(header, body)


def loss_table(cpu: dict) -> str:
    header = ["strategy", *(f"loss {i + 1}" for i in range(cpu["steps"])), "max rel diff"]
    body = [
        [name, *(f"{x:.6f}" for x in history), f"{cpu['max_rel_diff'][name]:.1e}"]
        for name, history in cpu["losses"].items()
    ]
    return _table(header, body)


def plot(rows: list[dict], path: Path) -> None:
    """Device memory at batch 1 and the largest batch, per strategy, for each
    (config, target)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = sorted(
        {(r["config"], r["target"]) for r in rows}, key=lambda g: (list(CONFIGS).index(g[0]), g[1])
    )
    names = list(STRATEGIES)
    width = 0.8 / len(groups)
    figure, (left, right) = plt.subplots(1, 2, figsize=(13, 4.5))
    for i, group in enumerate(groups):
        by_name = {r["strategy"]: r for r in rows if (r["config"], r["target"]) == group}
        x = np.arange(len(names)) + (i - (len(groups) - 1) / 2) * width
        device = [(by_name[n]["total"] or 0) / GB if n in by_name else 0 for n in names]
        host = [(by_name[n]["host_total"] or 0) / GB if n in by_name else 0 for n in names]
        best = [by_name[n]["search"]["max_batch"] if n in by_name else 0 for n in names]
        label = f"{group[0]} {group[1]}"
        bars = left.bar(x, device, width, label=label)
        left.bar(
            x, host, width, bottom=device, color=bars[0].get_facecolor(), alpha=0.3, hatch="//"
        )
        right.bar(x, best, width, label=label)
    for axis, title in (
        (left, "device GB at batch 1 (hatched: host GB)"),
        (right, "largest batch that fits"),
    ):
        axis.set_xticks(np.arange(len(names)), names, rotation=20)
        axis.set_title(title)
        axis.legend(fontsize=8)
    figure.suptitle("Llama-like decoder, full training step (AdamW), bf16, seq 2048")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def _available(target: str) -> bool:
    from offload_eqx._targets import get_target, require_extra

    try:
        require_extra(get_target(target))
        return True
    except ImportError as error:
        print(f"skipping {target}: {str(error).split('. ')[0]}.")
        return False


def run(
    configs: list[str],
    targets: list[str],
    budget: int | dict[str, int],
    cpu_steps: int,
    strategies: dict[str, list[str]] | None = None,
    out: Path = RESULTS,
    tag: str = "",
) -> dict:
    """Compile-only memory and largest batch per (config, target, strategy), then the CPU
    equal-loss check; print the tables, write JSON and a plot into `out`.

    `budget` is the number of compiles each batch search may add after batch 1, one for
    all targets or one per target; `strategies` optionally limits the strategies compiled
    per target.
    """
    started = time.perf_counter()
    if isinstance(budget, int):
        budget = dict.fromkeys(targets, budget)
    targets = [t for t in targets if _available(t)]
    rows: list[dict] = []
    for name in configs:
        config = CONFIGS[name]
        print(
            f"{name}: {config.parameters / 1e9:.2f}B parameters, {config.layers} layers, "
            f"d {config.dim}, ffn {config.ffn}, heads {config.heads}, seq {config.seq}, "
            "bf16",
            flush=True,
        )
        rows += deviceless(config, targets, budget, strategies)
    cpu = train_on_cpu(steps=cpu_steps)
    worst = max(cpu["max_rel_diff"].values())
    assert worst < 1e-5, f"losses differ from the baseline by up to {worst:.2e}"
    elapsed = time.perf_counter() - started

    if rows:
        print("\nDevice and host memory of one training step at batch 1 (GB = 1e9 bytes)")
        print(memory_table(rows))
        print("\nLargest batch that fits one chip")
        print(batch_table(rows))
    print(
        f"\nTiny decoder on the CPU ({cpu['config']['dim']} wide, {cpu['config']['layers']} "
        f"layers, float32, batch {cpu['batch']}): losses per step"
    )
    print(loss_table(cpu))
    print(
        f"\nmax relative loss difference against no_remat: {worst:.1e}; total time {elapsed:.0f} s"
    )

    results = {
        "configs": {
            n: {**dataclasses.asdict(CONFIGS[n]), "parameters": CONFIGS[n].parameters}
            for n in configs
        },
        "strategies": {n: dataclasses.asdict(s) for n, s in STRATEGIES.items()},
        "capacity": CAPACITY,
        "deviceless": rows,
        "cpu": cpu,
        "elapsed_s": elapsed,
        "versions": {
            "jax": jax.__version__,
            "equinox": eqx.__version__,
            "optax": optax.__version__,
        },
    }
    out.mkdir(parents=True, exist_ok=True)
    stem = "transformer_offload" + (f"_{tag}" if tag else "")
    (out / f"{stem}.json").write_text(json.dumps(results, indent=1))
    if rows:
        plot(rows, out / f"{stem}.png")
    print(f"wrote {out / stem}.json" + (" and .png" if rows else ""))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    size = parser.add_mutually_exclusive_group()
    size.add_argument(
        "--smoke",
        action="store_true",
        help="1B only; two batch probes on h100, two strategies at batch 1 on tpu-v5p",
    )
    size.add_argument("--full", action="store_true", help="1B, 3B and 8B, five probes")
    parser.add_argument("--configs", nargs="+", choices=[c for c in CONFIGS if c != "tiny"])
    parser.add_argument("--targets", nargs="+", default=list(CAPACITY), choices=list(CAPACITY))
    parser.add_argument(
        "--probes", type=int, help="compiles per batch search after batch 1 (every target)"
    )
    parser.add_argument("--cpu-steps", type=int, default=4)
    parser.add_argument("--tag", default="", help="suffix of the result files")
    parser.add_argument("--strategies", nargs="+", choices=list(STRATEGIES))
    args = parser.parse_args()
    # A TPU v5p compile of this step takes 25-90 s on a 2-core machine, an H100 one 4-12 s:
    # the smoke run searches batches on the H100 with two probes (batch 2, then where the
    # line through batch 1 and 2 meets the capacity) and compiles two strategies for the
    # TPU at batch 1.
    strategies: dict[str, list[str]] | None = None
    if args.full:
        configs, budget = ["1B", "3B", "8B"], {"h100": 5, "tpu-v5p": 3}
    elif args.smoke:
        configs, budget = ["1B"], {"h100": 2, "tpu-v5p": 0}
        strategies = {"tpu-v5p": ["full_remat", "qkv_offload"]}
    else:
        configs, budget = ["1B"], {"h100": 4, "tpu-v5p": 2}
    if args.strategies:
        strategies = dict.fromkeys(args.targets, args.strategies)
    run(
        args.configs or configs,
        args.targets,
        args.probes if args.probes is not None else budget,
        args.cpu_steps,
        strategies=strategies,
        tag=args.tag,
    )


if __name__ == "__main__":
    main()
