"""The TPU blog's comparison re-run: q, k, v offloaded against full remat on a v5p slice.

The blog (Google and Intel, host offloading with JAX on one v5p-8 instance: 4 chips)
measured MaxText's Llama2-13B training step about 5% faster with q, k and v offloaded
(`remat_policy: qkv_proj_offloaded`) than with everything recomputed (`full`), a 10% gain
fine-tuning PaliGemma2 28B (sequences of 256, batch 256), and none for its 3B and 9B
variants. Here the experiments' decoder (`_decoder.py`) at those sizes trains on the same
slice, compiled for `tpu-v5p-4` without the hardware (the 8-device CPU mesh stands for its
4 chips), every weight and optimizer-state leaf sharded over the chips (FSDP, as
`multi_device.py`), bf16 weights and AdamW state, everything on the device:

- `full_remat`: every value of a layer recomputed (MaxText's `remat_policy: full`);
- `qkv_offloaded`: q, k, v offloaded to host memory, the rest recomputed.

Each step is priced with `ox.estimate` (the compiled schedule simulated) and with the
jaxpr count, and simulated again over other host links (`StepEstimate.with_speeds`).
The sizes: Llama-2-13B's shape at sequences of 2,048 (4 per chip); decoders of
Gemma-2-2B/9B/27B-like widths (the language models of PaliGemma2 3B/9B/28B: their
width, MLP width and depth; heads of 128, half as many key/value heads, a 32,000-token
vocabulary) at sequences of 256, 64 per chip (the blog's 256 over 4 chips), every weight
trained (the blog fine-tuned the attention layers only).

Printed and written to `experiments/results/blog_comparison[_TAG].json`.

    python experiments/blog_comparison.py --smoke   # a small decoder: seconds
    python experiments/blog_comparison.py           # Llama-2-13B only
    python experiments/blog_comparison.py --full    # 13B and the three Gemma-like sizes
"""

import argparse
import json
import os
import sys
import time
from typing import Any

# Eight CPU devices stand for the slice's chips: set before JAX starts (as multi_device.py).
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v5p-8")
os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from _decoder import CONFIGS, Config, make_step, optimizer_for, with_attention  # noqa: E402
from _report import RESULTS, format_table, target_available  # noqa: E402
from _repricing import GB, at_link, break_even, no_overlap  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402
from multi_device import _guarded, sharded_args  # noqa: E402

import offload_eqx as ox  # noqa: E402

TARGET, CHIPS = "tpu-v5p-4", 4
QKV = dict.fromkeys(("q", "k", "v"), "offload")
PRESETS = {
    "full_remat": ox.Strategy("full_remat", "device", "device", "remat"),
    "qkv_offloaded": ox.Strategy("qkv_offloaded", "device", "device", "remat", names=QKV),
}
LINKS = (8, 16, 32, 64)  # GB/s host-to-device, device-to-host scaled alike


