"""Predicted against measured step time: `ox.estimate(...).seconds` beside the real step.

Each workload runs under several strategies on this machine's default backend. Every step
is compiled and warmed up, then timed in `--rounds` rounds, in each of which every
strategy runs `--calls` calls (each ending in `jax.block_until_ready`), in an order
rotated each round so that drift in the machine's load hits every strategy alike. The
prediction is `ox.estimate(step, ..., target=...).seconds`, priced for every strategy
with the same speeds (on the CPU, measured once per process by
`offload_eqx/_calibrate.py`). Reported per strategy:

- `ratio best`: predicted / the fastest call, the goal's measure (0.75 to 1.33): the
  calibration too takes the fastest of its repeats, the run least disturbed by other
  work on the machine;
- `ratio median`: predicted / the median call;
- `ratio rounds` (CPU only): the prediction at speeds measured again once per round (the
  fastest of each rate over the rounds), over the fastest call. On a shared machine the
  one calibration `ox.estimate` makes can land in a quiet or a busy moment; this column
  shows what is left of a ratio when the speeds are measured while the steps run.

Workloads (float32 on a CPU: its bfloat16 arithmetic is emulated; bfloat16 elsewhere,
the dtype the targets' peak rates are quoted in):

- `decoder`: the experiments' decoder (`experiments/_decoder.py`: RMSNorm, rotary
  attention, SwiGLU, `ox.scan` over stacked layers), a full AdamW training step, under
  `baseline` (everything saved), `remat`, `qkv_offload` (q, k, v offloaded, the rest
  recomputed: the decoder's annotations), `offload_params` (weights in host memory),
  `offload_optimizer` (AdamW state in host memory) and `hybrid` (weights and state in
  host memory, streamed layer by layer, q/k/v offloaded);
- `tutorial scan`: the 10-layer `(x @ w1) @ w2` scan of JAX's host-offloading tutorial
  (`experiments/_tutorial.py`), the gradient of its sum, under `baseline`, `remat`,
  `offload_activations` (the tutorial's offloaded `x`), `offload_params` and `hybrid`
  (the tutorial's "params on host + offload x");
- `tutorial optimizer`: the tutorial's 4-layer GELU MLP with clipped Adam, under
  `baseline` and `offload_optimizer`.

The target is chosen from `jax.default_backend()`: `"cpu"` on a CPU, `--target`
(default `"h100"` on a GPU, `"tpu-v5p"` on a TPU) otherwise; the estimate traces the step
and prices it with the target's `Speeds`, nothing compiled for it.

    JAX_PLATFORMS=cpu python benchmarks/step_time.py            # 80 s on 2 idle cores
    JAX_PLATFORMS=cpu python benchmarks/step_time.py --smoke    # smaller: 40 s

Writes `benchmarks/results/step_time.json` (ignored by git, like the other results).
The results on this machine, and what the model misses, are in `benchmarks/README.md`.
"""

import argparse
import dataclasses
import datetime
import json
import os
import sys
import time
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

import offload_eqx as ox

EXPERIMENTS = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "experiments"
)
sys.path.insert(0, EXPERIMENTS)
import _decoder  # noqa: E402
import _tutorial  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
DEFAULT_TARGETS = {"cpu": "cpu", "gpu": "h100", "cuda": "h100", "tpu": "tpu-v5p"}

SIZES = {
    # A step of 0.1 to 1 s on a 2-core CPU: compute, not dispatch, dominates.
    "default": {
        "decoder": _decoder.Config(
            "bench", vocab=2048, dim=256, ffn=768, layers=4, heads=4, seq=128
        ),
        "decoder_batch": 4,
        "scan": dict(layers=10, batch=256, width=256, hidden=1024),
        "mlp_dim": 1024,
    },
    "smoke": {
        "decoder": _decoder.Config("smoke", vocab=512, dim=128, ffn=384, layers=2, heads=4, seq=64),
        "decoder_batch": 4,
        # A decoder step takes seconds to compile: the smoke run compiles three.
        "decoder_strategies": ("baseline", "qkv_offload", "hybrid"),
        "scan": dict(layers=4, batch=128, width=256, hidden=512),
        "mlp_dim": 512,
    },
}


