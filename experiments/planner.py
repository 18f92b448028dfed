"""The plan `ox.fit` picks for a Llama-like decoder, against MaxText-style presets.

The decoder of `_decoder.py` (1B, 8B and Llama-2-13B shapes, bf16, seq 2048) at a fixed
batch per device: `BATCH` = 4 sequences of 2048 tokens, 8,192 tokens per step. Its full
training step (`_decoder.make_step`: loss, gradients, AdamW) streams the optimizer update
one layer at a time (`ox.offload_optimizer(..., stream="layer")`), so that every plan,
including those with the state on the host, compiles from the same step.

For each (config, target), `ox.fit` searches the plans (each of q, k, v saved, offloaded
or recomputed over a base that saves or recomputes the rest; parameters and optimizer
state on device or host), then four presets are priced with `ox.estimate` and compiled
for the target (or their compile is taken from the search):

- `full_remat`: every value of a layer recomputed, everything on the device (MaxText's
  `remat_policy: full`, `ox.STRATEGIES["remat"]`);
- `minimal`: nothing recomputed, everything on the device (`ox.STRATEGIES["baseline"]`);
- `qkv_offloaded`: q, k, v offloaded, the rest recomputed (MaxText's
  `qkv_proj_offloaded`, the TPU blog's policy);
- `everything_offloaded`: `qkv_offloaded` with parameters and optimizer state in pinned
  host memory (`hybrid`, except that the layer input, the scan's carry, is not offloaded).

Printed and written to `experiments/results/planner[_TAG].{json,png}` (no tag for
`--full`; `_smoke`, `_default` otherwise): per plan the predicted step time, tokens/s, MFU
(two ways: the FLOPs the step counts without recomputation over the peak,
`StepEstimate.mfu()`; and 6 x parameters x tokens over the peak), compiled device and host
memory and whether it fits; how long each search took (traces, compiles); the predicted
gain of `qkv_offloaded` over `full_remat` beside the blog's measurements, re-priced
without overlap and at other host-link bandwidths; and a plot of predicted step time
against device memory for every candidate of each search (compiled ones filled), with the
Pareto front.

    JAX_PLATFORMS=cpu python experiments/planner.py --smoke   # 1B on h100: under a minute
    JAX_PLATFORMS=cpu python experiments/planner.py           # 1B on h100 and tpu-v5p
    JAX_PLATFORMS=cpu python experiments/planner.py --full    # 1B, 8B, 13B on both: ~15 min
    ... --configs 8B --targets h100 --tag 8b                  # one slice (the 2-minute check)

Compiles take most of the time, TPU ones most of all; the README has the timings.
"""

import argparse
import dataclasses
import json
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v5p-8")
os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from _decoder import CONFIGS, Config, abstract_state, make_step, optimizer_for  # noqa: E402
from _planner_fraction import fraction  # noqa: E402
from _planner_headline import headline, headline_table, timelines  # noqa: E402
from _planner_report import (  # noqa: E402
    LINKS,
    comparison_table,
    plot,
    preset_table,
    search_table,
)
from _report import pyplot, target_available  # noqa: E402
from _repricing import at_link, break_even, no_overlap  # noqa: E402

import offload_eqx as ox  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
GB = 1e9
BATCH = 4  # sequences of `config.seq` tokens per device and step
NAMES = ("k", "q", "v")  # the names the search varies (the layer input is the scan's carry)
QKV = dict.fromkeys(NAMES, "offload")
PRESETS = {
    "full_remat": ox.Strategy("full_remat", "device", "device", "remat"),
    "minimal": ox.Strategy("minimal", "device", "device", "save"),
    "qkv_offloaded": ox.Strategy("qkv_offloaded", "device", "device", "remat", names=QKV),
    "everything_offloaded": ox.Strategy(
        "everything_offloaded", "pinned_host", "pinned_host", "remat", names=QKV
    ),
    # ZeRO-Offload's placement: `everything_offloaded` with the update on the host, where
    # the parameters and state stay (only gradients and new bf16 parameters move).
    "host_update": ox.Strategy(
        "host_update", "pinned_host", "pinned_host", "remat", names=QKV, update="host"
    ),
}
# The TPU blog (Google and Intel, host offloading with JAX on TPU v5p-8): what it measured.
BLOG = {
    ("13B", "tpu-v5p"): "Llama2-13B, MaxText: qkv_proj_offloaded ~5% faster than full remat",
}
# (configs, targets, max_compiles of each search)
SIZES: dict[str, tuple[list[str], list[str], int]] = {
    "smoke": (["1B"], ["h100"], 3),
    "default": (["1B"], ["h100", "tpu-v5p"], 6),
    "full": (["1B", "8B", "13B"], ["h100", "tpu-v5p"], 12),
}


