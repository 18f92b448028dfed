"""The optimizer update on the host against the update streamed by layer on the device.

Under `hybrid` (parameters and optimizer state in host memory), the same training step
with three optimizers, compiled for each target without the hardware:

- `layer-streamed device update`: `ox.offload_optimizer(adam, stream="layer")`, one
  layer's state, gradient and parameter fetched at a time;
- `host update`: the same optimizer under a plan with `update="host"`: the whole update,
  and the sum for host-resident parameters, as one host computation (ZeRO-Offload's
  placement; each layer's gradient is sent to host memory by the backward pass as it is
  made);
- `delayed host update`: `ox.offload_optimizer(chain, update_on="host", delay=1)`, the
  host update of the previous step's gradients, which reads nothing the step computes,
  so XLA runs it beside the forward and backward passes (ZeRO-Offload's delayed
  parameter update);
- `gradients only`: the step without any update, the floor of the backward pass.

Then the two updates' step times on the H100 (`ox.estimate`: the compiled schedule
simulated, beside the jaxpr count), with the simulated timelines drawn one above the
other (`results/host_update_timeline.png`) and written as Chrome traces
(`results/host_update_*.trace.json`, for Perfetto).

`--smoke`: a scanned model of 8 layers of 1024 x 1024 (P = 4 MiB, one layer), adam and
`clip_by_global_norm` + adam, on h100 and tpu-v5p. `--full` adds the Llama-like 8B
decoder (`_decoder.py`) at batch 1 x 2048 tokens on h100. XLA:TPU is compiled with
offload_eqx's refusal of the host update bypassed, to show why it is refused.

`--headline`: Llama-2-13B's shape at 4,096 tokens per sequence on one H100 and on one
GH200, ZeRO-Offload's way (bfloat16 parameters, float32 masters and AdamW moments in host
memory, the update on the host, delayed by one step; `--bf16-moments`: without masters,
as before they existed): the parameters on the device (ZeRO-Offload's declaration, also
at batch 6) or streamed from host memory, each plan at the largest batch it fits
(`ox.max_batch`), beside the same plan undelayed and the figures ZeRO-Offload, ZenFlow
and SuperOffload publish; each row with its compute, host and link waits, XLA's own
recompute, and its time with every matmul at half the peak; its timelines go to
`docs/plots/host_update_13b_timeline.png`.

Run: `python experiments/host_update.py [--smoke | --full | --headline]`.
"""

import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v5p-8")
os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import argparse  # noqa: E402
import json  # noqa: E402
from typing import Any  # noqa: E402

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from _report import RESULTS, format_table, pyplot, target_available  # noqa: E402

import offload_eqx as ox  # noqa: E402
from offload_eqx._host import compute as _host_compute  # noqa: E402

LAYERS, DIM, BATCH = 8, 1024, 256
P = DIM * DIM * 4
HOST = ox.Strategy("hybrid_host_update", "pinned_host", "pinned_host", update="host")


class Square(eqx.Module):
    w: jax.Array = ox.field(memory="pinned_host")

    def __call__(self, x):
        return jnp.tanh(ox.name(x, "x") @ self.w)


class Stack(eqx.Module):
    layers: Square
    activations: ox.Activations = ox.activations(x="remat")

    def __call__(self, x):
        return ox.scan(self.layers, x)


def _stack_programs(clip: bool) -> dict:
    model = eqx.filter_eval_shape(lambda: Stack(Square(jnp.zeros((LAYERS, DIM, DIM)))))
    x = jax.ShapeDtypeStruct((BATCH, DIM), jnp.float32)
    opt = ox.offload_optimizer(
        optax.adam(1e-3),
        stream="layer",
        layers=LAYERS,
        global_transform=optax.clip_by_global_norm(1.0) if clip else None,
    )
    chain = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3)) if clip else None
    delayed = ox.offload_optimizer(chain or optax.adam(1e-3), update_on="host", delay=1)
    loss = lambda m, x: jnp.mean(m(x) ** 2)  # noqa: E731

    def program(opt, strategy):
        def step(model, state, x):
            grads = eqx.filter_grad(loss)(model, x)
            return ox.update_and_apply(opt, grads, state, model)

        state = eqx.filter_eval_shape(opt.init, model)
        return ox.filter_jit(step, strategy=strategy), (model, state, x)

    return {
        "layer-streamed device update": program(opt, "hybrid"),
        "host update": program(opt, HOST),
        "delayed host update": program(delayed, HOST),
        "gradients only": (ox.filter_jit(eqx.filter_grad(loss), strategy="hybrid"), (model, x)),
    }


