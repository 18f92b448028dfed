"""What only a GPU can check, in one command of at most 8 minutes on one H100.

Every test of "gradients and updates are equal under every strategy" runs on a CPU, where
host and device memory are the same RAM. A GPU is lent now and then, about 15 minutes at
a time with its start; this script spends them, in eight parts:

1. **Equivalence on the device** (the line that matters: `EQUIVALENCE PASS/FAIL`). The
   tutorial's scan (float32 and bfloat16), the experiments' decoder (its own attention)
   and the tutorial's optimizer step with `ox.offload_optimizer` updating on the device,
   on the host (`update_on="host"`) and delayed (`delay=1`, finished by
   `ox.apply_pending`), each under every strategy of `ox.STRATEGIES` (the optimizer's
   MLP names no activations, so `offload_activations` is not one of its), against
   `baseline` on the same device. float32 products run at `"highest"` precision: by
   default XLA:GPU multiplies float32 in TF32 (10 mantissa bits), and another fusion of
   the same step rounds differently (a 1e-3 difference). Adam's epsilon is 1e-3
   (`SMOOTH_EPS`): with 1e-8 a gradient within rounding of zero flips a whole `lr` step.
   Difference: max |a - b| / max |b| per output leaf, at most 1e-5 in
   float32 and 2**-6 in bfloat16 (bf16 keeps 8 significant bits, so XLA computing a value
   in another order, a recomputed or differently fused one, moves it by an ulp, 2**-8 of
   its scale, at each bf16 value it passes through; four such ulps bound the roundings of
   these short programs, while a value that is stale, missing or fetched from the wrong
   place differs by its own size). Every output leaf in the memory its plan gives it, and
   `jax.typeof` showing `<host>` exactly for those in `pinned_host`.
2. **Predicted against measured**, bfloat16 at sizes whose steps take 50 ms or more on an
   H100: the decoder at 1.2B parameters (`_decoder.CONFIGS["1B"]`, batch 4 x 2048
   tokens), the tutorial's scan (10 layers of 4096 x 16384, batch 4096) and optimizer step
   (4 x 12288^2). `ox.estimate(..., compile=True)` (compiled for the attached H100 and
   simulated, as `step_time.py` picks the target) beside the median of batches of calls
   issued without waiting, blocked at each batch's end.
3. **Does `ox.fit` choose as the hardware would?** `ox.fit` on the 1B decoder under a
   24 GiB device budget (every plan it may choose can still run on the 80 GB card); each
   candidate it compiled that fits is timed: Kendall's tau of simulated against measured,
   and whether its choice is the fastest measured.
4. **Memory**: part 2's runs, peak device memory (`memory_stats()["peak_bytes_in_use"]`,
   which JAX cannot reset: see `MEMORY_METHOD`) beside the compiled device total.
5. **The link**: `jax.device_put` between `device` and `pinned_host`, 64 KiB to 1 GiB.
6. **Fused kernels** (`_gpu_check_kernels.py`): cuDNN causal attention, forward and
   backward (batch 4, 4,096 tokens, 32 heads of 128), compiled for the GPU: each cuDNN
   kernel's workspace and the compiled temp bytes beside the deviceless compile's (which
   leaves the workspace out, `MemoryReport.notes`), and its median time beside
   `ox.estimate`'s.
7. **The host update on the GPU machine's host** (`_gpu_check_host.py`, added
   2026-11-29): `benchmarks/host_update.py`'s step at 200M parameters (AdamW, float32
   masters, `update_on="host"`): its median time, parameters per second and threads
   busy, `ox.calibrate_host`'s measurement of that host, and `ox.estimate`'s prediction
   with the target's host figures and with the measured ones; whether the compiled step
   calls our AdamW kernel on the GPU's host (`ox.host_kernels()`), and the same step
   traced with optax's own operations beside it: results (bit for bit?) and time.
8. **Matmuls by shape** (`_gpu_check_matmuls.py`, added 2026-12-08): bf16 `a @ b` at
   the shapes of `MATMUL_SHAPES` (256^3 to 12288^3, and LLM-like rectangles), each
   timed (warm-up, batches of calls blocked at their end) as a fraction of the target's
   peak, beside the fraction its table by shape predicts (`ox.matmul_efficiency`).

The time budget on paper (H100; XLA:GPU compiles of the 1B decoder take tens of seconds
each, small programs one to a few; a persistent compilation cache lets a run compile
reuse the estimate's compile of the same program; a decoder case is an estimate compile,
a run compile and 17 calls):

| part | what costs | seconds |
|---|---|---|
| start | imports, backend | 15 |
| 1 equivalence | 14 scan + 7 decoder + 21 optimizer steps (+ 7 `apply_pending`), small | 110 |
| 5 link | 8 sizes x 2 directions x 5 copies, at most 1 GiB each | 15 |
| 6 kernels | attention: a GPU compile, a deviceless compile and estimate, 11 calls | 15 |
| 7 host | two estimates, a host calibration, 4 compiles, 14 host updates of ~0.5 s | 25 |
| 8 matmuls | 9 shapes: a compile and ~5 batches of ~20 ms each | 10 |
| 2 + 4 timing, memory | decoder: 3 to 5 strategies x ~45 s; scan 5, optimizer 4 x ~8 s | 160 |
| 3 fit | `ox.fit` with 3 compiles (~70 s), then up to 3 candidates at ~25 s | 130 |
| margin | | 5 |
| total | | 480 |

The parts run in that order (the cheap link, kernels and matmuls before the long ones). A
case is skipped, and printed as skipped, when its expected time (the last case of its kind, or the
budget's figure) would overrun its part's share: a part may use what the parts after it
do not need. `--seconds` changes the total.

    python benchmarks/gpu_check.py                    # on the GPU machine
    JAX_PLATFORMS=cpu python benchmarks/gpu_check.py --smoke    # every part, tiny, CPU
    python benchmarks/gpu_check.py --parts equivalence,fit       # some parts only

Writes `gpu_check-<date>.json` and `.md` into `--out` (default `benchmarks/results/`).
Exit status 1 when the equivalence fails. `tests/test_gpu_check.py` runs `--smoke`.
"""

