"""Per-call dispatch overhead of `ox.filter_jit` against `eqx.filter_jit` and `jax.jit`.

The function is tiny (a small `eqx.nn.MLP` on one vector), so a call's time is almost all
dispatch: flattening, the cache lookup and jax.jit's C++ fast path. Absolute microseconds
on a noisy 2-core machine mean little; the ratio of two wrappers timed side by side does.
So the candidates are timed in rounds: in each round every candidate is timed once
(interleaved, in an order rotated each round, so drift in the machine's load hits all of
them alike), each round gives its own ratios, and the report is the median ratio over the
rounds, beside every round's ratio, and the ratio of each candidate's fastest sample (the
steadiest on a shared machine: other work only adds time). Beside wall time, each round
times the calling thread's CPU time (`time.thread_time`): the wrapper's own work, which
the other processes of a loaded machine do not stretch as they stretch the wall clock
(the program itself runs on XLA's threads); the load average is printed with them.
`dispatch_instructions.py` counts the instructions of a call instead, which load does not
change at all.

Candidates, all computing `model(x)`:
- `ox.filter_jit(forward)(model, x)`, `eqx.filter_jit(forward)(model, x)`: the model as an
  argument;
- `ox.filter_jit(model)(x)`, `eqx.filter_jit(model)(x)`: the module as the function;
- `jax.jit` on arrays split from the model once, before timing: the floor;
- a training-like step that donates its model and returns a new one (each weight negated)
  with `model(x)`, the loop rebinding its name each call: `ox.filter_jit(donate="all")`
  against `jax.jit(donate_argnums=0)` on the pre-split arrays.

    python benchmarks/dispatch.py [--rounds 5] [--calls 2000] [--repeats 5] [--smoke]
"""

import argparse
import json
import os
import time
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

import offload_eqx as ox

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
JAX = "jax.jit (pre-split arrays)"
OX_DONATING, JAX_DONATING = "ox.filter_jit donating", "jax.jit donating"
# (numerator, denominator) of each reported ratio.
RATIOS = {
    "ox / jax.jit": ("ox.filter_jit(forward)", JAX),
    "ox / eqx.filter_jit": ("ox.filter_jit(forward)", "eqx.filter_jit(forward)"),
    "ox module / jax.jit": ("ox.filter_jit(model)", JAX),
    "ox module / eqx module": ("ox.filter_jit(model)", "eqx.filter_jit(model)"),
    "ox / jax.jit, donating": (OX_DONATING, JAX_DONATING),
}


def _microseconds_per_call(
    fn: Callable, args: tuple, calls: int, repeats: int
) -> tuple[list[float], list[float]]:
    """The mean wall time and calling-thread CPU time of `calls` back-to-back calls,
    `repeats` times."""
    wall, thread = [], []
    for _ in range(repeats):
        start, start_cpu = time.perf_counter(), time.thread_time()
        for _ in range(calls):
            out = fn(*args)
        jax.block_until_ready(out)
        wall.append((time.perf_counter() - start) / calls * 1e6)
        thread.append((time.thread_time() - start_cpu) / calls * 1e6)
    return wall, thread


def candidates() -> dict[str, tuple[Callable, tuple]]:
    model = eqx.nn.MLP(8, 8, 16, 2, key=jax.random.key(0))
    x = jnp.ones(8)

    def forward(model, x):
        return model(x)

    params, static = eqx.partition(model, eqx.is_array)
    return {
        "ox.filter_jit(forward)": (ox.filter_jit(forward), (model, x)),
        "eqx.filter_jit(forward)": (eqx.filter_jit(forward), (model, x)),
        "ox.filter_jit(model)": (ox.filter_jit(model), (x,)),
        "eqx.filter_jit(model)": (eqx.filter_jit(model), (x,)),
        JAX: (jax.jit(lambda params, x: eqx.combine(params, static)(x)), (params, x)),
        OX_DONATING: (_loop(ox.filter_jit(_train, donate="all"), model), (x,)),
        JAX_DONATING: (_loop(jax.jit(_train_arrays(static), donate_argnums=0), params), (x,)),
    }


def _train(model, x):
    """A step that returns a new model (each weight negated) and an output."""
    return jax.tree.map(lambda w: -w if eqx.is_array(w) else w, model), model(x)


def _train_arrays(static: Any) -> Callable:
    """`_train` on the model's arrays, its other leaves `static`."""

    def train(params, x):
        return jax.tree.map(jnp.negative, params), eqx.combine(params, static)(x)

    return train


def _loop(step: Callable, model: Any) -> Callable:
    """A donating `step` called as a training loop calls it: on a copy of `model` (the
    first call donates it), the loop's state rebound to what each call returns."""
    state = [jax.tree.map(lambda w: jnp.copy(w) if eqx.is_array(w) else w, model)]

    def call(x):
        state[0], out = step(state[0], x)
        return out

    return call