def _policies(strategy: ox.Strategy) -> tuple:
    """What decides a plan: placements, base, and the policy of each searched name."""
    names = tuple(strategy.policy_of(n, "remat") for n in NAMES)
    return strategy.params, strategy.optimizer, strategy.update, strategy.activations, names


class Progress:
    """Prints `ox.fit`'s progress lines at most every `every` seconds (and at every
    compile or new best), and splits the search's time between traces and compiles by
    which count each line advanced."""

    def __init__(self, prefix: str, every: float = 5.0):
        self.prefix, self.every = prefix, every
        self.start = self.last = self.printed = time.perf_counter()
        self.counts = (0, 0)
        self.best = ""
        self.trace_s = self.compile_s = 0.0

    def __call__(self, line: str) -> None:
        now = time.perf_counter()
        match = re.search(r"(\d+) traced, (\d+) compiled, best so far: (.*)", line)
        counts = (int(match[1]), int(match[2])) if match else self.counts
        best = match[3] if match else self.best
        if counts[1] > self.counts[1]:
            self.compile_s += now - self.last
        else:
            self.trace_s += now - self.last
        changed = counts[1] > self.counts[1] or best != self.best
        self.last, self.counts, self.best = now, counts, best
        if changed or now - self.printed >= self.every:
            self.printed = now
            print(f"    [{now - self.start:5.1f} s] {self.prefix} {line}", flush=True)


def _failure(error: Exception) -> dict:
    """Why a preset did not compile: out of memory, refused, or a compiler crash."""
    text = str(error)
    out_of_memory = "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower()
    refused = isinstance(error, ValueError) and "does not support" in text
    why = (
        "out of memory (compiler)"
        if out_of_memory
        else "refused by offload_eqx"
        if refused
        else "compiler crashed"
    )
    return {"device": None, "host": None, "error": f"{why}: {text.splitlines()[0][:200]}"}


def _estimate(step, args: tuple, target: str) -> tuple[Any, dict]:
    """The preset compiled for `target` and its schedule simulated, with its memory; where
    the compile fails, the jaxpr count's estimate and why."""
    try:
        estimate = ox.estimate(step, *args, target=target)
    except Exception as error:  # a compiler refusal or crash: recorded, the run goes on
        try:
            return ox.estimate(step, *args, target=target, compile=False), _failure(error)
        except ValueError:  # refused before any trace (a host computation on XLA:TPU)
            return None, _failure(error)
    return estimate, {"device": estimate.device_bytes, "host": estimate.host_bytes, "error": None}


def _row(name: str, estimate: Any, memory: dict, config: Config, target: ox.Target) -> dict:
    speeds = target.speeds
    assert speeds is not None and target.capacity is not None
    tokens = BATCH * config.seq
    device, host = memory["device"], memory["host"]
    fits = (
        None
        if device is None and memory.get("error") is None
        else device is not None and device <= target.capacity and host <= speeds.host_memory
    )
    return {
        "plan": name,
        "strategy": estimate.strategy,
        "seconds": estimate.seconds,
        "traced_seconds": estimate.traced_seconds,
        "model": estimate.model,
        "tokens_per_s": tokens / estimate.seconds,
        "mfu_counted": estimate.mfu(),
        "mfu_6nt": estimate.mfu(6 * config.parameters * tokens),
        "flops": estimate.flops,
        "recompute_flops": estimate.recompute_flops,
        "moved": estimate.h2d_bytes + estimate.d2h_bytes,
        "device": device,
        "host": host,
        "fits": fits,
        "memory_from": memory.get("from"),
        "error": memory.get("error"),
        "phases": {k: dataclasses.asdict(v) for k, v in estimate.phases.items()},
    }