import argparse
import datetime
import json
import os
import sys
import tempfile
import time
from typing import Any

# Before jax starts: a 1B baseline step needs more than the 75% JAX takes by default.
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.92")

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import step_time  # noqa: E402
from _gpu_check_host import host_update  # noqa: E402
from _gpu_check_kernels import kernels  # noqa: E402
from _gpu_check_matmuls import matmuls  # noqa: E402
from _gpu_check_parts import (  # noqa: E402
    Clock,
    equivalence,
    equivalence_lines,
    fit_check,
    link,
    memory,
    timing,
)
from _gpu_check_report import markdown  # noqa: E402
from _gpu_check_work import decoder_workload, optimizer_workload, scan_workload  # noqa: E402

import offload_eqx as ox  # noqa: E402
from offload_eqx._targets.matmul_efficiency import MATMUL_SHAPES  # noqa: E402

_decoder = step_time._decoder
GiB, KiB = 2**30, 2**10
EVERY = tuple(ox.STRATEGIES)
F32_BOUND, BF16_BOUND = 1e-5, 2.0**-6

# Seconds per part on paper (see the docstring); the order is the order they run in.
BUDGETS: dict[str, dict[str, float]] = {
    "gpu": {
        "equivalence": 110,
        "link": 15,
        "kernels": 15,
        "matmuls": 10,
        "host": 25,
        "timing": 160,
        "fit": 130,
    }
}
BUDGETS["smoke"] = {
    "equivalence": 35,
    "link": 2,
    "kernels": 5,
    "matmuls": 2,
    "host": 5,
    "timing": 12,
    "fit": 8,
}
# Part 8's matmuls (M, N, K), bf16 (smoke: tiny).
MATMULS = {"gpu": MATMUL_SHAPES, "smoke": ((64, 64, 64), (128, 256, 64))}
# Part 7's host update: parameters (smoke: 1M).
HOST_PARAMETERS = {"gpu": 200_000_000, "smoke": 1_000_000}
# Part 6's attention: Llama-2-7B/13B's heads at 4,096 tokens (smoke: tiny).
ATTENTION = {"gpu": (4, 4096, 32, 128), "smoke": (1, 256, 2, 64)}


