"""The cases of `host_update.py`: one size, layout and kind of moments, every candidate
built on its own copy of the same parameters, timed in interleaved rounds."""

import os
import sys
import time
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

import offload_eqx as ox

LR, B1, B2, EPS, WD = 1e-4, 0.9, 0.999, 1e-8, 1e-4


def time_rounds(candidates: dict[str, Callable[[], Any]], rounds: int) -> dict[str, float]:
    """Each candidate's median seconds over `rounds`, interleaved, the order rotated; in
    each round a candidate's second of two calls in a row."""
    names = list(candidates)
    for name in names:  # compile and touch every buffer once
        candidates[name]()
    samples: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            # One call untimed first: it wakes the candidate's threads and waits out the
            # last candidate's (OpenMP's spin a while after each loop, holding a core),
            # so the timed call is the candidate in its steady state, as in training.
            candidates[name]()
            start = time.perf_counter()
            candidates[name]()
            samples[name].append(time.perf_counter() - start)
    return {name: sorted(s)[len(s) // 2] for name, s in samples.items()}


sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "experiments"))

TRIAD_BYTES = 12  # per float32 element: read b and c, write a
MINIMUM_BYTES = {"float32": 28, "bfloat16": 14}  # per parameter, one in-place pass


def _leaf_shapes(size: int, layout: str) -> list[tuple[int, ...]]:
    if layout == "decoder":
        return _decoder_shapes(size)
    count = int(layout)
    width = 1024
    rows = max(1, size // count // width)
    return [(rows, width)] * count


def _decoder_shapes(size: int) -> list[tuple[int, ...]]:
    """The experiments' decoder (vocabulary 32,000, 4 stacked blocks, ffn 4 x dim) at
    the width whose parameter count is nearest `size`."""
    from _decoder import Config, make_decoder

    def config(dim: int) -> Any:
        return Config("bench", vocab=32000, dim=dim, ffn=4 * dim, layers=4, heads=dim // 64, seq=64)

    dim = min(range(64, 8192, 64), key=lambda d: abs(config(d).parameters - size))
    model = eqx.filter_eval_shape(make_decoder, config(dim), jax.random.key(0))
    return [tuple(leaf.shape) for leaf in jax.tree_util.tree_leaves(model)]


class Params(eqx.Module):
    leaves: list


def _arrays(shapes: list, seed: int, scale: float, dtype: Any) -> list:
    rng = np.random.default_rng(seed)
    return [jnp.asarray(rng.standard_normal(s, np.float32) * scale).astype(dtype) for s in shapes]


def _adamw(moments: str) -> optax.GradientTransformation:
    return optax.adamw(LR, b1=B1, b2=B2, eps=EPS, weight_decay=WD)


def _ox_candidate(shapes: list, moments: str) -> tuple:
    """The optimizer guide's recipe: float32 masters (or, with bfloat16 moments, AdamW on
    the bfloat16 parameters themselves), updated on the host, in place."""
    masters = moments == "float32"
    opt = ox.offload_optimizer(
        _adamw(moments), update_on="host", master_dtype=jnp.float32 if masters else None
    )
    model = Params(_arrays(shapes, 0, 0.02, jnp.float32 if masters else jnp.bfloat16))
    state = opt.init(model)
    model = jax.tree_util.tree_map(lambda w: w.astype(jnp.bfloat16), model)
    grads = Params(_arrays(shapes, 1, 1e-3, jnp.bfloat16))

    @ox.filter_jit(donate="all-except-first")
    def step(grads, model, state):
        return ox.update_and_apply(opt, grads, state, model)

    cell = [model, state]

    def run():
        cell[0], cell[1] = step(grads, cell[0], cell[1])
        jax.block_until_ready(cell)

    return run, step, (grads, model, state)


def _jit_candidate(shapes: list, moments: str) -> Any:
    """`optax.adamw` under a plain `jax.jit`, the state (and masters) donated."""
    masters = moments == "float32"
    tx = _adamw(moments)
    wide = jnp.float32 if masters else jnp.bfloat16
    master = _arrays(shapes, 0, 0.02, wide)
    state = tx.init(master)
    params = [m.astype(jnp.bfloat16) for m in master]
    grads = _arrays(shapes, 1, 1e-3, jnp.bfloat16)

    @jax.jit
    def update(grads, params, master, state):
        updates, state = tx.update([g.astype(wide) for g in grads], state, master)
        master = optax.apply_updates(master, updates)
        return [m.astype(jnp.bfloat16) for m in master], master, state

    donated = jax.jit(update.__wrapped__, donate_argnums=(1, 2, 3))
    cell = [params, master, state]

    def run():
        cell[:] = donated(grads, *cell)
        jax.block_until_ready(cell)

    return run


def _fused_candidate(lib: Any, shapes: list) -> Any:
    """The C loop: one in-place pass per leaf, float32 masters and moments."""
    sizes = [int(np.prod(s)) for s in shapes]
    rng = np.random.default_rng(2)
    grads = [rng.integers(0x3A00, 0x3B00, n, dtype=np.uint16) for n in sizes]
    state = [[np.abs(rng.standard_normal(n, np.float32)) * 1e-3 for n in sizes] for _ in range(3)]
    params = [np.zeros(n, np.uint16) for n in sizes]
    count = [0]

    def run():
        count[0] += 1
        c1, c2 = 1 - B1 ** count[0], 1 - B2 ** count[0]
        for i, n in enumerate(sizes):
            mu, nu, master = (s[i].ctypes.data for s in state)
            lib.adamw_bf16(
                n, grads[i].ctypes.data, mu, nu, master, params[i].ctypes.data,
                LR, B1, B2, EPS, WD, c1, c2,
            )  # fmt: skip

    return run


def _deepspeed_candidate(shapes: list) -> Any:
    """DeepSpeed's CPU-Adam (AdamW mode) on float32 parameters and gradients, or None."""
    try:
        import torch
        from deepspeed.ops.adam import DeepSpeedCPUAdam
    except Exception:  # not installed, or its op failed to build
        return None
    params = [torch.nn.Parameter(torch.randn(*s) * 0.02) for s in shapes]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    opt = DeepSpeedCPUAdam(params, lr=LR, betas=(B1, B2), eps=EPS, weight_decay=WD)
    return opt.step


def _triad(lib: Any, elements: int) -> Any:
    a, b, c = (np.ones(elements, np.float32) for _ in range(3))
    return lambda: lib.triad(elements, a.ctypes.data, b.ctypes.data, c.ctypes.data, 1.5)


def run_case(size: int, layout: str, moments: str, rounds: int, lib: Any, estimate: bool):
    shapes = _leaf_shapes(size, layout)
    params = sum(int(np.prod(s)) for s in shapes)
    ox_run, step, args = _ox_candidate(shapes, moments)
    candidates = {"ox": ox_run, "jax.jit": _jit_candidate(shapes, moments)}
    if lib is not None:
        candidates["triad"] = _triad(lib, max(params, 1 << 22))
        if moments == "float32":
            candidates["fused C"] = _fused_candidate(lib, shapes)
    if moments == "float32" and (deepspeed := _deepspeed_candidate(shapes)) is not None:
        candidates["deepspeed"] = deepspeed
    seconds = time_rounds(candidates, rounds)
    row: dict[str, Any] = {
        "params": params,
        "leaves": f"{layout} ({len(shapes)})" if layout == "decoder" else layout,
        "moments": moments,
        "load": os.getloadavg()[0],
    }
    row.update({name: s * 1e3 for name, s in seconds.items() if name != "triad"})
    for peer in ("fused C", "jax.jit", "deepspeed"):
        if peer in seconds:
            row[f"ox / {peer}"] = seconds["ox"] / seconds[peer]
    if "triad" in seconds:
        bandwidth = TRIAD_BYTES * max(params, 1 << 22) / seconds["triad"]
        roofline = MINIMUM_BYTES[moments] * params / bandwidth
        row["triad GB/s"] = bandwidth / 1e9
        row["roofline fraction"] = roofline / seconds["ox"]
        if "fused C" in seconds:
            row["fused roofline fraction"] = roofline / seconds["fused C"]
    if estimate:
        predicted = ox.estimate(step, *args, target="cpu").seconds
        row["estimate"] = predicted * 1e3
        row["estimate / ox"] = predicted / seconds["ox"]
    return row
