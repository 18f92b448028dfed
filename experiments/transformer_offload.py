"""Offloading a Llama-like decoder: device memory, largest batch, equal losses.

A decoder-only transformer (`_decoder.py`: RMSNorm, rotary attention with q/k/v/o
projections, SwiGLU MLP, layers stacked with `eqx.filter_vmap` and applied with `ox.scan`)
written once with offload_eqx annotations: every weight is an `ox.field` (so strategies may
move it), and the block names its input and its q, k, v projections with `ox.name`,
declaring them with `ox.activations(...)` as the TPU blog does (q/k/v offloaded, everything
else recomputed).

The same full training step (loss, gradients, AdamW, `ox.update_and_apply`) is compiled
under each strategy; the state-offloading strategies `offload_state` and `hybrid` use
`ox.offload_optimizer(optax.adamw(...), stream="layer", layers=...)`, whose update and
apply stream the stacked leaves' state, gradients and parameters through the device one
layer at a time; the others use `ox.offload_optimizer(optax.adamw(...))` (no stream):

- `no_remat`: nothing recomputed, everything on the device (`"baseline"`);
- `full_remat`: every value in a layer recomputed (`"remat"`);
- `qkv_offload`: the model's own annotations: q, k, v offloaded, the rest recomputed;
- `offload_state`: parameters and optimizer state in pinned host memory, no remat;
- `hybrid`: parameters and optimizer state on host and q, k, v offloaded;
- `hybrid_whole_state`: `hybrid` with `ox.offload_optimizer`, whose update fetches the
  whole state (for comparison);
- `hybrid_host_update`: `hybrid` with `ox.offload_optimizer(adamw, update_on="host")`: the
  update runs on the host, where the state and the parameters live, so only the
  gradients cross the link for it (XLA:TPU refuses it: the row says so).

The memory table also gives the bytes each step moves per direction (`ox.audit`).

Three measurements:

1. compile-only (deviceless) for an H100 and a TPU v5p at 1B to 8B parameters in bf16,
   from `jax.ShapeDtypeStruct`s (`eqx.filter_eval_shape`; nothing is allocated): device and
   host bytes per memory space for each strategy;
2. the largest batch that fits the chip under each strategy (H100 80 GB, TPU v5p 95 GB),
   exactly, with `ox.max_batch`: the batch it returns was compiled and fits, the batch after
   it was compiled and does not. A line through the measured batches only chooses where to
   compile next (memory is nearly, not exactly, linear in the batch); a search takes 4 to
   8 compiles;
3. a tiny version of the model trained for a few steps on the CPU under each strategy: the
   losses must equal the baseline's (offloading and recomputing change where values live,
   never what they are).

The compiles are `_batch_search.py`, the tables and the plot `_transformer_report.py`.

    JAX_PLATFORMS=cpu python experiments/transformer_offload.py --smoke   # 119 s, idle 2 cores
    JAX_PLATFORMS=cpu python experiments/transformer_offload.py --full    # 1B, 3B, 8B: hours
    ... --configs 8B --targets h100 --strategies hybrid --search h100 --tag mine   # one slice

A TPU v5p compile of this step takes 20-40 s on an idle 2-core machine (up to 140 s when
busy), an H100 one 3-4 s (up to 20 s). What the measurements showed (jax 0.10.2):

- with `ox.offload_optimizer` the device peak of the state-offloading strategies is the
  optimizer update, run on the whole state at once (parameters, gradients and both Adam
  moments on the device together): 63.9 GB for the 8B model, whatever the batch
  (`hybrid_whole_state`). Streaming the update layer by layer removes that peak: `hybrid`
  needs 2.22 GB at batch 1 on an H100, and the activations set the peak again;
- memory is not a line in the batch: on the H100 at 1B, `hybrid` needs 75.3 GB at batch
  90 and 87.5 GB at batch 91, and the line through batch 1 and 2 meets the capacity at 75
  for `qkv_offload` and at 101 for `hybrid`, whose largest batches are 91 and 90.
  `ox.max_batch` compiles both sides of each answer;
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
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v5p-8")
os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from _batch_search import capacity, largest_batch, measure  # noqa: E402
from _decoder import CONFIGS, STRATEGIES, Config, make_decoder, make_step, optimizer_for  # noqa: E402
from _report import target_available  # noqa: E402
from _transformer_report import (  # noqa: E402
    batch_table,
    format_gb,
    loss_table,
    memory_table,
    plot,
    refusals,
)

RESULTS = Path(__file__).resolve().parent / "results"
# The chips compiled for, and the bytes one of each has (`ox.TARGETS[name].capacity`).
TARGETS = ["h100", "tpu-v5p"]
CAPACITY = {target: capacity(target) for target in TARGETS}

# -- 1 and 2. memory at batch 1 and the largest batch, compile-only ---------------------


class ProbePrinter:
    """Prints each compile of a largest-batch search as it finishes, and once per run, at
    the first batch that does not fit, what such a probe is and why the compiler's own
    complaints about it are not on the terminal."""

    explained = False  # shared: said once per run

    def __init__(self, target: str):
        self.target = target

    def __call__(self, probe: dict) -> None:
        total = "refused (out of memory)" if probe["total"] is None else format_gb(probe["total"])
        verdict = "fits" if probe["fits"] else "does not fit"
        print(
            f"      batch {probe['batch']:4d}: {total} GB of {CAPACITY[self.target] / 1e9:.2f}, "
            f"{verdict} ({probe['seconds']:.1f} s)",
            flush=True,
        )
        if not probe["fits"] and not ProbePrinter.explained:
            ProbePrinter.explained = True
            print(
                f"      (batch {probe['batch']} does not fit: expected while searching, which "
                "compiles the batch after the answer to prove it. XLA logs such a program "
                '("Can\'t reduce memory use below ..."): ox.memory_report keeps its log in '
                "MemoryReport.compiler_log instead of printing it.)",
                flush=True,
            )


def deviceless(
    config: Config,
    targets: list[str],
    search: dict[str, list[str] | None],
    max_compiles: int | None = None,
    strategies: dict[str, list[str]] | None = None,
) -> list[dict]:
    """Memory at batch 1 per target and strategy (`strategies[target]`, all by default),
    and the largest batch (`ox.max_batch`, at most `max_compiles` compiles each when
    given) of the strategies in `search[target]` (None: all)."""
    rows = []
    for target in targets:
        printer = ProbePrinter(target)
        for strategy in (strategies or {}).get(target, list(STRATEGIES)):
            if target in search and strategy in (search[target] or STRATEGIES):
                print(f"  {config.name} {target:8s} {strategy:18s} largest batch:", flush=True)
                row = largest_batch(config, target, strategy, max_compiles, printer)
                found = row["search"]
                best = (
                    f"; max batch {found['max_batch']} ({found['compiles']} compiles, "
                    f"{found['seconds']:.0f} s)"
                )
                if found["stopped"]:
                    best += f"; stopped: {found['stopped'][:160]}"
            else:
                row, best = measure(config, target, strategy, 1), ""
            rows.append({"config": config.name, "target": target, "strategy": strategy, **row})
            moved = row.get("transfers") or {}
            print(
                f"  {config.name} {target:8s} {strategy:18s} batch 1: "
                f"{format_gb(row['total'])} GB device, {format_gb(row['host_total'])} GB host, "
                f"{format_gb(moved.get('h2d'))} / {format_gb(moved.get('d2h'))} GB h2d / d2h, "
                f"{row['compile_s']:.1f} s{best}" + (" (refused)" if row.get("refused") else ""),
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


# What each size compiles: (configs, strategies whose largest batch is searched per target
# (None: all), strategies per target (all when absent)). A TPU v5p compile of this step
# takes 20-40 s on an idle 2-core machine, an H100 one 3-6 s, and a search 5 to 8
# compiles: the smoke run compiles every strategy for the H100 at batch 1 and searches
# the largest batch of three (24 H100 compiles, about 2 minutes idle); for the TPU it only
# shows the refusal of `hybrid_host_update` (refused before XLA compiles, a trace of ~1
# s). The TPU compiles are in the default size and `--full`.
SIZES: dict[str, tuple[list[str], dict[str, list[str] | None], dict[str, list[str]]]] = {
    "smoke": (
        ["1B"],
        {"h100": ["full_remat", "qkv_offload", "hybrid"]},
        {"tpu-v5p": ["hybrid_host_update"]},
    ),
    "default": (["1B"], {"h100": None, "tpu-v5p": None}, {}),
    "full": (["1B", "3B", "8B"], {"h100": None, "tpu-v5p": None}, {}),
}


def run(
    configs: list[str] = SIZES["smoke"][0],
    targets: list[str] = list(TARGETS),
    search: dict[str, list[str] | None] = SIZES["smoke"][1],
    cpu_steps: int = 4,
    strategies: dict[str, list[str]] | None = SIZES["smoke"][2],
    out: Path = RESULTS,
    tag: str = "",
    max_compiles: int | None = None,
) -> dict:
    """Compile-only memory per (config, target, strategy) and the largest batch of the
    strategies in `search[target]` (None: all), then the CPU equal-loss check; print the
    tables, write JSON and a plot into `out`.

    `strategies` optionally limits the strategies compiled per target; `max_compiles`
    stops each search after that many compiles (unlimited by default: the answer is then
    exact).
    """
    started = time.perf_counter()
    targets = [t for t in targets if target_available(t)]
    rows: list[dict] = []
    for name in configs:
        config = CONFIGS[name]
        print(
            f"{name}: {config.parameters / 1e9:.2f}B parameters, {config.layers} layers, "
            f"d {config.dim}, ffn {config.ffn}, heads {config.heads}, seq {config.seq}, "
            "bf16",
            flush=True,
        )
        rows += deviceless(config, targets, search, max_compiles, strategies)
    cpu = train_on_cpu(steps=cpu_steps)
    worst = max(cpu["max_rel_diff"].values())
    assert worst < 1e-5, f"losses differ from the baseline by up to {worst:.2e}"
    elapsed = time.perf_counter() - started

    if rows:
        print("\nDevice and host memory of one training step at batch 1 (GB = 1e9 bytes)")
        print(memory_table(rows))
        for line in refusals(rows):
            print(line)
    if any("search" in r for r in rows):
        print("\nLargest batch that fits one chip (exact: it fits, the next batch does not)")
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
    plotted = plot(rows, out / f"{stem}.png")
    print(f"wrote {out / stem}.json" + (" and .png" if plotted else ""))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    size = parser.add_mutually_exclusive_group()
    size.add_argument(
        "--smoke",
        action="store_true",
        help="1B only; every strategy at batch 1 and three largest batches on h100; on "
        "tpu-v5p only the refused hybrid_host_update (no TPU compile)",
    )
    size.add_argument("--full", action="store_true", help="1B, 3B and 8B")
    parser.add_argument("--configs", nargs="+", choices=[c for c in CONFIGS if c != "tiny"])
    parser.add_argument("--targets", nargs="+", default=list(TARGETS), choices=list(TARGETS))
    parser.add_argument(
        "--search",
        nargs="*",
        choices=list(TARGETS),
        help="targets on which every strategy's largest batch is searched (none: batch 1 only)",
    )
    parser.add_argument(
        "--max-compiles", type=int, help="stop each batch search after this many compiles"
    )
    parser.add_argument("--cpu-steps", type=int, default=4)
    parser.add_argument("--tag", default="", help="suffix of the result files")
    parser.add_argument("--strategies", nargs="+", choices=list(STRATEGIES))
    args = parser.parse_args()
    configs, search, strategies = SIZES[
        "full" if args.full else "smoke" if args.smoke else "default"
    ]
    if args.strategies:
        strategies = dict.fromkeys(args.targets, args.strategies)
    run(
        args.configs or configs,
        args.targets,
        search if args.search is None else dict.fromkeys(args.search),
        args.cpu_steps,
        strategies=strategies,
        tag=args.tag,
        max_compiles=args.max_compiles,
    )


if __name__ == "__main__":
    main()