def _gemma_like(name: str, dim: int, ffn: int, layers: int) -> Config:
    heads = dim // 128
    return Config(name, 32000, dim, ffn, layers, heads, 256, kv_heads=heads // 2)


# (config, sequences per chip, what the blog measured)
RUNS = {
    "13B": (CONFIGS["13B"], 4, "Llama2-13B (MaxText): ~5% faster"),
    "2B": (_gemma_like("2B-like", 2304, 9216, 26), 64, "PaliGemma2 3B: no gain"),
    "9B": (_gemma_like("9B-like", 3584, 14336, 42), 64, "PaliGemma2 9B: no gain"),
    "27B": (_gemma_like("27B-like", 4608, 36864, 46), 64, "PaliGemma2 28B: ~10% faster"),
    "tiny": (Config("tiny", 4096, 512, 1408, 2, 4, 256, kv_heads=2), 4, "-"),
}
SIZES = {"smoke": ["tiny"], "default": ["13B"], "full": ["13B", "2B", "9B", "27B"]}
TIMEOUT = 1200.0  # seconds for one size's two compiles


def _tokens(config: Config, per_chip: int, args: tuple) -> tuple:
    """`sharded_args`' model and state, with `per_chip` sequences per chip."""
    model, state, tokens = args
    sharding = NamedSharding(tokens.sharding.mesh, P("fsdp"))
    shape = (per_chip * CHIPS, config.seq + 1)
    return model, state, jax.ShapeDtypeStruct(shape, jnp.int32, sharding=sharding)


def compare(size: str) -> dict:
    """Both presets compiled for the slice and simulated, and the gain re-priced."""
    config, per_chip, blog = RUNS[size]
    config = with_attention(config, TARGET)  # splash attention, per chip
    mesh, args = sharded_args(config, CHIPS)
    args = _tokens(config, per_chip, args)
    estimates = {}
    for name, preset in PRESETS.items():
        step = make_step(optimizer_for("hybrid", config), preset, mesh)  # AdamW by layer
        estimates[name] = ox.estimate(step, *args, target=TARGET)
    remat, qkv = estimates["full_remat"], estimates["qkv_offloaded"]

    def phases(e: Any) -> dict:
        return {k: vars(v) for k, v in e.phases.items()}

    tokens = per_chip * CHIPS * config.seq
    return {
        "size": size,
        "config": config.name,
        "parameters": config.parameters,
        "tokens": tokens,
        "blog": blog,
        "seconds": {k: e.seconds for k, e in estimates.items()},
        "counted": {k: e.traced_seconds for k, e in estimates.items()},
        "device": {k: e.device_bytes for k, e in estimates.items()},
        "moved": qkv.h2d_bytes + qkv.d2h_bytes,
        "waited": dict(qkv.simulation.waited) if qkv.simulation else {},
        "gain": 1 - qkv.seconds / remat.seconds,
        "gain_counted": 1 - qkv.traced_seconds / remat.traced_seconds,
        "gain_no_overlap": 1 - no_overlap(phases(qkv)) / no_overlap(phases(remat)),
        "gain_at_link": {
            str(bw): 1 - at_link(qkv, bw * GB).seconds / remat.seconds for bw in LINKS
        },
        "break_even_link": break_even(qkv, remat),
        "recompute_saved_share": (remat.recompute_flops - qkv.recompute_flops) / remat.flops,
    }


def _gb(device: int) -> str:
    """Device bytes per chip in GB, marked where they exceed the chip's memory."""
    capacity = ox.TARGETS[TARGET].capacity or float("inf")
    return f"{device / GB:.1f}" + (" (over)" if device > capacity else "")


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.0f}" if seconds >= 1 else f"{seconds * 1e3:.3g}"


def table(rows: list[dict]) -> str:
    header = [
        "size", "parameters", "tokens/step", "full remat ms", "qkv ms", "gain",
        "by the count", "no overlap", *(f"link {bw} GB/s" for bw in LINKS),
        "break-even GB/s", "q/k/v share of FLOPs", "device GB: remat / qkv", "blog",
    ]  # fmt: skip
    lines = []
    for r in rows:
        if "error" in r:
            lines.append([r["plan"], *["-"] * (len(header) - 2), r["error"]])
            continue
        even = r["break_even_link"]
        lines.append([
            r["config"], f"{r['parameters'] / 1e9:.1f}B", r["tokens"],
            _ms(r["seconds"]["full_remat"]), _ms(r["seconds"]["qkv_offloaded"]),
            f"{r['gain']:+.1%}",
            f"{r['gain_counted']:+.1%}", f"{r['gain_no_overlap']:+.1%}",
            *(f"{r['gain_at_link'][str(bw)]:+.1%}" for bw in LINKS),
            "below 0.1" if even is None else f"{even:.1f}",
            f"{r['recompute_saved_share']:.1%}",
            " / ".join(_gb(r["device"][name]) for name in PRESETS), r["blog"],
        ])  # fmt: skip
    return format_table(header, lines, markdown=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--smoke", action="store_true", help="a small decoder")
    group.add_argument("--full", action="store_true", help="13B and the Gemma-like sizes")
    parser.add_argument("--sizes", nargs="+", choices=[k for k in RUNS if k != "tiny"])
    options = parser.parse_args()
    size = "smoke" if options.smoke else "full" if options.full else "default"
    if not target_available(TARGET):
        return
    speeds = ox.TARGETS[TARGET].speeds
    assert speeds is not None
    print(
        f"{TARGET}: host link {speeds.h2d_bandwidth / GB:.0f} GB/s in, "
        f"{speeds.d2h_bandwidth / GB:.0f} GB/s out (assumed: not published)"
    )
    rows = []
    for name in options.sizes or SIZES[size]:
        start = time.perf_counter()
        rows.append(_guarded(name, TIMEOUT, compare, name))
        gain = rows[-1].get("gain")
        said = f"q/k/v offloaded {gain:+.1%} against full remat" if gain is not None else rows[-1]
        print(f"  {name}: {said} ({time.perf_counter() - start:.0f} s)", flush=True)
    print(table(rows))
    tag = "" if size == "full" and not options.sizes else f"_{size}"
    os.makedirs(RESULTS, exist_ok=True)
    path = os.path.join(RESULTS, f"blog_comparison{tag}.json")
    with open(path, "w") as f:
        json.dump(rows, f, indent=1, default=str)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
