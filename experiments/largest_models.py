"""The largest model per accelerator, trained the ZeRO-Offload way, planned by `ox.fit`.

The decoder of `_decoder.py` at a published shape per target, with bfloat16 parameters and
AdamW's float32 masters and moments (`ox.offload_optimizer(adamw, update_on="host",
delay=1, master_dtype=jnp.float32)`: 12 bytes per parameter of state, 2 of pending
gradients, besides the 2 of the parameters), attention by cuDNN's fused kernel:

- `h100`: one H100 with a 1.5 TB host (`host_budget=1.5e12`): Llama-2-70B (8 key/value
  heads, 4,096-token sequences), then LLaMA-33B's shape (`_decoder.CONFIGS["30B"]`), then
  Llama-2-13B;
- `gh200`: one GH200 with its 480 GB: LLaMA-33B's shape, then 13B, then 8B.

Per target the configs are tried largest first, until one fits. The step is declared with
the most frugal plan (parameters and state in host memory, fetched per layer by `ox.scan`,
every activation recomputed, each block's input `block_input` offloaded, the update on the
host), compiled once: where it is over a budget, the row says which and the search is
skipped (keeping the parameters on the device instead saves the host 4 of the 32 bytes per
parameter a host update needs, not enough in any row the README shows). Otherwise `ox.fit`
searches every plan within the device's memory and the host budget, compiled without the
hardware from `jax.ShapeDtypeStruct`s, and says which budget binds (`FitResult.binds`). For
its plan: batch, tokens/s, MFU (6NT over the peak), device and host memory, bytes over the
link per step, how long the host update runs beside the step (the simulated schedule's host
busy time), and which resource bounds the step (the one busiest in the schedule).

    JAX_PLATFORMS=cpu python experiments/largest_models.py --smoke  # tiny, on h100: < 1 min
    JAX_PLATFORMS=cpu python experiments/largest_models.py          # both targets: ~3 min
    ... --targets h100 --configs 70B --host-budget 2.4e12 --tag _70b_2400   # one row
    ... --targets gh200 --configs 30B --delay 0 --mu-dtype bfloat16 --largest-batch
    ... --block-stack   # the README's block stack at 70B on one H100: ox.fit's plan, ~10 s

The frugal plan updates in slices written over the state (`update="host_sliced"`: the
least host memory), delayed or not; `ox.fit` searches that and the update computed whole
(`update="host"`: delayed, it overlaps the passes but holds the state twice).

The default and `--full` runs take minutes per row on a 2-core machine (the README has the
timings); `nox -s experiments` runs `--smoke`.
"""

import argparse
import dataclasses
import json
import os
import sys
import time
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v5p-8")
os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from _decoder import CONFIGS, Config, make_decoder, make_step, with_attention  # noqa: E402
from _report import RESULTS, format_table, target_available  # noqa: E402

import offload_eqx as ox  # noqa: E402

GB = 1e9
BATCH = 8  # sequences of `config.seq` tokens per step
# target -> (configs tried, largest first; host budget in bytes per device)
ROWS: dict[str, tuple[tuple[str, ...], float]] = {
    "h100": (("70B", "30B", "13B"), 1.5e12),
    "gh200": (("30B", "13B", "8B"), 480e9),
}
# The smoke run: the same structure at the tiny shape, batch 2.
SMOKE = (("tiny",), 1e9)
# The plan the step is declared with (what `ox.fit` replaces): ZeRO-Offload's placement,
# the layers' inputs offloaded, the update computed in slices written over the state
# (`update="host_sliced"`): the least host memory, delayed or not (a delayed update
# computed whole, `update="host"`, overlaps the passes but holds the state twice).
FRUGAL = ox.Strategy(
    "frugal", "pinned_host", "pinned_host", "remat", names={"block_input": "offload"},
    update="host_sliced",
)  # fmt: skip


# What others publish (the marks): the largest model trained on one accelerator.
PUBLISHED = [
    ("ZeRO-Offload (Ren et al., ATC'21)", "13B on one V100 (32 GB)"),
    ("ZeRO-3 Offload (DeepSpeed, 2021)", "40B on one V100 with 1.5 TB of host memory"),
    ("SuperOffload (arXiv 2509.21271)", "25B on one GH200"),
]


