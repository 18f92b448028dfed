"""Llama-2-13B on one H100 at the largest batch each plan allows (`planner.py --full`).

The plan `ox.fit` picks for Llama-2-13B's shape at its context length (sequences of 4,096
tokens), on one H100 with its host memory, is grown to the largest batch that compiles
within the device (`ox.max_batch` for that plan), and re-planned there (a larger batch can
change what is worth saving); beside it, each preset at its own largest batch: `hybrid`
(`everything_offloaded`), ZeRO-Offload's placement (`host_update`: parameters and state
on the host, updated there), and MaxText's device-only presets, which do not fit at batch
1. Every number is `ox.estimate`'s prediction from the compiled program, except
ZeRO-Offload's, which is the one its paper publishes.
"""

import dataclasses
import time
from typing import Any

import jax
import jax.numpy as jnp
from _decoder import CONFIGS, abstract_state, make_step, optimizer_for, with_attention
from _planner_fraction import fraction
from _report import format_table

import offload_eqx as ox

SEQ = 4096  # Llama-2's context
TARGET = "h100"
GB = 1e9
# Published (Ren et al., "ZeRO-Offload: Democratizing Billion-Scale Model Training",
# USENIX ATC'21): 40 TFLOP/s per V100 training a 10B-parameter GPT-2-like model on one
# GPU. The V100's fp16 tensor-core peak (SXM2) is 125 TFLOP/s.
ZERO_OFFLOAD = {"tflops": 40.0, "peak_tflops": 125.0, "model": "10B", "device": "V100"}


def _setup() -> tuple[Any, Any, Any]:
    """The config, the optimizer (streamed by layer on the device, one host computation
    under a plan with `update="host"`) and the argument maker."""
    # Attention as a user calls it on the H100: cuDNN's fused kernel.
    config = with_attention(dataclasses.replace(CONFIGS["13B"], seq=SEQ), TARGET)
    model, opt_state = abstract_state(config, "hybrid")

    def make_args(batch: int) -> tuple:
        return (model, opt_state, jax.ShapeDtypeStruct((batch, SEQ + 1), jnp.int32))

    return config, optimizer_for("hybrid", config), make_args


def _throughput(name: str, strategy: ox.Strategy, estimate: Any, batch: int, setup) -> dict:
    config, optimizer, make_args = setup
    step, args = make_step(optimizer, strategy), make_args(batch)
    tokens = batch * SEQ
    return {
        "plan": name,
        "strategy": strategy.name,
        "fraction": fraction(strategy, step, args, config.layers),
        "batch": batch,
        "tokens": tokens,
        "seconds": estimate.seconds,
        "tokens_per_s": tokens / estimate.seconds,
        "tflops": (estimate.flops - estimate.recompute_flops) / estimate.seconds / 1e12,
        "mfu": estimate.mfu(),
        "mfu_6nt": estimate.mfu(6 * config.parameters * tokens),
        "device": estimate.device_bytes,
        "host": estimate.host_bytes,
        "moved": estimate.h2d_bytes + estimate.d2h_bytes,
        "error": None,
    }


def _largest_batch(strategy: ox.Strategy, setup: tuple) -> int | str:
    """The largest batch `strategy` fits in on one H100, or why it fits none."""
    _, optimizer, make_args = setup
    try:
        return ox.max_batch(make_step(optimizer, strategy), make_args, target=TARGET)
    except (ValueError, RuntimeError) as error:
        first = str(error).split(". ")[0].removeprefix("ox.max_batch: `step` ")
        return first.split(" (")[0][:80]


def _preset(name: str, strategy: ox.Strategy, setup: tuple) -> dict:
    """A preset at the largest batch it fits in, and its predicted throughput there."""
    _, optimizer, make_args = setup
    started = time.perf_counter()
    batch = _largest_batch(strategy, setup)
    if isinstance(batch, str):
        print(f"    {name}: {batch}", flush=True)
        return {"plan": name, "strategy": strategy.name, "batch": None, "error": batch}
    step = make_step(optimizer, strategy)
    estimate = ox.estimate(step, *make_args(batch), target=TARGET)
    row = _throughput(name, strategy, estimate, batch, setup)
    print(
        f"    {name}: batch {batch}, {row['tokens_per_s']:.0f} tokens/s "
        f"({time.perf_counter() - started:.0f} s)",
        flush=True,
    )
    return row