def _decoder_programs() -> dict:
    from _decoder import CONFIGS, STRATEGIES, abstract_state, make_step, optimizer_for

    config = CONFIGS["8B"]
    model, state = abstract_state(config, "hybrid")
    optimizer = optimizer_for("hybrid", config)
    tokens = jax.ShapeDtypeStruct((1, config.seq + 1), jnp.int32)
    args = (model, state, tokens)
    return {
        "layer-streamed device update": (make_step(optimizer, STRATEGIES["hybrid"]), args),
        "host update": (make_step(optimizer, HOST), args),
    }


def _measure(workload: str, programs: dict, target: str, unit: float) -> list[dict]:
    comparison = ox.compare_memory(programs, target=target)
    rows = []
    for (name, _), report in comparison.reports.items():
        rows.append(
            dict(
                workload=workload,
                target=target,
                program=name,
                device=report.total,
                host=report.host_total,
                unit=unit,
            )
        )
    streamed = rows[0]["device"]
    for row in rows:
        row["vs_streamed"] = row["device"] / streamed
    return rows


def _timelines() -> list[dict]:
    """Each update's predicted step on the H100, and its simulated timeline."""
    programs = _stack_programs(clip=True)
    rows, estimates = [], {}
    slugs = {
        "layer-streamed device update": "streamed",
        "host update": "host",
        "delayed host update": "delayed",
    }
    for name, slug in slugs.items():
        fn, args = programs[name]
        estimate = ox.estimate(fn, *args, target="h100")
        estimates[name] = estimate
        estimate.timeline(os.path.join(RESULTS, f"host_update_{slug}.trace.json"))
        assert estimate.simulation is not None and estimate.traced_seconds is not None
        rows.append(
            dict(
                program=name,
                simulated_ms=estimate.seconds * 1e3,
                traced_ms=estimate.traced_seconds * 1e3,
                waited_ms={k: v * 1e3 for k, v in estimate.simulation.waited.items()},
                busy_ms={k: v * 1e3 for k, v in estimate.simulation.busy.items() if v},
            )
        )
    plt = pyplot()
    if plt is not None:
        figure, axes = plt.subplots(len(estimates), 1, figsize=(10, 7), sharex=True)
        for ax, (name, estimate) in zip(axes, estimates.items()):
            estimate.plot_timeline(ax, f"{name}: {estimate.seconds * 1e3:.2f} ms simulated")
        figure.suptitle("8 x 1024^2, clip + adam, hybrid, h100 (simulated)")
        figure.tight_layout()
        figure.savefig(os.path.join(RESULTS, "host_update_timeline.png"), dpi=120)
        plt.close(figure)
    return rows


def run(full: bool = False) -> list[dict]:
    rows = []
    # On TPU the host update is refused (`_host_compute.HOST_UPDATE_PROBLEMS`); bypassed
    # here to measure what it would cost there.
    refused = dict(_host_compute.HOST_UPDATE_PROBLEMS)
    _host_compute.HOST_UPDATE_PROBLEMS.clear()
    try:
        for target in ("h100", "tpu-v5p"):
            if not target_available(target):
                continue
            for clip in (False, True):
                name = f"8 x 1024^2, {'clip + adam' if clip else 'adam'}"
                rows += _measure(name, _stack_programs(clip), target, P)
        if full and target_available("h100"):
            rows += _measure("8B decoder, 1 x 2048", _decoder_programs(), "h100", 2**30)
    finally:
        _host_compute.HOST_UPDATE_PROBLEMS.update(refused)
    body = [
        [
            r["workload"],
            r["target"],
            r["program"],
            f"{r['device'] / r['unit']:.2f}" + ("P" if r["unit"] == P else " GiB"),
            f"{r['host'] / r['unit']:.2f}" + ("P" if r["unit"] == P else " GiB"),
            f"{r['vs_streamed']:.2f}x",
        ]
        for r in rows
    ]
    header = ["workload", "target", "program", "device", "host", "device vs streamed"]
    print(format_table(header, body, markdown=True))
    os.makedirs(RESULTS, exist_ok=True)
    if target_available("h100"):
        times = _timelines()
        print(
            format_table(
                ["program (h100)", "simulated ms", "jaxpr count ms", "stream waits for (ms)"],
                [
                    [
                        t["program"],
                        f"{t['simulated_ms']:.3f}",
                        f"{t['traced_ms']:.3f}",
                        ", ".join(f"{k} {v:.3f}" for k, v in t["waited_ms"].items()),
                    ]
                    for t in times
                ],
                markdown=True,
            )
        )
        with open(os.path.join(RESULTS, "host_update_timeline.json"), "w") as file:
            json.dump(times, file, indent=1)
    path = os.path.join(RESULTS, f"host_update{'' if full else '_smoke'}.json")
    with open(path, "w") as file:
        json.dump(rows, file, indent=1)
    return rows