def optimizer(delay: int = 1, mu_dtype: Any = None) -> Any:
    """AdamW as ZeRO-Offload trains: float32 masters and moments in host memory, the
    update on the host, delayed by `delay` steps; with `mu_dtype`, the first moment in
    that dtype (optax's `mu_dtype`: `jnp.bfloat16` saves 2 bytes a parameter)."""
    adamw = optax.adamw(1e-4, weight_decay=0.01, mu_dtype=mu_dtype)
    return ox.offload_optimizer(adamw, update_on="host", delay=delay, master_dtype=jnp.float32)


def abstract_args(config: Config, batch: int, opt: Any) -> tuple:
    """The bf16 model, the optimizer state and the tokens as `ShapeDtypeStruct`s."""
    model = eqx.filter_eval_shape(make_decoder, config, jax.random.key(0))
    model = jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype) if eqx.is_array(x) else x, model
    )
    state = eqx.filter_eval_shape(opt.init, model)
    return model, state, jax.ShapeDtypeStruct((batch, config.seq + 1), jnp.int32)


def bound_by(estimate: Any) -> str:
    """The resource the simulated schedule keeps busiest: what a faster step needs more
    of (compute, the link's two directions, or the host computation)."""
    sim = estimate.simulation
    if sim is None:
        return "-"
    busy = {r: s for r, s in sim.busy.items() if r != "network"}
    resource = max(busy, key=lambda r: busy[r])
    return {"compute": "device compute", "h2d": "link (to device)", "d2h": "link (to host)",
            "host": "host computation"}[resource]  # fmt: skip


def frugal_memory(step: Any, args: tuple, target: str) -> tuple[int, int]:
    """The device and host bytes of the most frugal plan, compiled (one compile): a
    model whose frugal plan is over a budget fits under no plan."""
    report = ox.memory_report(step, *args, target=target)
    return report.total, report.host_total


def plan_one(
    target: str,
    config: Config,
    host_budget: float,
    batch: int,
    compiles: int,
    delay: int = 1,
    mu_dtype: Any = None,
) -> dict:
    """`ox.fit` within the device and `host_budget`, and its plan's row; or, where the
    most frugal plan is over a budget, why the model fits under no plan."""
    started = time.perf_counter()
    config = with_attention(config, target) if target != "cpu" else config
    opt = optimizer(delay, mu_dtype)
    args = abstract_args(config, batch, opt)
    print(
        f"{config.name} ({config.parameters / 1e9:.1f}B) on {target}, host budget "
        f"{host_budget / GB:.0f} GB, batch {batch} x {config.seq}",
        flush=True,
    )
    capacity = ox.TARGETS[target].capacity or 0
    device, host = frugal_memory(make_step(opt, FRUGAL), args, target)
    print(f"  frugal plan: device {device / GB:.1f} GB, host {host / GB:.1f} GB", flush=True)
    base = {"target": target, "config": config.name, "parameters": config.parameters,
            "host_budget": host_budget, "batch": batch, "seq": config.seq, "delay": delay,
            "mu_dtype": None if mu_dtype is None else jnp.dtype(mu_dtype).name,
            "capacity": capacity, "frugal_device": device, "frugal_host": host}  # fmt: skip
    if device > capacity or host > host_budget:
        over = [f"device {device / GB:.1f} GB > {capacity / GB:.1f}"] if device > capacity else []
        over += [f"host {host / GB:.1f} GB > {host_budget / GB:.0f}"] if host > host_budget else []
        return base | {"fits": False, "why": "the most frugal plan needs " + ", ".join(over),
                       "binds": ["device"] * (device > capacity) + ["host"] * (host > host_budget),
                       "wall_s": time.perf_counter() - started}  # fmt: skip
    result = ox.fit(
        make_step(opt, FRUGAL),
        *args,
        target=target,
        host_budget=int(host_budget),
        max_compiles=compiles,
        progress=lambda line: print(f"    {line}", flush=True),
    )
    print(result.table(limit=6), flush=True)
    estimate = result.estimate
    sim = estimate.simulation
    tokens = batch * config.seq
    busy = dict(sim.busy) if sim is not None else {}
    return base | {
        "fits": True,
        "plan": result.strategy.name,
        "strategy": dataclasses.asdict(result.strategy),
        "binds": list(result.binds),
        "binding": result.binding(),
        "seconds": estimate.seconds,
        "tokens_per_s": tokens / estimate.seconds,
        "mfu_6nt": estimate.mfu(6 * config.parameters * tokens),
        "device": estimate.device_bytes,
        "host": estimate.host_bytes,
        "link_bytes": estimate.h2d_bytes + estimate.d2h_bytes,
        "h2d_bytes": estimate.h2d_bytes,
        "d2h_bytes": estimate.d2h_bytes,
        "host_update_s": busy.get("host", 0.0),
        "busy": busy,
        "waited": dict(sim.waited) if sim is not None else {},
        "bound_by": bound_by(estimate),
        "search": {
            "traces": result.traces,
            "compiles": result.compiles,
            "seconds": result.seconds_searching,
        },  # fmt: skip
        "fit_table": result.table(limit=12),
        "wall_s": time.perf_counter() - started,
    }