def _equivalence_cases(size: str) -> list[dict]:
    f32, bf16 = jnp.float32, jnp.bfloat16
    if size == "smoke":
        scan = dict(layers=3, batch=16, width=32, hidden=64)
        decoder = _decoder.Config("smoke", vocab=64, dim=32, ffn=64, layers=2, heads=2, seq=8)
        mlp, few = 32, ("baseline", "hybrid")
    else:
        scan = dict(layers=4, batch=256, width=256, hidden=1024)
        decoder = _decoder.Config("small", vocab=2048, dim=256, ffn=768, layers=4, heads=4, seq=128)
        mlp, few = 1024, EVERY
    unnamed = tuple(s for s in few if s != "offload_activations")  # no activation names
    cases = [{"workload": scan_workload(scan, f32), "strategies": EVERY, "bound": F32_BOUND}]
    if size != "smoke":  # the same code in another dtype: a CPU emulates bf16, slowly
        cases.append(
            {"workload": scan_workload(scan, bf16), "strategies": few, "bound": BF16_BOUND}
        )
    cases += [
        {
            "workload": decoder_workload(decoder, 2, f32, grads=True, smooth=True),
            "strategies": few,
            "bound": F32_BOUND,
        },
    ]
    for update in ("device", "host", "delayed"):
        work = optimizer_workload(mlp, f32, update, smooth=True)
        cases.append({"workload": work, "strategies": unnamed, "bound": F32_BOUND, "steps": 2})
    return cases


def _timed_cases(size: str) -> tuple[list[dict], dict]:
    """Part 2's workloads and strategies (ordered roughly by device memory, lowest first,
    so that each one's peak shows), and part 3's."""
    if size == "smoke":
        scan = scan_workload(dict(layers=3, batch=64, width=64, hidden=128), jnp.float32)
        timed = [
            {"workload": scan, "strategies": ("offload_activations", "baseline"), "prior": 2},
            {
                "workload": optimizer_workload(64, jnp.float32, "device"),
                "strategies": ("offload_optimizer",),
                "prior": 2,
            },
        ]
        # Every plan fits a CPU: the budget only has to let several fit, so tau has pairs.
        fit = {"workload": scan, "budget_fraction": 1.0, "max_compiles": 3}
        return timed, fit | {"prior": 2, "prior_fit": 10}
    bf16 = jnp.bfloat16
    decoder = decoder_workload(_decoder.CONFIGS["1B"], 4, bf16)
    scan = scan_workload(dict(layers=10, batch=4096, width=4096, hidden=16384), bf16)
    decoder_order = ("hybrid", "offload_activations", "remat", "offload_optimizer", "baseline")
    timed = [
        {"workload": decoder, "strategies": decoder_order, "prior": 45},
        {
            "workload": scan,
            "strategies": ("hybrid", "offload_activations", "remat", "offload_params", "baseline"),
            "prior": 8,
        },
    ]
    for update in ("device", "host", "delayed"):
        strategies = ("offload_optimizer", "baseline") if update == "device" else ("hybrid",)
        work = optimizer_workload(12288, bf16, update)
        timed.append({"workload": work, "strategies": strategies, "prior": 8})
    fit = {"workload": decoder, "budget_bytes": 24 * GiB, "max_compiles": 3}
    return timed, fit | {"prior": 25, "prior_fit": 100}


def _link_sizes(size: str) -> list[int]:
    top = 4 * 2**20 if size == "smoke" else GiB
    sizes = [64 * KiB]
    while sizes[-1] * 4 <= top:
        sizes.append(sizes[-1] * 4)
    return sizes


def _use_compilation_cache() -> None:
    """A run compile then finds the estimate's compile of the same program on disk."""
    path = os.path.join(tempfile.gettempdir(), "gpu_check_jax_cache")
    try:
        jax.config.update("jax_compilation_cache_dir", path)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
    except (AttributeError, KeyError, ValueError) as error:  # another jax: compile twice
        print(f"no persistent compilation cache: {error}")


PARTS = ("equivalence", "link", "kernels", "matmuls", "host", "timing", "fit")