# -- Llama-2-13B, ZeRO-Offload's way (`--headline`) -----------------------------------------

SEQ = 4096
QKV_SAVED = dict.fromkeys(("q", "k", "v"), "save")
QKV_OFFLOADED = dict.fromkeys(("q", "k", "v"), "offload")
# Host memory one accelerator may use: a whole DGX H100 node's 2 TB for its one training
# GPU, as ZeRO-Offload's single-GPU runs use the node's memory (the host's bandwidth and
# cores stay one GPU's share, `ox.TARGETS["h100"].speeds`); Grace's 480 GB on a GH200.
# The whole delayed update holds the state twice in host memory (XLA:GPU gives a host
# call's results buffers of their own): 13B needs about 390 GB, over the 250 GB share.
HOST_BUDGETS = {"h100": int(2e12)}


def _headline_target(name: str) -> Any:
    """The target `name` with the host memory the headline gives one accelerator
    (`HOST_BUDGETS`), so that the compile's choices (a delayed update spanning the step
    holds the gradients twice in host memory) see the same budget `ox.max_batch` does."""
    import dataclasses

    target = ox.TARGETS[name]
    if name not in HOST_BUDGETS or target.speeds is None:
        return target
    speeds = target.speeds.replace(host_memory=HOST_BUDGETS[name])
    return dataclasses.replace(target, speeds=speeds)


# The batch the issue that made the update span the step (67) asks of ZeRO-Offload's
# declaration, priced beside the largest batches.
DECLARED_BATCH = 6
HEADLINE_PLANS = {
    # ZeRO-Offload's declaration: bfloat16 parameters on the device, masters and moments
    # in host memory, updated there; q, k and v offloaded, the rest recomputed.
    "device, q/k/v offloaded": ox.Strategy(
        "zero_offload", "device", "pinned_host", "remat", names=QKV_OFFLOADED, update="host"
    ),
    # Parameters and state on the host, updated there; every activation recomputed.
    "host, remat": ox.Strategy("host_remat", "pinned_host", "pinned_host", "remat", update="host"),
    # The same with q, k and v saved (less recomputation, more device memory).
    "host, q/k/v saved": ox.Strategy(
        "host_qkv", "pinned_host", "pinned_host", "remat", names=QKV_SAVED, update="host"
    ),
}
# What the others publish (model FLOPs per second, one accelerator): ZeRO-Offload (Ren et
# al., USENIX ATC'21) 40 TFLOP/s training a 10B model on one V100 (fp16 peak 125);
# SuperOffload (arXiv 2509.21271) up to 600 TFLOP/s fine-tuning 20B-class models on one
# GH200 (dense bf16 peak 989); ZenFlow (arXiv 2505.12242) publishes speed-ups, up to 5x
# end to end over ZeRO-Offload, not a rate.
PUBLISHED = [
    ("ZeRO-Offload (ATC'21)", "10B, 1 V100", "40 TFLOP/s", 40 / 125),
    ("SuperOffload (2025)", "20B-class fine-tuning, 1 GH200", "600 TFLOP/s", 600 / 989),
    ("ZenFlow (2025)", "Llama-2-7B, 4 A100", "up to 5x ZeRO-Offload", None),
]


