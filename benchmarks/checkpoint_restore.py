"""`ox.restore_checkpoint` against Orbax's own restore into the same target, for many arrays.

A checkpoint of many small arrays (a deep model's biases and norms, an optimizer state's
counters) is where per-array overhead shows: `ox.restore_checkpoint` asked Orbax's
`metadata` for every array's shape and dtype before restoring (Orbax opens each array's
TensorStore for it), and took 12.8 s where Orbax's restore of the same 6,001 arrays into
the same `ox.abstract` target took 1.0 s. Both restores are timed here in rounds (each
round times each once, the order rotated from round to round, so drift in the machine's
load hits both alike); each round gives its own ratio, and the report is the median
ratio beside every round's. The TensorStore opens of one restore of each are counted
too: ours should open no array that Orbax's restore does not.

    python benchmarks/checkpoint_restore.py [--arrays 6001] [--rounds 5] [--host] [--smoke]
"""

import argparse
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

import offload_eqx as ox

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
OURS, ORBAX = "ox.restore_checkpoint", "orbax StandardCheckpointer.restore"


class HostLayer(eqx.Module):
    """A layer whose weight and bias live in host memory between steps."""

    w: jax.Array = ox.field(memory="pinned_host")
    b: jax.Array = ox.field(memory="pinned_host")


def state(arrays: int, host: bool = False) -> dict[str, Any]:
    """`arrays` small arrays: pairs of a weight and a bias per layer, and a step count;
    with `host`, every pair in host memory (`ox.field(memory="pinned_host")`)."""
    pairs = [(jnp.full((16,), float(i)), jnp.zeros((4,))) for i in range((arrays - 1) // 2)]
    if host:
        return ox.place({"layers": [HostLayer(w, b) for w, b in pairs], "step": jnp.int32(0)})
    return {"layers": [{"w": w, "b": b} for w, b in pairs], "step": jnp.int32(0)}


def _seconds(restore: Callable[[], Any]) -> float:
    start = time.perf_counter()
    jax.block_until_ready(restore())
    return time.perf_counter() - start


def _opens(restore: Callable[[], Any]) -> int:
    """How many TensorStores one restore opens (each array's, and for metadata)."""
    import tensorstore

    real, count = tensorstore.open, [0]

    def counted(*args: Any, **kwargs: Any) -> Any:
        count[0] += 1
        return real(*args, **kwargs)

    tensorstore.open = counted
    try:
        restore()
    finally:
        tensorstore.open = real
    return count[0]


def run(
    arrays: int = 6001, rounds: int = 5, strategy: str = "baseline", host: bool = False
) -> dict[str, Any]:
    """Save `state(arrays, host)` once, then restore it `rounds` times with each restore,
    Orbax's into the same target `ox.abstract` plans (`jax.ShapeDtypeStruct`s with their
    memory: host memory for host-resident leaves)."""
    import orbax.checkpoint as ocp

    directory = tempfile.mkdtemp()
    path = os.path.join(directory, "ckpt")
    try:
        tree = state(arrays, host)
        ox.save_checkpoint(path, tree)
        like = eqx.filter_eval_shape(lambda: tree)
        target = ox.abstract(like, strategy)
        checkpointer = ocp.StandardCheckpointer()
        candidates = {
            OURS: lambda: ox.restore_checkpoint(path, like, strategy),
            ORBAX: lambda: checkpointer.restore(path, target),
        }
        for restore in candidates.values():  # compile and warm the caches, untimed
            restore()
        opens = {name: _opens(restore) for name, restore in candidates.items()}
        times: dict[str, list[float]] = {name: [] for name in candidates}
        names = list(candidates)
        for round_index in range(rounds):
            shift = round_index % len(names)
            for name in names[shift:] + names[:shift]:
                times[name].append(_seconds(candidates[name]))
        checkpointer.close()
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    ratios = [ours / orbax for ours, orbax in zip(times[OURS], times[ORBAX])]
    return {
        "arrays": arrays,
        "rounds": rounds,
        "strategy": strategy,
        "host": host,
        "seconds": times,
        "median_seconds": {name: float(np.median(t)) for name, t in times.items()},
        "ratios": ratios,
        "median_ratio": float(np.median(ratios)),
        "tensorstore_opens": opens,
        "versions": {"jax": jax.__version__, "orbax": ocp.__version__},
    }


def report(result: dict[str, Any]) -> str:
    rounds = range(1, result["rounds"] + 1)
    lines = [
        f"{result['arrays']} arrays{' in host memory' if result['host'] else ''}, strategy "
        f"{result['strategy']!r}",
        f"{'seconds':<36} {'median':>8}  " + " ".join(f"{i:>6}" for i in rounds),
    ]
    for name, samples in result["seconds"].items():
        each = " ".join(f"{t:>6.2f}" for t in samples)
        lines.append(f"{name:<36} {result['median_seconds'][name]:>8.2f}  {each}")
    each = " ".join(f"{r:>6.2f}" for r in result["ratios"])
    lines.append(f"{'ours / orbax':<36} {result['median_ratio']:>8.2f}  {each}")
    for name, count in result["tensorstore_opens"].items():
        lines.append(f"TensorStore opens, {name}: {count}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--arrays", type=int, default=6001)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--strategy", default="baseline")
    parser.add_argument("--host", action="store_true", help="the arrays in host memory")
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--smoke", action="store_true", help="201 arrays, 2 rounds, for CI")
    size.add_argument("--full", action="store_true", help="the defaults")
    args = parser.parse_args()
    if args.smoke:
        args.arrays, args.rounds = 201, 2
    result = run(args.arrays, args.rounds, args.strategy, args.host)
    print(report(result))
    os.makedirs(RESULTS, exist_ok=True)
    with open(
        os.path.join(
            RESULTS, "checkpoint_restore-host.json" if args.host else "checkpoint_restore.json"
        ),
        "w",
    ) as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