def plan_one(config: Config, target_name: str, max_compiles: int) -> dict:
    """`ox.fit` for one (config, target), the presets beside it, every candidate's point."""
    target = ox.TARGETS[target_name]
    assert target.speeds is not None
    # The update streamed by layer (`_decoder`'s "hybrid" optimizer): the fastest device
    # update whatever the state's memory, and one host computation under a plan with
    # `update="host"` (`host_update`), so one step serves every plan.
    tokens = jax.ShapeDtypeStruct((BATCH, config.seq + 1), jnp.int32)
    optimizer = optimizer_for("hybrid", config)
    args = (*abstract_state(config, "hybrid"), tokens)
    progress = Progress(f"{config.name} {target_name}:")
    print(f"  {config.name} on {target_name}: ox.fit (max_compiles={max_compiles})", flush=True)
    try:
        result = ox.fit(
            make_step(optimizer, PRESETS["full_remat"]),
            *args,
            target=target_name,
            max_compiles=max_compiles,
            progress=progress,
        )
        error = error_full = None
    except Exception as raised:  # no plan fits (ValueError), or a compiler crashed
        result, error = None, f"{type(raised).__name__}: {str(raised).splitlines()[0][:300]}"
        error_full = f"{type(raised).__name__}: {raised}"
        print(f"    ox.fit raised {error}", flush=True)
    search = {
        "seconds": result.seconds_searching if result else time.perf_counter() - progress.start,
        "traces": result.traces if result else progress.counts[0],
        "compiles": result.compiles if result else progress.counts[1],
        "trace_s": progress.trace_s,
        "compile_s": progress.compile_s,
        "error": error,
        "error_full": error_full,
    }
    print(f"    searched in {search['seconds']:.1f} s", flush=True)
    candidates = list(result.candidates) if result else []

    rows, estimates = [], {}
    for name, preset in PRESETS.items():
        # Each preset compiled (its memory, its schedule simulated), even where the
        # search compiled the same plan: the search keeps only its chosen plan's program.
        estimate, memory = _estimate(make_step(optimizer, preset), args, target_name)
        print(f"    compiled {name}", flush=True)
        if estimate is None:  # refused: no time to give
            rows.append({"plan": name, "strategy": preset.name, **memory, "seconds": None})
            continue
        estimates[name] = estimate
        rows.append(_row(name, estimate, {**memory, "from": "compiled here"}, config, target))
    if result is not None:
        chosen = result.estimate
        memory = {"device": chosen.device_bytes, "host": chosen.host_bytes, "from": "ox.fit"}
        rows.append(_row("ox.fit", chosen, memory, config, target))
        fit_step = make_step(optimizer, result.strategy)
        rows[-1]["fraction"] = fraction(result.strategy, fit_step, args, config.layers)

    by_name = {r["plan"]: r for r in rows}
    remat, qkv = by_name["full_remat"], by_name["qkv_offloaded"]
    remat_estimate, qkv_estimate = estimates["full_remat"], estimates["qkv_offloaded"]
    # The same full-remat step with the whole-state update (`ox.offload_optimizer`
    # without a stream), compiled like the presets: how much of the step the streamed
    # update's price is.
    whole_model, whole_state = abstract_state(config, "full_remat")
    whole, _ = _estimate(
        make_step(optimizer_for("full_remat", config), PRESETS["full_remat"]),
        (whole_model, whole_state, tokens),
        target_name,
    )
    comparison = {
        "qkv_vs_remat": 1 - qkv["seconds"] / remat["seconds"],
        "qkv_vs_remat_fwd_bwd": 1
        - sum(qkv["phases"][p]["seconds"] for p in ("forward", "backward"))
        / sum(remat["phases"][p]["seconds"] for p in ("forward", "backward")),
        "qkv_vs_remat_traced": 1 - qkv["traced_seconds"] / remat["traced_seconds"],
        "qkv_vs_remat_no_overlap": 1 - no_overlap(qkv["phases"]) / no_overlap(remat["phases"]),
        "qkv_vs_remat_at_link": {
            str(bw): 1 - at_link(qkv_estimate, bw * GB).seconds / remat_estimate.seconds
            for bw in LINKS
        },
        "break_even_link": break_even(qkv_estimate, remat_estimate),
        "recompute_saved": remat["recompute_flops"] - qkv["recompute_flops"],
        "recompute_saved_share": (remat["recompute_flops"] - qkv["recompute_flops"])
        / remat["flops"],
        # Of full remat's predicted compute time, the part its FLOPs take at the assumed
        # rate (peak x efficiency); the rest is memory-bound work priced at HBM bandwidth.
        "matmul_share": remat["flops"]
        / (target.speeds.flops * target.speeds.efficiency)
        / sum(p["compute"] for p in remat["phases"].values()),
        "update_streamed_s": remat["phases"]["update"]["seconds"],
        "update_whole_state_s": whole.phases["update"].seconds,
        "full_remat_fits": remat["fits"],
        "qkv_moved": qkv["moved"],
        "fit_vs_remat": (1 - by_name["ox.fit"]["seconds"] / remat["seconds"])
        if "ox.fit" in by_name
        else None,
        "blog": BLOG.get((config.name, target_name)),
    }
    return {
        "config": config.name,
        "target": target_name,
        "capacity": target.capacity,
        "host_memory": target.speeds.host_memory,
        "speeds": dataclasses.asdict(target.speeds),
        "chosen": result.strategy.name if result else None,
        "fraction": rows[-1].get("fraction") if result else None,
        "search": search,
        "notes": list(result.notes) if result else [],
        "fit_table": result.table(limit=8) if result else error,
        "presets": rows,
        "comparison": comparison,
        "candidates": _points(candidates, rows, optimizer, args, config, target),
    }