@dataclasses.dataclass(eq=False)
class Case:
    """One strategy of one workload: its step, its arguments, and whether the step returns
    its first arguments updated (a training step with donated state, fed back each call)."""

    workload: str
    strategy: str
    step: Any
    args: tuple
    carry: int = 0  # how many leading outputs replace the leading arguments
    times: list[float] = dataclasses.field(default_factory=list)

    def call(self) -> None:
        out = self.step(*self.args)
        jax.block_until_ready(out)
        if self.carry:
            self.args = (*out[: self.carry], *self.args[self.carry :])


# -- the workloads ----------------------------------------------------------------------


def decoder_cases(
    config: _decoder.Config, batch: int, dtype, names: tuple[str, ...] | None = None
) -> list[Case]:
    """The decoder's training step under each strategy in `names` (default: all)."""
    qkv = {"q": "offload", "k": "offload", "v": "offload"}
    strategies = {
        "baseline": (ox.STRATEGIES["baseline"], None),
        "remat": (ox.STRATEGIES["remat"], None),
        "qkv_offload": (ox.Strategy("qkv_offload", "device", "device", "remat", names=qkv), None),
        "offload_params": (ox.STRATEGIES["offload_params"], None),
        "offload_optimizer": (ox.STRATEGIES["offload_optimizer"], None),
        "hybrid": (_decoder.STRATEGIES["hybrid"], config.layers),
    }
    tokens = jax.random.randint(jax.random.key(1), (batch, config.seq + 1), 0, config.vocab)
    cases = []
    for name, (strategy, layers) in strategies.items():
        if names is not None and name not in names:
            continue
        optimizer = _decoder.make_optimizer(layers)
        model = _decoder.make_decoder(config, jax.random.key(0), dtype=dtype)
        opt_state = optimizer.init(model)
        step = _decoder.make_step(optimizer, strategy)
        cases.append(Case("decoder", name, step, (model, opt_state, tokens), carry=2))
    return cases


class ScanLayer(eqx.Module):
    """The tutorial's layer, `(x @ w1) @ w2`, with its input named `x`."""

    w1: jax.Array = ox.field(memory="device")
    w2: jax.Array = ox.field(memory="device")

    def __call__(self, x):
        x = ox.name(x, "x")
        return (x @ self.w1) @ self.w2


class ScanModel(eqx.Module):
    layers: ScanLayer  # stacked: every leaf has the layer axis first
    activations: ox.Activations = ox.activations(x="offload")

    def __call__(self, x):
        return ox.scan(self.layers, x)


def scan_grad(model: ScanModel, x):
    return eqx.filter_grad(lambda m: jnp.sum(m(x)))(model)


def scan_cases(sizes: dict[str, int], dtype) -> list[Case]:
    (w1, w2), x = _tutorial.scan_arguments(**sizes)
    keys = jax.random.split(jax.random.key(2), 3)

    def normal(key, spec, fan_in):
        return (jax.random.normal(key, spec.shape, jnp.float32) / np.sqrt(fan_in)).astype(dtype)

    model = ScanModel(
        ScanLayer(normal(keys[0], w1, sizes["width"]), normal(keys[1], w2, sizes["hidden"]))
    )
    inputs = normal(keys[2], x, 1)
    cases = []
    for name in ("baseline", "remat", "offload_activations", "offload_params", "hybrid"):
        # Weights placed as the plan puts them before the loop: a call then moves nothing
        # but what the strategy itself moves (the gradient step does not return them).
        placed = ox.place(model, name)
        cases.append(
            Case("tutorial scan", name, ox.filter_jit(scan_grad, strategy=name), (placed, inputs))
        )
    return cases