def largest_batch(
    row: dict, config: Config, host_budget: float, delay: int, mu_dtype: Any = None
) -> dict:
    """For a row that fits: the largest batch of its plan within the device and the host
    budget (`ox.max_batch`), and that batch's predicted step (`ox.estimate`)."""
    started = time.perf_counter()
    opt = optimizer(delay, mu_dtype)
    strategy = ox.Strategy(**row["strategy"])
    step = make_step(opt, strategy)
    batch = ox.max_batch(
        step,
        lambda b: abstract_args(config, b, opt),
        target=row["target"],
        host_budget=int(host_budget),
        start=row["batch"],
        progress=lambda line: print(f"    {line}", flush=True),
    )
    estimate = ox.estimate(step, *abstract_args(config, batch, opt), target=row["target"])
    tokens = batch * config.seq
    print(f"  largest batch {batch}: {estimate.seconds:.2f} s", flush=True)
    return {
        "largest_batch": batch,
        "largest_seconds": estimate.seconds,
        "largest_tokens_per_s": tokens / estimate.seconds,
        "largest_mfu_6nt": estimate.mfu(6 * config.parameters * tokens),
        "largest_device": estimate.device_bytes,
        "largest_host": estimate.host_bytes,
        "largest_wall_s": time.perf_counter() - started,
    }


def _model(row: dict) -> str:
    """The model and, where it is not float32, AdamW's first moment's dtype."""
    mu = f", mu in {row['mu_dtype']}" if row.get("mu_dtype") else ""
    return f"{row['config']} ({row['parameters'] / 1e9:.1f}B{mu})"


def table(rows: list[dict]) -> str:
    header = ["target", "model", "plan", "batch", "step s", "tokens/s", "MFU 6NT",
              "device GB", "host GB", "link GB/step", "host update s", "budget binds",
              "step bound by"]  # fmt: skip
    body = [
        [
            f"{r['target']} ({r['host_budget'] / GB:.0f} GB host)",
            _model(r),
            f"does not fit: {r['why']}",
            f"{r['batch']} x {r['seq']}",
            *["-"] * 7,
            " and ".join(r["binds"]),
            "-",
        ]
        if not r["fits"]
        else [
            f"{r['target']} ({r['host_budget'] / GB:.0f} GB host)",
            _model(r),
            r["plan"],
            f"{r['batch']} x {r['seq']}",
            f"{r['seconds']:.2f}",
            f"{r['tokens_per_s']:.0f}",
            f"{r['mfu_6nt']:.1%}",
            f"{(r['device'] or 0) / GB:.1f} of {r['capacity'] / GB:.1f}",
            f"{(r['host'] or 0) / GB:.1f}",
            f"{r['link_bytes'] / GB:.1f}",
            f"{r['host_update_s']:.2f}",
            " and ".join(r["binds"]) or "neither",
            r["bound_by"],
        ]
        for r in rows
    ]
    for r in rows:
        if "largest_batch" in r:
            body[rows.index(r)].append(
                f"{r['largest_batch']} x {r['seq']}: {r['largest_seconds']:.2f} s, "
                f"{r['largest_mfu_6nt']:.1%}"
            )
    if any("largest_batch" in r for r in rows):
        header.append("largest batch: step s, MFU")
        body = [line + ["-"] * (len(header) - len(line)) for line in body]
    published = "\n".join(f"- {who}: {what} (published)" for who, what in PUBLISHED)
    return format_table(header, body, markdown=True) + "\n" + published