def _points(
    candidates: list, rows: list[dict], optimizer: Any, args: tuple, config, target
) -> list:
    """Every candidate with a device-memory coordinate: compiled, or `ox.fit`'s model of
    it (device-resident arguments + the names saved + the least XLA overhead a compiled
    plan of the same base showed; without such a plan, the first two alone: a bound)."""
    name_bytes = config.layers * BATCH * config.seq * config.dim * 2  # one bf16 (b, s, d)
    capacity, host_memory = target.capacity, target.speeds.host_memory
    arguments: dict[tuple, int] = {}

    def device_arguments(strategy: ox.Strategy) -> int:
        key = (strategy.params, strategy.optimizer, strategy.update)
        if key not in arguments:
            plan = make_step(optimizer, strategy).plan(*args)
            arguments[key] = sum(
                int(np.prod(leaf.shape, dtype=np.int64)) * np.dtype(leaf.dtype).itemsize
                for leaf in plan.leaves
                if leaf.memory in (None, "device")
            )
        return arguments[key]

    def saved(strategy: ox.Strategy) -> int:
        if strategy.activations == "save":
            return 0
        return int(name_bytes * sum(_saved_share(strategy.policy_of(n, "remat")) for n in NAMES))

    def _saved_share(policy: Any) -> float:  # of the layers
        if isinstance(policy, ox.LayerSplit):
            first = min(policy.layers, config.layers) / config.layers
            return first * (policy.first == "save") + (1 - first) * (policy.rest == "save")
        return float(policy == "save")

    # Presets compiled here are candidates too: their compiles count as the search's.
    compiled_here = {
        _policies(PRESETS[r["plan"]]): r
        for r in rows
        if r["plan"] in PRESETS and r.get("memory_from") == "compiled here"
    }
    overhead: dict[str, int] = {}
    known = [(c.strategy, c.device_bytes) for c in candidates if c.device_bytes is not None]
    known += [(PRESETS[r["plan"]], r["device"]) for r in rows if r["plan"] in PRESETS]
    for strategy, device in known:
        if device is not None:
            added = device - device_arguments(strategy) - saved(strategy)
            base = strategy.activations
            overhead[base] = min(overhead.get(base, added), added)
    points = []
    for c in candidates:
        point = {**c.as_dict(), "compiled_by": "ox.fit" if c.device_bytes is not None else None}
        preset = compiled_here.get(_policies(c.strategy))
        if point["compiled_by"] is None and preset is not None and preset["device"] is not None:
            point.update(device_bytes=preset["device"], host_bytes=preset["host"])
            point["compiled_by"] = "planner"
        base = c.strategy.activations
        point["predicted_device"] = (
            device_arguments(c.strategy) + saved(c.strategy) + overhead.get(base, 0)
        )
        point["bound_only"] = base not in overhead
        point["fits"] = (
            None
            if point["compiled_by"] is None
            else point["device_bytes"] <= capacity and point["host_bytes"] <= host_memory
        )
        points.append(point)
    return points


# -- run --------------------------------------------------------------------------------