class MLP(eqx.Module):
    """The tutorial's optimizer workload: 4 square layers with GELU."""

    w1: jax.Array = ox.field(memory="device")
    w2: jax.Array = ox.field(memory="device")
    w3: jax.Array = ox.field(memory="device")
    w4: jax.Array = ox.field(memory="device")

    def __call__(self, x):
        for w in (self.w1, self.w2, self.w3, self.w4):
            x = _tutorial.gelu(x @ w)
        return x


def mlp_loss(model: MLP, x):
    l2 = 0.001 * sum(jnp.sum(w**2) for w in jax.tree_util.tree_leaves(model))
    return jnp.mean((model(x) - x) ** 2) + l2


def mlp_cases(dim: int, dtype) -> list[Case]:
    optimizer = ox.offload_optimizer(_tutorial.OPTIMIZER)

    def step(model, opt_state, x):
        grads = jax.grad(mlp_loss)(model, x)
        updates, opt_state = optimizer.update(grads, opt_state, model)
        return ox.apply_updates(model, updates), opt_state

    keys = jax.random.split(jax.random.key(3), 5)
    cases = []
    for name in ("baseline", "offload_optimizer"):
        weights = [
            (jax.random.normal(k, (dim, dim), jnp.float32) / np.sqrt(dim)).astype(dtype)
            for k in keys[:4]
        ]
        model = MLP(*weights)
        x = jax.random.normal(keys[4], (dim, dim), jnp.float32).astype(dtype)
        jitted = ox.filter_jit(step, strategy=name, donate="all")
        cases.append(
            Case("tutorial optimizer", name, jitted, (model, optimizer.init(model), x), carry=2)
        )
    return cases


# -- measuring and predicting -----------------------------------------------------------


def predict(case: Case, target: str | ox.Target) -> ox.StepEstimate:
    """The jaxpr count's prediction: priced from the trace alone, nothing compiled."""
    return ox.estimate(case.step, *case.args, target=target, compile=False)


def simulate(case: Case, target: str | ox.Target) -> ox.StepEstimate | str:
    """The compiled program's prediction: the step compiled for the target (on this
    machine's own accelerator when it is the target's chip) and its schedule simulated;
    the error's first line if that fails (the jaxpr count is still reported)."""
    try:
        return ox.estimate(case.step, *case.args, target=target, compile=True)
    except Exception as error:  # noqa: BLE001 - reported in the row, the run goes on
        return f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"


def measure_speeds() -> ox.Speeds | None:
    """This machine's speeds measured again, uncached (the CPU only; an accelerator's are
    datasheet figures): the calibration `ox.estimate` runs once per process."""
    if jax.default_backend() != "cpu":
        return None
    from offload_eqx._targets.calibrate import cpu_speeds  # private: the uncached measurement

    return cpu_speeds.__wrapped__()


def best_speeds(measured: list[ox.Speeds]) -> ox.Speeds:
    """The fastest of each rate over several calibrations: the least disturbed, as the
    calibration itself takes the best of its repeats and the steps the best of theirs."""
    rates = (
        "flops",
        "memory_bandwidth",
        "h2d_bandwidth",
        "d2h_bandwidth",
        "first_touch_bandwidth",
        "transpose_bandwidth",
    )
    best = {name: max(getattr(s, name) for s in measured) for name in rates}
    return dataclasses.replace(
        measured[0],
        **best,
        kernel_launch=min(s.kernel_launch for s in measured),
        host_flops=best["flops"],
        host_bandwidth=best["memory_bandwidth"],
        source=f"best of {len(measured)} calibrations, one per timing round",
    )


def _load_average() -> float | None:
    try:
        return os.getloadavg()[0]
    except (OSError, AttributeError):
        return None