def run(
    size: str,
    seconds: float,
    target: str | None,
    only: tuple[str, ...] = PARTS,
    keep: str | None = None,
) -> dict[str, Any]:
    backend = jax.default_backend()
    target = target or step_time.DEFAULT_TARGETS.get(backend, "h100")
    if size != "smoke":
        _use_compilation_cache()
    budgets = {name: share for name, share in BUDGETS[size].items() if name in only}
    clock = Clock(seconds, budgets)
    calls = (2, 2) if size == "smoke" else (5, 3)
    timed, fit_case = _timed_cases(size)
    parts: dict[str, Any] = {}
    part_seconds: dict[str, float] = {}

    def part(name: str, work) -> Any:
        clock.begin(name)
        begin = time.perf_counter()
        print(f"== {name} (budget {budgets[name]} s, {clock.left():.0f} s left)", flush=True)
        result = work()
        part_seconds[name] = time.perf_counter() - begin
        print(f"== {name} took {part_seconds[name]:.1f} s", flush=True)
        return result

    prior = 3 if size == "smoke" else 6

    def exact_equivalence() -> dict[str, Any]:
        with jax.default_matmul_precision("highest"):  # float32 products in float32, not TF32
            return equivalence(_equivalence_cases(size), clock, prior)

    if "equivalence" in only:
        parts["equivalence"] = part("equivalence", exact_equivalence)
        for line in equivalence_lines(parts["equivalence"]):
            print(line, flush=True)
    if "link" in only:
        parts["link"] = part("link", lambda: link(_link_sizes(size), 3 if size == "smoke" else 5))
    if "kernels" in only:
        repeats = 3 if size == "smoke" else 10
        parts["kernels"] = part("kernels", lambda: kernels(ATTENTION[size], target, repeats))
    if "matmuls" in only:
        repeats = 2 if size == "smoke" else 5
        parts["matmuls"] = part("matmuls", lambda: matmuls(MATMULS[size], target, repeats))
    if "host" in only:
        repeats = 2 if size == "smoke" else 5
        host = HOST_PARAMETERS[size]
        parts["host"] = part("host", lambda: host_update(host, target, repeats))
    if "timing" in only:
        parts["timing"] = part("timing", lambda: timing(timed, target, clock, *calls, keep))
        parts["memory"] = memory(parts["timing"])
    if "fit" in only:
        parts["fit"] = part("fit", lambda: fit_check(fit_case, target, clock, *calls))
    return {
        "date": datetime.date.today().isoformat(),
        "command": " ".join(["python", *sys.argv]),
        "backend": backend,
        "device": str(jax.devices()[0].device_kind),
        "target": target,
        "size": size,
        "budget_seconds": seconds,
        "budgets": budgets,
        "part_seconds": part_seconds,
        "seconds": time.perf_counter() - clock.start,
        "skipped": clock.skipped,
        "parts": parts,
        "versions": {"jax": jax.__version__, "equinox": eqx.__version__},
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="every part, tiny, on a CPU")
    parser.add_argument("--out", default=step_time.RESULTS, help="where the results go")
    parser.add_argument("--seconds", type=float, help="total time (default 480; smoke 60)")
    parser.add_argument("--target", help="the target to price with (default: by backend)")
    parser.add_argument(
        "--parts", default=",".join(PARTS), help=f"which parts, comma-separated: {PARTS}"
    )
    args = parser.parse_args()
    only = tuple(args.parts.split(","))
    if unknown := set(only) - set(PARTS):
        parser.error(f"--parts: unknown {sorted(unknown)}; the parts are {PARTS}")
    if not args.smoke and jax.default_backend() != "gpu":
        print(f"gpu_check.py needs a GPU (backend {jax.default_backend()!r}); --smoke runs it tiny")
        return 0
    size = "smoke" if args.smoke else "gpu"
    os.makedirs(args.out, exist_ok=True)
    # On the GPU, a step predicted far off keeps its compiled program beside the results.
    keep = None if args.smoke else args.out
    result = run(size, args.seconds or (60 if args.smoke else 480), args.target, only, keep)
    text = markdown(result)
    print(text)
    stem = os.path.join(args.out, f"gpu_check-{result['date']}")
    with open(stem + ".json", "w") as f:
        json.dump(result, f, indent=1, default=str)
    with open(stem + ".md", "w") as f:
        f.write(text)
    print(f"wrote {stem}.json and .md")
    if "equivalence" not in only:
        return 0
    for line in equivalence_lines(result["parts"]["equivalence"])[:1]:
        print(line)
    return 0 if result["parts"]["equivalence"]["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