def headline(presets: dict[str, ox.Strategy], max_compiles: int) -> dict:
    """`ox.fit` at batch 1 and the largest batch its plan allows; `ox.fit` again at
    larger batches, up to the largest any plan allows (that of the plan keeping least on
    the device); each preset at its own largest batch. The best throughput is a choice of
    batch and plan together: a larger batch amortises the copies of parameters and
    state, but leaves less device memory for saved activations."""
    setup = _setup()
    config, optimizer, make_args = setup
    step = make_step(optimizer, presets["full_remat"])
    print(f"13B on {TARGET}, sequences of {SEQ} tokens", flush=True)
    first = _fit(step, 1, setup, max_compiles)
    first_batch = _largest_batch(first.strategy, setup)
    frugal = ox.Strategy("frugal", "pinned_host", "pinned_host", "remat", update="host")
    largest = _largest_batch(frugal, setup)
    assert isinstance(first_batch, int) and isinstance(largest, int), (first_batch, largest)
    print(f"  batch 1's plan fits up to {first_batch}; any plan, up to {largest}", flush=True)
    searches, rows = [], []
    # Batch 1 was searched already (`first`): its row is that plan at `first_batch`.
    for batch in sorted({first_batch, (first_batch + largest) // 2, largest} - {1}):
        result = _fit(step, batch, setup, max_compiles)
        searches.append(_search(batch, result))
        rows.append(_throughput(f"ox.fit at batch {batch}", result.strategy, result.estimate,
                                batch, setup))  # fmt: skip
    searches.insert(0, _search(1, first))
    first_estimate = ox.estimate(
        make_step(optimizer, first.strategy), *make_args(first_batch), target=TARGET
    )
    rows.insert(
        0, _throughput("ox.fit at batch 1", first.strategy, first_estimate, first_batch, setup)
    )
    for name in ("everything_offloaded", "host_update", "full_remat", "qkv_offloaded"):
        rows.append(_preset(name, presets[name], setup))
    return {
        "config": config.name,
        "seq": SEQ,
        "target": TARGET,
        "parameters": config.parameters,
        "largest_batch": largest,
        "searches": searches,
        "rows": rows,
        "zero_offload": ZERO_OFFLOAD,
    }


def _fit(step: Any, batch: int, setup: tuple, max_compiles: int) -> Any:
    _, _, make_args = setup
    result = ox.fit(step, *make_args(batch), target=TARGET, max_compiles=max_compiles)
    print(
        f"    ox.fit at batch {batch}: {result.strategy.name} ({result.traces} traces, "
        f"{result.compiles} compiles, {result.seconds_searching:.1f} s)",
        flush=True,
    )
    return result


def _search(batch: int, result: Any) -> dict:
    return {
        "batch": batch,
        "strategy": result.strategy.name,
        "traces": result.traces,
        "compiles": result.compiles,
        "seconds": result.seconds_searching,
        "table": result.table(limit=12),
    }


def headline_table(result: dict) -> str:
    header = [
        "plan",
        "batch",
        "step ms",
        "tokens/s",
        "model TFLOP/s",
        "MFU",
        "MFU 6NT",
        "moved GB",
        "device GB",
        "host GB",
    ]
    body = []
    for row in result["rows"]:
        name = row["plan"]
        if row["batch"] is None:
            body.append([name, "-", "-", "-", "-", "-", "-", "-", "-", row["error"][:70]])
            continue
        body.append(
            [
                f"{name}: {row['strategy']}" if name.startswith("ox.fit") else name,
                row["batch"],
                f"{row['seconds'] * 1e3:.0f}",
                f"{row['tokens_per_s']:.0f}",
                f"{row['tflops']:.0f}",
                f"{row['mfu']:.1%}",
                f"{row['mfu_6nt']:.1%}",
                f"{row['moved'] / GB:.1f}",
                f"{(row['device'] or 0) / GB:.1f}",
                f"{(row['host'] or 0) / GB:.1f}",
            ]
        )
    zero = result["zero_offload"]
    body.append(
        [
            f"ZeRO-Offload, {zero['model']} on one {zero['device']} (published, ATC'21)",
            "-",
            "-",
            "-",
            f"{zero['tflops']:.0f}",
            f"{zero['tflops'] / zero['peak_tflops']:.0%}",
            "-",
            "-",
            "-",
            "-",
        ]
    )
    fractions = [f"{r['plan']}: {r['fraction']}" for r in result["rows"] if r.get("fraction")]
    return format_table(header, body, markdown=True) + "\n" + "\n".join(fractions)


# The plans drawn by `timelines`: `ox.fit`'s at batch 5 in the run of 2026-11-26 (the
# state in host memory, everything recomputed) and ZeRO-Offload's placement at its
# largest batch (`planner.PRESETS["host_update"]`: q, k, v offloaded, the rest recomputed).
TIMELINES = {
    "ox.fit's plan at batch 5 (state on the host)": (
        ox.Strategy("fit_batch_5", "device", "pinned_host", "remat"),
        5,
    ),
    "host_update at batch 10 (ZeRO-Offload's placement)": (
        ox.Strategy(
            "host_update",
            "pinned_host",
            "pinned_host",
            "remat",
            names=dict.fromkeys("qkv", "offload"),
            update="host",
        ),  # fmt: skip
        10,
    ),
}


def timelines(path: Any, plt: Any) -> dict:
    """The simulated 13B steps of `TIMELINES`, one Gantt chart above the other, written
    to `path`; their step times and what the compute stream waited for."""
    _, optimizer, make_args = _setup()
    figure, axes = plt.subplots(len(TIMELINES), 1, figsize=(13, 3.2 * len(TIMELINES)))
    out = {}
    for axis, (title, (strategy, batch)) in zip(axes, TIMELINES.items()):
        estimate = ox.estimate(make_step(optimizer, strategy), *make_args(batch), target=TARGET)
        sim = estimate.simulation
        estimate.plot_timeline(axis, f"Llama-2-13B, {title}: {estimate.seconds:.2f} s")
        out[title] = {"seconds": estimate.seconds, "waited": dict(sim.waited) if sim else {}}
        print(f"    {title}: {estimate.seconds * 1e3:.0f} ms, waited {out[title]['waited']}")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return out