# The optimizer as ZeRO-Offload trains: float32 masters and AdamW moments in host memory
# for the bfloat16 model. `--bf16-moments` runs the rows before masters existed (AdamW on
# the bfloat16 parameters, bfloat16 moments), which no one trains a 13B model with.
MASTERS = {"master_dtype": jnp.float32}


def _headline_setup(delay: int, target: str):
    import dataclasses

    from _decoder import CONFIGS, make_decoder, make_step, with_attention

    # Attention as a user calls it there: cuDNN's fused kernel on the GPUs.
    config = with_attention(dataclasses.replace(CONFIGS["13B"], seq=SEQ), target)
    model = eqx.filter_eval_shape(make_decoder, config, jax.random.key(0))
    model = jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype) if eqx.is_array(x) else x, model
    )
    adamw = optax.adamw(1e-3, weight_decay=0.01)
    opt = ox.offload_optimizer(adamw, update_on="host", delay=delay, **MASTERS)
    state = eqx.filter_eval_shape(opt.init, model)

    def make_args(batch: int) -> tuple:
        return (model, state, jax.ShapeDtypeStruct((batch, SEQ + 1), jnp.int32))

    return config, opt, make_step, make_args


def _headline_row(target: str, plan: str, delay: int, batch: int) -> dict:
    config, opt, make_step, make_args = _headline_setup(delay, target)
    step = make_step(opt, HEADLINE_PLANS[plan])
    estimate = ox.estimate(step, *make_args(batch), target=_headline_target(target))
    assert estimate.simulation is not None
    tokens = batch * SEQ
    # What the update moves over the link per parameter: the gradients sent to host
    # memory, whatever the update phase fetches or sends, and any optimizer state.
    moved = ox.audit(step, *make_args(batch)).transfers
    update_bytes = sum(t.bytes for t in moved if t.kind == "gradient" or t.phase == "update")
    state_bytes = sum(t.bytes for t in moved if t.kind == "optimizer")
    at_half = estimate.with_speeds(efficiency=0.5)
    simulation, half = estimate.simulation, at_half.simulation
    assert half is not None
    waits = simulation.waited
    row = dict(
        target=target,
        plan=plan,
        delay=delay,
        batch=batch,
        seconds=estimate.seconds,
        compute=simulation.busy.get("compute", 0.0),
        exposed_host=waits.get("host", 0.0),
        link_waits=waits.get("h2d", 0.0) + waits.get("d2h", 0.0),
        seconds_half=at_half.seconds,
        compute_half=half.busy.get("compute", 0.0),
        mfu_half=at_half.mfu(6 * config.parameters * tokens),
        clones=_clones(estimate),
        count_seconds=estimate.traced_seconds,
        tokens_per_s=tokens / estimate.seconds,
        tflops=6 * config.parameters * tokens / estimate.seconds / 1e12,
        mfu=estimate.mfu(6 * config.parameters * tokens),
        device_gb=(estimate.device_bytes or 0) / 1e9,
        host_busy=estimate.simulation.busy.get("host", 0.0),
        host_waited=estimate.simulation.waited.get("host", 0.0),
        update_link_bytes_per_parameter=update_bytes / config.parameters,
        state_link_bytes=state_bytes,
    )
    print(f"  {target} {plan} delay={delay} batch {batch}: {row['seconds']:.2f} s", flush=True)
    return row | {"estimate": estimate}


def _clones(estimate: Any) -> int:
    """Instructions of the compiled entry and loops that XLA rematerialized on its own
    (named `*.remat*`)."""
    program = estimate.simulation.program
    return sum(".remat" in i.name for c in program.computations.values() for i in c.instructions)