def run(
    configs: list[str] = SIZES["smoke"][0],
    targets: list[str] = SIZES["smoke"][1],
    max_compiles: int = SIZES["smoke"][2],
    out: Path = RESULTS,
    tag: str = "",
    with_headline: bool = False,
) -> list[dict]:
    """`ox.fit` and the presets for every (config, target); with `with_headline`, 13B on
    one H100 at the largest batch (`_planner_headline`); tables, JSON and a plot."""
    started = time.perf_counter()
    targets = [t for t in targets if target_available(t)]
    results = []
    for name in configs:
        config = CONFIGS[name]
        print(
            f"{name}: {config.parameters / 1e9:.2f}B parameters, {config.layers} layers, "
            f"d {config.dim}, ffn {config.ffn}, heads {config.heads}; batch {BATCH} x "
            f"{config.seq} tokens, bf16, AdamW (update streamed by layer)",
            flush=True,
        )
        for target in targets:
            result = plan_one(config, target, max_compiles)
            print(result["fit_table"], flush=True)
            results.append(result)
    top = None
    if with_headline and target_available("h100"):
        top = headline(PRESETS, max(max_compiles, 12))
    elapsed = time.perf_counter() - started

    if results:
        print(f"\nPresets and ox.fit's plan (batch {BATCH} x 2048 tokens per device; GB = 1e9 B)")
        print(preset_table(results))
        print("\nPredicted gain of qkv_offloaded over full_remat (positive: faster), re-priced")
        print(comparison_table(results))
        print("\nSearch time of ox.fit on this machine")
        print(search_table(results))
        for r in results:
            if (r["config"], r["target"]) == ("8B", "h100"):
                s = r["search"]
                verdict = "within" if s["seconds"] < 120 else "OVER"
                print(
                    f"8B on h100: ox.fit searched in {s['seconds']:.1f} s ({verdict} the 120 s of "
                    f"issue 11): {s['traces']} traces ({s['trace_s']:.1f} s), {s['compiles']} "
                    f"compiles ({s['compile_s']:.1f} s)"
                )
    if top is not None:
        print(f"\nLlama-2-13B on one H100, {top['seq']}-token sequences, largest batch per plan")
        print(headline_table(top))
    print(f"total time {elapsed:.0f} s")

    out.mkdir(parents=True, exist_ok=True)
    stem = "planner" + (f"_{tag}" if tag else "")
    document = {
        "batch": BATCH,
        "configs": {
            n: {**dataclasses.asdict(CONFIGS[n]), "parameters": CONFIGS[n].parameters}
            for n in configs
        },
        "presets": {n: dataclasses.asdict(s) for n, s in PRESETS.items()},
        "results": results,
        "headline": top,
        "elapsed_s": elapsed,
        "versions": {"jax": jax.__version__},
    }
    (out / f"{stem}.json").write_text(json.dumps(document, indent=1, default=str))
    plotted = plot(results, out / f"{stem}.png", BATCH)
    print(f"wrote {out / stem}.json" + (" and .png" if plotted else ""))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--smoke", action="store_true", help="1B on h100, 3 compiles per search")
    size.add_argument(
        "--full", action="store_true", help="1B, 8B, 13B on h100 and tpu-v5p, and the headline"
    )
    size.add_argument(
        "--headline", action="store_true", help="only 13B on one H100 at the largest batch"
    )
    size.add_argument(
        "--timeline", action="store_true", help="only the 13B timelines: ox.fit's plan, host update"
    )
    parser.add_argument("--configs", nargs="+", choices=[c for c in CONFIGS if c != "tiny"])
    parser.add_argument("--targets", nargs="+", choices=["h100", "tpu-v5p"])
    parser.add_argument("--max-compiles", type=int)
    parser.add_argument(
        "--tag", help="suffix of the result files (default: none for --full, else the size)"
    )
    args = parser.parse_args()
    plt = pyplot()
    if args.timeline and plt is not None:
        RESULTS.mkdir(parents=True, exist_ok=True)
        print(json.dumps(timelines(RESULTS / "planner_13b_timeline.png", plt), indent=1))
        return
    size = "full" if args.full else "smoke" if args.smoke else "default"
    configs, targets, max_compiles = SIZES[size]
    if args.headline:
        configs, targets, size = [], [], "headline"
    run(
        args.configs or configs,
        args.targets or targets,
        args.max_compiles if args.max_compiles is not None else max_compiles,
        tag=args.tag if args.tag is not None else ("" if size == "full" else size),
        with_headline=size in ("full", "headline"),
    )


if __name__ == "__main__":
    main()