def run(
    size: str = "default",
    targets: list[str] | None = None,
    batch: int | None = None,
    host_budget: float | None = None,
    configs: list[str] | None = None,
    tag: str = "",
    delay: int = 1,
    largest: bool = False,
    mu_dtype: Any = None,
) -> list[dict]:
    started = time.perf_counter()
    if size == "smoke":
        plans, compiles, batch = {"h100": SMOKE}, 4, batch or 2
    else:
        # 12 compiles: each family of plans (base and placement) the count ranks first
        # costs one to learn what its placement adds on the device (33B on the GH200:
        # the eight families the count ranks first are over it, the ninth compile fits)
        plans, compiles = {t: ROWS[t] for t in (targets or list(ROWS))}, 12
        plans = {t: (tuple(configs or names), host_budget or budget)
                 for t, (names, budget) in plans.items()}  # fmt: skip
    rows = []
    for target, (names, budget) in plans.items():
        if not target_available(target):
            continue
        for name in names:  # largest first, until one fits
            config = CONFIGS[name]
            row = plan_one(target, config, budget, batch or BATCH, compiles, delay, mu_dtype)
            if row["fits"] and largest:
                config = with_attention(config, target)
                row |= largest_batch(row, config, budget, delay, mu_dtype)
            rows.append(row)
            if row["fits"]:
                break
    print(table(rows))
    elapsed = time.perf_counter() - started
    print(f"total time {elapsed:.0f} s")
    os.makedirs(RESULTS, exist_ok=True)
    path = os.path.join(RESULTS, f"largest_models{'_smoke' if size == 'smoke' else ''}{tag}.json")
    with open(path, "w") as f:
        json.dump({"rows": rows, "elapsed_s": elapsed, "jax": jax.__version__}, f, indent=1)
    print(f"wrote {path}")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--smoke", action="store_true", help="the tiny decoder on h100")
    size.add_argument("--full", action="store_true", help="every row (the default's rows)")
    parser.add_argument("--targets", nargs="+", choices=list(ROWS))
    parser.add_argument("--batch", type=int, help=f"sequences per step (default {BATCH})")
    parser.add_argument("--host-budget", type=float, help="bytes (default: per target)")
    parser.add_argument("--configs", nargs="+", choices=[c for c in CONFIGS if c != "tiny"])
    parser.add_argument("--tag", default="", help="suffix of the JSON file's name")
    parser.add_argument(
        "--delay", type=int, default=1, choices=(0, 1), help="the host update's delay (steps)"
    )
    parser.add_argument(
        "--largest-batch",
        action="store_true",
        help="also the largest batch of each plan found (ox.max_batch within both budgets)",
    )
    parser.add_argument(
        "--mu-dtype", choices=("bfloat16",), help="AdamW's first moment in this dtype"
    )
    parser.add_argument(
        "--block-stack",
        action="store_true",
        help="only the README's block stack at 70B on one H100 (1.5 TB): ox.fit's plan",
    )
    args = parser.parse_args()
    if args.block_stack:
        import _block_stack

        row = _block_stack.run()
        path = os.path.join(RESULTS, "largest_models_block_stack.json")
        with open(path, "w", encoding="utf-8") as file:
            json.dump(row, file, indent=1)
        print(f"wrote {path}")
        return
    size = "smoke" if args.smoke else "default"
    mu_dtype = jnp.bfloat16 if args.mu_dtype else None
    run(
        size, args.targets, args.batch, args.host_budget, args.configs, args.tag, args.delay,
        args.largest_batch, mu_dtype,
    )  # fmt: skip


if __name__ == "__main__":
    main()
