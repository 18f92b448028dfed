"""Instructions per call of `ox.filter_jit` against `eqx.filter_jit` and `jax.jit`, counted.

`dispatch.py` times the calls, and on a shared machine the time of a call is as much the
other processes' as the wrapper's. Here the same candidates run under Valgrind's
callgrind, which counts the instructions the calling thread executes: a count that load
does not change (the program's own execution, on XLA's threads, is left out, as it is
the same program for every candidate). Each candidate is called `--calls` times between
two client requests, after warm-up calls, so the count is of the per-call path alone.

Needs `valgrind` and a C compiler with Valgrind's headers (`valgrind/callgrind.h`) to
build the two-function helper that starts and stops the count; says so and exits where
they are missing. Under Valgrind a call takes ~50 times as long: a run takes a few
minutes, most of it importing JAX.

    python benchmarks/dispatch_instructions.py [--calls 300] [--smoke]
"""

import argparse
import ctypes
import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile
from typing import Any

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
_HELPER = r"""
#include <valgrind/callgrind.h>
void count_start(void) { CALLGRIND_ZERO_STATS; CALLGRIND_START_INSTRUMENTATION; }
void count_stop(const char *name) { CALLGRIND_STOP_INSTRUMENTATION; CALLGRIND_DUMP_STATS_AT(name); }
"""
WARMUP = 50


def _child(helper: str, calls: int) -> None:
    """Under callgrind: count each candidate's `calls` calls, one dump per candidate."""
    import jax

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import dispatch

    count = ctypes.CDLL(helper)
    for name, (fn, args) in dispatch.candidates().items():
        for _ in range(WARMUP):  # compiled, and every cache warm
            out = fn(*args)
        jax.block_until_ready(out)
        count.count_start()
        for _ in range(calls):
            out = fn(*args)
        jax.block_until_ready(out)
        count.count_stop(name.encode())


def _missing() -> str | None:
    for tool in ("valgrind", "cc"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not on PATH"
    return None


def run(calls: int = 300) -> dict[str, Any]:
    """Count the instructions per call of every candidate of `dispatch.py`."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from dispatch import RATIOS

    with tempfile.TemporaryDirectory() as work:
        source, helper = os.path.join(work, "count.c"), os.path.join(work, "count.so")
        with open(source, "w") as f:
            f.write(_HELPER)
        subprocess.run(["cc", "-O2", "-shared", "-fPIC", "-o", helper, source], check=True)
        out = os.path.join(work, "callgrind.out")
        command = [
            "valgrind",
            "--tool=callgrind",
            "--instr-atstart=no",
            "--separate-threads=yes",
            f"--callgrind-out-file={out}",
            sys.executable,
            os.path.abspath(__file__),
            "--child",
            helper,
            "--calls",
            str(calls),
        ]
        subprocess.run(command, check=True, capture_output=True)
        per_call = {}
        for dump in sorted(glob.glob(out + ".*-01")):  # thread 1: the calling thread
            name, total = _read_dump(dump)
            if name is not None:
                per_call[name] = total / calls
    ratios = {
        label: per_call[top] / per_call[bottom] if top in per_call and bottom in per_call else None
        for label, (top, bottom) in RATIOS.items()
    }
    return {"calls": calls, "instructions_per_call": per_call, "ratios": ratios}


def _read_dump(path: str) -> tuple[str | None, int]:
    """The client request's name a callgrind dump was taken at, and its instructions."""
    name, total = None, 0
    with open(path) as f:
        for line in f:
            if line.startswith("desc: Trigger: Client Request: "):
                name = line.split("Client Request: ", 1)[1].strip()
            elif line.startswith("totals:"):
                total = int(line.split()[1])
    return name, total


def report(result: dict[str, Any]) -> str:
    lines = [f"{'instructions per call':<28} {'calling thread':>15}"]
    for name, count in result["instructions_per_call"].items():
        lines.append(f"{name:<28} {count:>15,.0f}")
    for label, ratio in result["ratios"].items():
        lines.append(f"{label:<28} {'-' if ratio is None else f'{ratio:.3f}':>15}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--smoke", action="store_true", help="30 calls each")
    parser.add_argument("--child", metavar="HELPER", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(args.child, args.calls)
        return
    missing = _missing()
    if missing is not None:
        print(f"Not counted: {missing} (this benchmark runs under Valgrind's callgrind).")
        return
    result = run(30 if args.smoke else args.calls)
    print(report(result))
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, "dispatch_instructions.json"), "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