def run(
    size: str = "default",
    target: str | None = None,
    rounds: int = 5,
    calls: int = 2,
    dtype: Any = None,
) -> dict[str, Any]:
    """Predict and time every case; `rounds` rounds of `calls` timed calls each."""
    backend = jax.default_backend()
    target = target or DEFAULT_TARGETS.get(backend, "h100")
    if dtype is None:
        dtype = jnp.float32 if backend == "cpu" else jnp.bfloat16
    sizes = SIZES[size]
    start, load_before = time.perf_counter(), _load_average()
    cases = [
        *decoder_cases(
            sizes["decoder"], sizes["decoder_batch"], dtype, sizes.get("decoder_strategies")
        ),
        *scan_cases(sizes["scan"], dtype),
        *mlp_cases(sizes["mlp_dim"], dtype),
    ]
    estimates, simulated, compile_seconds = {}, {}, {}
    for case in cases:
        estimates[case] = predict(case, target)  # the first calibrates, on the CPU
        simulated[case] = simulate(case, target)
        begin = time.perf_counter()
        case.call()  # compile, and move the arguments to their planned memory
        compile_seconds[case] = time.perf_counter() - begin
        case.call()  # warm up with the arguments where the step leaves them
    in_rounds = []
    for round_index in range(rounds):
        speeds = measure_speeds()
        if speeds is not None:
            in_rounds.append(speeds)
        shift = round_index % len(cases)
        for case in cases[shift:] + cases[:shift]:
            for _ in range(calls):
                begin = time.perf_counter()
                case.call()
                case.times.append(time.perf_counter() - begin)
    # The same steps priced at the speeds measured while they were timed: how much of a
    # ratio is the model, and how much the machine's load drifting after the calibration.
    rounds_target = None
    if in_rounds:
        rounds_target = ox.Target("cpu (rounds)", "cpu", speeds=best_speeds(in_rounds))
    rows = []
    for case in cases:
        estimate, compiled = estimates[case], simulated[case]
        best, median = float(np.min(case.times)), float(np.median(case.times))
        again = predict(case, rounds_target) if rounds_target else None
        ok = isinstance(compiled, ox.StepEstimate)
        again_compiled = simulate(case, rounds_target) if rounds_target and ok else None
        if not isinstance(again_compiled, ox.StepEstimate):
            again_compiled = None
        rows.append(
            {
                "workload": case.workload,
                "strategy": case.strategy,
                "predicted_seconds": estimate.seconds,
                "best_seconds": best,
                "median_seconds": median,
                "ratio_best": estimate.seconds / best,
                "ratio_median": estimate.seconds / median,
                "predicted_seconds_rounds": again and again.seconds,
                "ratio_best_rounds": again and again.seconds / best,
                "compiled_seconds": compiled.seconds if ok else None,
                "compiled_ratio_best": compiled.seconds / best if ok else None,
                "compiled_ratio_median": compiled.seconds / median if ok else None,
                "compiled_ratio_best_rounds": again_compiled and again_compiled.seconds / best,
                "compiled_error": None if ok else compiled,
                "compiled_estimate": compiled.to_dict() if ok else None,
                "times": case.times,
                "first_call_seconds": compile_seconds[case],
                "estimate": estimate.to_dict(),
            }
        )
    return {
        "date": datetime.date.today().isoformat(),
        "command": " ".join(["python", *sys.argv]),
        "backend": backend,
        "devices": [str(d) for d in jax.devices()],
        "cpu_count": os.cpu_count(),
        "load_average": {"before": load_before, "after": _load_average()},
        "target": target,
        "dtype": jnp.dtype(dtype).name,
        "size": size,
        "sizes": {
            k: dataclasses.asdict(v) if dataclasses.is_dataclass(v) else v for k, v in sizes.items()
        },
        "rounds": rounds,
        "calls": calls,
        "speeds": dataclasses.asdict(next(iter(estimates.values())).speeds),
        "speeds_rounds": dataclasses.asdict(rounds_target.speeds) if rounds_target else None,
        "rows": rows,
        "seconds": time.perf_counter() - start,
        "versions": {
            "jax": jax.__version__,
            "equinox": eqx.__version__,
            "optax": optax.__version__,
        },
    }