def run(rounds: int = 5, calls: int = 2000, repeats: int = 5) -> dict[str, Any]:
    """Time every candidate in each of `rounds` rounds; ratios per round and their median.

    A candidate that fails on its first call is reported with its error and left out of
    the timing (its ratios read None), so that the others are still measured.
    """
    timed, failed = {}, {}
    expected = None
    for name, (fn, args) in candidates().items():
        try:
            out = jax.block_until_ready(fn(*args))  # compile, outside the timing
        except Exception as error:
            failed[name] = f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"
            continue
        expected = out if expected is None else expected
        if not np.allclose(out, expected, rtol=1e-6):
            raise AssertionError(f"{name} computed {out}, the others {expected}.")
        timed[name] = (fn, args)
    names = list(timed)
    times: dict[str, list[float]] = {name: [] for name in names}
    cpu: dict[str, list[float]] = {name: [] for name in names}
    fastest = {name: float("inf") for name in names}
    loads = [os.getloadavg()[0]]
    for round_index in range(rounds):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            fn, args = timed[name]
            samples, thread = _microseconds_per_call(fn, args, calls, repeats)
            times[name].append(float(np.median(samples)))
            cpu[name].append(float(np.median(thread)))
            fastest[name] = min(fastest[name], *samples)
        loads.append(os.getloadavg()[0])
    ratios = _ratios(times)
    cpu_ratios = _ratios(cpu)
    return {
        "rounds": rounds,
        "calls": calls,
        "repeats": repeats,
        "microseconds": times,
        "median_microseconds": {name: float(np.median(t)) for name, t in times.items()},
        "ratios": ratios,
        "median_ratios": {
            label: None if r is None else float(np.median(r)) for label, r in ratios.items()
        },
        # The fastest sample of each: other work on the machine only ever adds time, so
        # the ratio of the fastest is the steadiest estimate of the wrappers' own cost.
        "fastest_microseconds": fastest,
        "fastest_ratios": {
            label: fastest[top] / fastest[bottom] if top in fastest and bottom in fastest else None
            for label, (top, bottom) in RATIOS.items()
        },
        "thread_microseconds": cpu,
        "thread_ratios": cpu_ratios,
        "median_thread_ratios": {
            label: None if r is None else float(np.median(r)) for label, r in cpu_ratios.items()
        },
        # The 1-minute load average before the first round and after each.
        "load": [min(loads), max(loads)],
        "failed": failed,
        "versions": {"jax": jax.__version__, "equinox": eqx.__version__},
    }


def _ratios(times: dict[str, list[float]]) -> dict[str, list[float] | None]:
    """Each reported ratio, round by round (None where a candidate failed)."""
    return {
        label: [a / b for a, b in zip(times[top], times[bottom])]
        if top in times and bottom in times
        else None
        for label, (top, bottom) in RATIOS.items()
    }


def report(result: dict[str, Any]) -> str:
    rounds = range(1, result["rounds"] + 1)
    lines = [f"{'median us per call':<28} {'median':>8}  " + " ".join(f"{i:>6}" for i in rounds)]
    for name, samples in result["microseconds"].items():
        each = " ".join(f"{t:>6.1f}" for t in samples)
        lines.append(f"{name:<28} {result['median_microseconds'][name]:>8.1f}  {each}")
    lines.append(f"{'ratio':<28} {'median':>8}  " + " ".join(f"{i:>6}" for i in rounds))
    for label, values in result["ratios"].items():
        if values is None:
            lines.append(f"{label:<28} {'-':>8}  (a candidate failed)")
            continue
        each = " ".join(f"{r:>6.2f}" for r in values)
        lines.append(f"{label:<28} {result['median_ratios'][label]:>8.2f}  {each}")
    thread = ", ".join(
        f"{label} {value:.2f}"
        for label, value in result["median_thread_ratios"].items()
        if value is not None
    )
    lines.append(f"median ratios of the calling thread's CPU time: {thread}")
    low, high = result["load"]
    lines.append(f"load average (1 min) during the rounds: {low:.2f}-{high:.2f}")
    fastest = ", ".join(
        f"{label} {value:.2f}"
        for label, value in result["fastest_ratios"].items()
        if value is not None
    )
    lines.append(f"ratios of the fastest samples: {fastest}")
    for name, error in result["failed"].items():
        lines.append(f"not timed: {name} failed: {error}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=5)
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--smoke", action="store_true", help="3 rounds of few calls, for CI")
    size.add_argument("--full", action="store_true", help="the defaults")
    args = parser.parse_args()
    if args.smoke:
        args.rounds, args.calls, args.repeats = 3, 200, 3
    result = run(args.rounds, args.calls, args.repeats)
    print(report(result))
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, "dispatch.json"), "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