def _best_delayed(target: str, plan: str) -> list[dict]:
    """The delayed plan at the largest batch it fits (`ox.max_batch`), at half of it and
    at a quarter; the fastest per token first. A full device is not always the fastest:
    the scheduler has less room for its copies."""
    _, opt, make_step, make_args = _headline_setup(1, target)
    largest = ox.max_batch(
        make_step(opt, HEADLINE_PLANS[plan]),
        make_args,
        target=_headline_target(target),
        start=4,
        host_budget=HOST_BUDGETS.get(target),
    )
    batches = sorted({largest, max(1, largest // 2), max(1, largest // 4)}, reverse=True)
    rows = [_headline_row(target, plan, 1, batch) for batch in batches]
    return sorted(rows, key=lambda r: -r["tokens_per_s"])


def headline() -> list[dict]:
    """Each plan delayed at its best batch (of its largest, half and a quarter of it),
    then undelayed at that batch, per target."""
    rows = []
    for target in ("h100", "gh200"):
        for plan in HEADLINE_PLANS:
            best, *others = _best_delayed(target, plan)
            rows += [best, _headline_row(target, plan, 0, best["batch"]), *others]
            if plan.startswith("device") and DECLARED_BATCH not in {r["batch"] for r in others}:
                rows.append(_headline_row(target, plan, 1, DECLARED_BATCH))
    body = [
        [
            r["target"], r["plan"], "yes" if r["delay"] else "no", str(r["batch"]),
            f"{r['seconds']:.2f}", f"{r['compute']:.2f}", f"{r['exposed_host']:.2f}",
            f"{r['link_waits']:.2f}", f"{r['mfu']:.1%}",
            f"{r['seconds_half']:.2f} / {r['compute_half']:.2f}",
            f"{r['seconds_half'] / r['compute_half']:.2f}x", f"{r['mfu_half']:.1%}",
            str(r["clones"]), f"{r['tokens_per_s']:.0f}", f"{r['device_gb']:.1f}",
            f"{r['host_busy']:.2f}",
        ]
        for r in rows
    ]  # fmt: skip
    header = [
        "target", "plan", "delayed", "batch", "step s", "compute s", "host waited s",
        "link waits s", "MFU (6NT)", "at 0.5: step / compute s", "step / compute",
        "MFU at 0.5", "XLA remat clones", "tokens/s", "device GB", "host busy s",
    ]  # fmt: skip
    print(format_table(header, body, markdown=True))
    print(
        format_table(
            ["published", "workload", "rate", "of peak"],
            [[n, w, r, "-" if f is None else f"{f:.0%}"] for n, w, r, f in PUBLISHED],
            markdown=True,
        )
    )
    name = "host_update_13b" if MASTERS else "host_update_13b_bf16_moments"
    if MASTERS:  # the plot shows the headline's way of training
        _headline_plot([r for r in rows if r["target"] == "h100"])
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, f"{name}.json"), "w") as file:
        json.dump([{k: v for k, v in r.items() if k != "estimate"} for r in rows], file, indent=1)
    return rows


def _headline_plot(rows: list[dict]) -> None:
    """The best delayed plan on h100 against the same plan undelayed, one above the other."""
    plt = pyplot()
    if plt is None:
        return
    best = max((r for r in rows if r["delay"]), key=lambda r: r["tokens_per_s"])
    pair = [best] + [r for r in rows if not r["delay"] and r["plan"] == best["plan"]]
    figure, axes = plt.subplots(len(pair), 1, figsize=(10, 5), sharex=True)
    for ax, row in zip(axes, pair):
        title = (
            f"{row['plan']}, batch {row['batch']}, {'delayed' if row['delay'] else 'undelayed'}"
            f" host update: {row['seconds']:.2f} s, MFU {row['mfu']:.1%}"
        )
        row["estimate"].plot_timeline(ax, title)
    figure.suptitle("Llama-2-13B, 4096 tokens per sequence, one H100 (simulated)")
    figure.tight_layout()
    docs = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "docs", "plots")
    figure.savefig(os.path.join(docs, "host_update_13b_timeline.png"), dpi=110)
    plt.close(figure)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--smoke", action="store_true", help="the scanned model, h100 and v5p")
    size.add_argument("--full", action="store_true", help="and the 8B decoder on h100")
    size.add_argument("--headline", action="store_true", help="only Llama-2-13B, delayed")
    parser.add_argument(
        "--bf16-moments",
        action="store_true",
        help="the headline without float32 masters (AdamW's moments in bfloat16)",
    )
    args = parser.parse_args()
    if args.headline:
        if args.bf16_moments:
            MASTERS.clear()
        headline()
    else:
        run(full=args.full)


if __name__ == "__main__":
    main()
