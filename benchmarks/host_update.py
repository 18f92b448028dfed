"""The optimizer update on the host, against what the same machine can do.

ZeRO-Offload's bet is that the host updates the optimizer state at its memory's speed.
This benchmark times offload_eqx's host update (the optimizer guide's recipe:
`ox.offload_optimizer(optax.adamw(...), update_on="host", master_dtype=jnp.float32)`,
`ox.update_and_apply` inside `ox.filter_jit(..., donate="all-except-first")`) beside the
same AdamW computed other ways, on the same parameters, in one process:

- **triad**: STREAM's `a = b + s c` over float32 (a C loop on the same threads; counted
  as STREAM counts, 12 bytes an element): the memory bandwidth of this run, and the
  *roofline* it implies for the update's minimum traffic (28 bytes per
  parameter with float32 masters and moments: read the bfloat16 gradient, mu, nu and the
  master, write mu, nu, the master and the bfloat16 parameter; 14 with bfloat16 moments
  and no masters);
- **fused C**: that minimum in one in-place pass per leaf (`_host_update_kernel.c`, built
  with the system's C compiler, vectorised, on OpenMP threads): what DeepSpeed's CPU-Adam
  does per tile, and the bar;
- **jax.jit**: a plain `jax.jit` of `optax.adamw` on the masters, state donated;
- **DeepSpeed CPU-Adam**, where it is installed (`pip install torch deepspeed`; it builds
  its op with the system's C++ compiler on first use, float32 operands): a peer, never a
  dependency of the package.

Rounds interleave the candidates (the order rotated each round), so drift in the
machine's load hits all of them; each candidate's time is its median over the rounds,
and every ratio is of two medians of the same run. `ox.estimate(step, ..., target="cpu")`
of the same step is printed beside what it measured. Layouts: 4 equal leaves, 192 equal
leaves, and the experiments' decoder scaled to the size (its embedding, head, norms and
stacked blocks). With `--threads 1` the process is pinned to one core before JAX starts
(XLA:CPU sizes its thread pool from the cores it may use).

    python benchmarks/host_update.py                     # 10M, 50M, 200M; every layout
    python benchmarks/host_update.py --threads 1         # the same on one core
    python benchmarks/host_update.py --smoke             # 1M, two layouts, 2 rounds

It prints a markdown table and writes `host_update-<threads>.json` into
`benchmarks/results/`.
"""

import argparse
import ctypes
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")
KERNEL = os.path.join(HERE, "_host_update_kernel.c")

LAYOUTS = "4,192,decoder"


def _pin_before_jax(threads: str) -> None:
    if threads == "1" and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})


def _build_kernel() -> Any:
    """The C peers as a ctypes library, or None without a C compiler."""
    out = os.path.join(tempfile.gettempdir(), f"ox_host_update_kernel_{os.getuid()}.so")
    command = ["cc", "-O3", "-march=native", "-fno-math-errno", "-fopenmp", "-shared", "-fPIC"]
    try:
        subprocess.run([*command, KERNEL, "-o", out, "-lm"], check=True, capture_output=True)
    except (OSError, subprocess.CalledProcessError):
        return None
    lib = ctypes.CDLL(out)
    f32, ptr, n = ctypes.c_float, ctypes.c_void_p, ctypes.c_int64
    lib.adamw_bf16.argtypes = [n, ptr, ptr, ptr, ptr, ptr, f32, f32, f32, f32, f32, f32, f32]
    lib.triad.argtypes = [n, ptr, ptr, ptr, f32]
    return lib


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="10e6,50e6,200e6", help="parameters, comma-separated")
    parser.add_argument("--layouts", default=LAYOUTS)
    parser.add_argument("--moments", default="float32,bfloat16")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", default="all", choices=["all", "1"])
    parser.add_argument("--no-estimate", action="store_true", help="skip ox.estimate")
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--out", default=RESULTS)
    parser.add_argument("--case", help=argparse.SUPPRESS)  # size:layout:moments, in a child
    args = parser.parse_args()
    if args.case:
        _one_case(args)
        return
    if args.smoke:  # 1M parameters, 2 rounds; two layouts unless some are given
        args.sizes, args.rounds = "1e6", 2
        args.layouts = "4,decoder" if args.layouts == LAYOUTS else args.layouts
    rows = []
    for size in (int(float(s)) for s in args.sizes.split(",")):
        for layout in args.layouts.split(","):
            for moments in args.moments.split(","):
                row = _in_a_process(args, f"{size}:{layout}:{moments}")
                rows.append(row)
                print(_line(row), flush=True)
    _report(rows, args)


def _in_a_process(args: Any, case: str) -> dict:
    """One case in a process of its own: its memory returned when it ends (a 200M case
    holds about 3 GB a candidate), this machine's speeds measured beside it."""
    command = [sys.executable, os.path.abspath(__file__), "--case", case]
    command += ["--rounds", str(args.rounds), "--threads", args.threads]
    command += ["--no-estimate"] if args.no_estimate else []
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"case {case} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _one_case(args: Any) -> None:
    _pin_before_jax(args.threads)
    from _host_update_cases import run_case  # imports jax: after the pinning

    size, layout, moments = args.case.split(":")
    row = run_case(int(size), layout, moments, args.rounds, _build_kernel(), not args.no_estimate)
    row["threads"] = args.threads
    print(json.dumps(row), flush=True)


COLUMNS = (
    ("parameters", "params", "{:,}"),
    ("layout", "leaves", "{}"),
    ("moments", "moments", "{}"),
    ("ox ms", "ox", "{:.1f}"),
    ("fused C ms", "fused C", "{:.1f}"),
    ("jax.jit ms", "jax.jit", "{:.1f}"),
    ("DeepSpeed ms", "deepspeed", "{:.1f}"),
    ("ox / fused", "ox / fused C", "{:.2f}"),
    ("ox / jit", "ox / jax.jit", "{:.2f}"),
    ("ox / DeepSpeed", "ox / deepspeed", "{:.2f}"),
    ("roofline", "roofline fraction", "{:.0%}"),
    ("fused roofline", "fused roofline fraction", "{:.0%}"),
    ("triad GB/s", "triad GB/s", "{:.1f}"),
    ("estimate ms", "estimate", "{:.1f}"),
    ("estimate / ox", "estimate / ox", "{:.2f}"),
    ("load", "load", "{:.2f}"),
)


def _cell(row: dict, key: str, form: str) -> str:
    value = row.get(key)
    return "-" if value is None else form.format(value)


def _line(row: dict) -> str:
    return "| " + " | ".join(_cell(row, key, form) for _, key, form in COLUMNS) + " |"


def _report(rows: list[dict], args: Any) -> None:
    header = "| " + " | ".join(title for title, _, _ in COLUMNS) + " |"
    print(f"\nHost update, {args.threads} thread(s), median of {args.rounds} rounds")
    print(header)
    print("|" + "---|" * len(COLUMNS))
    for row in rows:
        print(_line(row))
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"host_update-{args.threads}.json")
    with open(path, "w") as f:
        json.dump({"rows": rows, "date": time.strftime("%Y-%m-%d")}, f, indent=1)
    print(f"wrote {path}")


if __name__ == "__main__":
    sys.path.insert(0, HERE)
    main()