GOAL = (0.75, 1.33)


def _speeds_line(speeds: dict[str, float]) -> str:
    return (
        f"{speeds['flops'] * speeds['efficiency'] / 1e9:.1f} GFLOP/s, "
        f"memory {speeds['memory_bandwidth'] / 1e9:.1f} GB/s, "
        f"h2d {speeds['h2d_bandwidth'] / 1e9:.1f} GB/s, "
        f"d2h {speeds['d2h_bandwidth'] / 1e9:.1f} GB/s"
    )


def report(result: dict[str, Any]) -> str:
    load = result["load_average"]
    lines = [
        f"{result['backend']} backend ({result['cpu_count']} cores, load average "
        f"{load['before']} -> {load['after']}), target {result['target']!r}, {result['dtype']}",
        f"speeds the estimates used: {_speeds_line(result['speeds'])}",
    ]
    if result["speeds_rounds"]:
        lines.append(f"best over the timing rounds: {_speeds_line(result['speeds_rounds'])}")
    header = (
        "workload", "strategy", "GFLOP", "h2d MB", "d2h MB", "traced ms", "compiled ms",
        "best ms", "median ms", "traced/best", "compiled/best", "compiled/median",
        "rounds traced", "rounds compiled",
    )  # fmt: skip

    def ratio(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f}"

    table = []
    for row in result["rows"]:
        estimate = row["estimate"]
        compiled = row["compiled_seconds"]
        table.append(
            (
                row["workload"],
                row["strategy"],
                f"{estimate['flops'] / 1e9:.2f}",
                f"{estimate['h2d_bytes'] / 1e6:.1f}",
                f"{estimate['d2h_bytes'] / 1e6:.1f}",
                f"{row['predicted_seconds'] * 1e3:.2f}",
                "-" if compiled is None else f"{compiled * 1e3:.2f}",
                f"{row['best_seconds'] * 1e3:.2f}",
                f"{row['median_seconds'] * 1e3:.2f}",
                ratio(row["ratio_best"]),
                ratio(row["compiled_ratio_best"]),
                ratio(row["compiled_ratio_median"]),
                ratio(row["ratio_best_rounds"]),
                ratio(row["compiled_ratio_best_rounds"]),
            )
        )
    widths = [max(len(str(c)) for c in column) for column in zip(header, *table)]
    lines.append(" | ".join(c.ljust(w) for c, w in zip(header, widths)))
    lines.append("-+-".join("-" * w for w in widths))
    lines += [" | ".join(c.ljust(w) for c, w in zip(row, widths)) for row in table]
    low, high = GOAL

    def within(key: str) -> int:
        return sum(r[key] is not None and low <= r[key] <= high for r in result["rows"])

    errors = {r["compiled_error"] for r in result["rows"] if r["compiled_error"]}
    lines += [f"compiled estimate failed: {e}" for e in sorted(errors)]
    lines.append(
        f"ratio = predicted / measured (best or median of {result['rounds']} rounds x "
        f"{result['calls']} calls); traced: the jaxpr count (`compile=False`), compiled: "
        "the compiled program's schedule simulated (`compile=True`); rounds: predicted at "
        "the best speeds measured during the rounds / best. Within "
        f"{low}-{high} of the best call: traced {within('ratio_best')} of {len(table)}, "
        f"compiled {within('compiled_ratio_best')} of {len(table)}; {result['seconds']:.0f} s"
    )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", help="the target to price with (default: by backend)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=2, help="timed calls per round")
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--smoke", action="store_true", help="smaller workloads, 3 rounds")
    size.add_argument("--full", action="store_true", help="the defaults")
    args = parser.parse_args()
    rounds = 3 if args.smoke else args.rounds
    result = run("smoke" if args.smoke else "default", args.target, rounds, args.calls)
    print(report(result))
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, "step_time.json"), "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
