"""The five parts of `gpu_check.py`, and the clock that decides what still fits.

Each part returns plain values for the JSON; a case that raises is recorded with its
error and the part goes on (on a GPU, one strategy running out of memory must not cost
the others' numbers).
"""

import gzip
import os
import time
import traceback
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import step_time
from _gpu_check_work import (
    Workload,
    fed_back,
    finish,
    is_host,
    leaves_with_paths,
    relative_difference,
    time_calls,
    typed_host,
)

import offload_eqx as ox

GiB = 2**30


class Clock:
    """The run's deadline, split between its parts: a part may spend what the parts
    after it do not need (their budgets, on paper), and a case is skipped, saying so,
    when its expected time would overrun. A case's expected time is the last measured
    time of a case of the same kind, or the profile's figure before any was measured."""

    def __init__(self, seconds: float, budgets: dict[str, float]):
        self.start = time.perf_counter()
        self.end = self.start + seconds
        self.budgets = budgets
        self.part_end = self.end
        self.skipped: list[str] = []
        self.measured: dict[str, float] = {}

    def begin(self, part: str) -> None:
        names = list(self.budgets)
        later = names[names.index(part) + 1 :]
        self.part_end = self.end - sum(self.budgets[name] for name in later)

    def left(self) -> float:
        return self.part_end - time.perf_counter()

    def allows(self, what: str, kind: str, prior: float) -> bool:
        expected = self.measured.get(kind, prior)
        if expected <= self.left():
            return True
        line = f"skipped {what}: expected {expected:.0f} s, {max(self.left(), 0):.0f} s left"
        print(line, flush=True)
        self.skipped.append(line)
        return False

    def record(self, kind: str, seconds: float) -> None:
        self.measured[kind] = seconds


def _error(error: BaseException) -> str:
    return f"{type(error).__name__}: {str(error).splitlines()[0][:300] if str(error) else ''}"


# -- 1. equivalence ---------------------------------------------------------------------


def _run(workload: Workload, strategy: Any, steps: int) -> tuple[Any, list]:
    """`steps` calls (then `ox.apply_pending` for a delayed optimizer); the outputs and
    each output leaf's planned memory (None where the plan places nothing: gradients,
    the loss)."""
    step = workload.step(strategy)
    args = ox.place(workload.arguments(), strategy)
    plan = step.plan(*args)
    out = step(*args)
    for _ in range(steps - 1):
        args = fed_back(workload, args, out)
        out = step(*args)
    if workload.optimizer is not None:
        out = (*finish(workload, strategy, out[0], out[1]), *out[2:])
    planned = [leaf.memory or "device" for leaf in plan.leaves if leaf.root < workload.carry]
    rest = len(leaves_with_paths(out)) - len(planned)
    return jax.block_until_ready(out), planned + [None] * rest


def _memory_errors(out: Any, planned: list) -> list[str]:
    errors = []
    for (path, leaf), memory in zip(leaves_with_paths(out), planned):
        kind = leaf.sharding.memory_kind
        if is_host(leaf) != typed_host(leaf):
            errors.append(f"{path}: in {kind} memory but typed {jax.typeof(leaf)}")
        elif memory is not None and kind != memory:
            errors.append(f"{path}: in {kind} memory, the plan says {memory}")
    return errors


def _compare(out: Any, base: Any, bound: float) -> tuple[float, str, list[str]]:
    worst, worst_path, mismatches = 0.0, "", []
    ours, theirs = leaves_with_paths(out), leaves_with_paths(base)
    if [p for p, _ in ours] != [p for p, _ in theirs]:
        return float("inf"), "", ["the outputs' leaves differ from baseline's"]
    for (path, a), (_, b) in zip(ours, theirs):
        if (a.shape, a.dtype) != (b.shape, b.dtype):
            mismatches.append(f"{path}: {a.dtype}{a.shape} against {b.dtype}{b.shape}")
            continue
        difference = relative_difference(a, b)
        if difference > worst:
            worst, worst_path = difference, path
        if not difference <= bound:
            mismatches.append(f"{path}: relative difference {difference:.3g} > {bound:.3g}")
    return worst, worst_path, mismatches


def equivalence(cases: list[dict], clock: Clock, prior: float) -> dict[str, Any]:
    """Every case's outputs under each strategy against `baseline`'s on this device, and
    every output leaf in its planned memory and typed as such."""
    rows = []
    for case in cases:
        workload, base = case["workload"], None
        strategies = ["baseline", *(s for s in case["strategies"] if s != "baseline")]
        for strategy in strategies:
            what = f"equivalence of {workload.name} under {strategy}"
            if (strategy != "baseline" and base is None) or not clock.allows(
                what, workload.name, prior
            ):
                rows.append({"workload": workload.name, "strategy": strategy, "skipped": True})
                continue
            begin = time.perf_counter()
            row = {"workload": workload.name, "strategy": strategy, "bound": case["bound"]}
            try:
                out, planned = _run(workload, strategy, case.get("steps", 1))
            except Exception as error:  # noqa: BLE001 - a failed case is a FAIL, reported
                traceback.print_exc()
                rows.append({**row, "passed": False, "error": _error(error)})
                continue
            base = out if strategy == "baseline" else base
            worst, path, mismatches = _compare(out, base, case["bound"])
            errors = _memory_errors(out, planned)
            host = sum(is_host(leaf) for _, leaf in leaves_with_paths(out))
            rows.append(
                {
                    **row,
                    "passed": not mismatches and not errors,
                    "max_difference": worst,
                    "worst_leaf": path,
                    "mismatches": mismatches,
                    "memory_errors": errors,
                    "leaves": len(planned),
                    "host_leaves": host,
                    "seconds": time.perf_counter() - begin,
                }
            )
            clock.record(workload.name, time.perf_counter() - begin)
    ran = [r for r in rows if not r.get("skipped")]
    return {"passed": bool(ran) and all(r["passed"] for r in ran), "rows": rows}


def equivalence_lines(result: dict[str, Any]) -> list[str]:
    """The part's verdict first, then every failure with its leaf and difference."""
    rows = result["rows"]
    ran = [r for r in rows if not r.get("skipped")]
    failed = [r for r in ran if not r["passed"]]
    skipped = len(rows) - len(ran)
    verdict = "PASS" if result["passed"] else "FAIL"
    lines = [
        f"EQUIVALENCE {verdict}: {len(ran) - len(failed)} of {len(ran)} cases equal to "
        f"baseline with every output leaf in its planned memory"
        + (f" ({skipped} skipped for time)" if skipped else "")
    ]
    for r in failed:
        where = f"  FAIL {r['workload']} under {r['strategy']}: "
        if "error" in r:
            lines.append(where + r["error"])
        lines += [where + m for m in r.get("mismatches", []) + r.get("memory_errors", [])]
    return lines


# -- 2 and 4. predicted against measured, and memory ---------------------------------------


def _memory_stats() -> dict[str, int] | None:
    stats = jax.devices()[0].memory_stats()
    if not stats:
        return None
    return {k: int(stats[k]) for k in ("bytes_in_use", "peak_bytes_in_use") if k in stats}


def measure(workload: Workload, strategy: Any, batches: int, calls: int) -> dict[str, Any]:
    """The step compiled and run: the first call (compile and run), one warm-up call,
    then `time_calls`; device memory before the first call and after the last."""
    step = workload.step(strategy)
    args = ox.place(workload.arguments(), strategy)
    jax.block_until_ready(args)
    before = _memory_stats()
    begin = time.perf_counter()
    for _ in range(2):
        out = step(*args)
        args = fed_back(workload, args, out)
        jax.block_until_ready(out)
        if not workload.carry:
            del out
    first = time.perf_counter() - begin
    median, per_call, args = time_calls(step, workload, args, batches, calls)
    after = _memory_stats()
    del args
    return {
        "first_two_calls_seconds": first,
        "median_seconds": median,
        "batch_seconds_per_call": per_call,
        "memory_before": before,
        "memory_after": after,
    }


def _predicted(workload: Workload, strategy: Any, target: str) -> dict[str, Any]:
    step = workload.step(strategy)
    case = step_time.Case(workload.name, str(strategy), step, workload.abstract())
    begin = time.perf_counter()
    estimate = step_time.simulate(case, target)
    seconds = time.perf_counter() - begin
    if isinstance(estimate, str):
        return {"estimate_error": estimate, "estimate_seconds": seconds}
    return {
        "predicted_seconds": estimate.seconds,
        "traced_seconds": estimate.traced_seconds,
        "predicted_device_bytes": estimate.device_bytes,
        "predicted_host_bytes": estimate.host_bytes,
        "estimate_seconds": seconds,
    }


# A prediction off by more than this factor either way keeps its compiled program.
OFF_BY = 1.5
KEPT_PROGRAMS = 4  # at most, beside the JSON, the markdown and the log


def save_program(workload: Workload, strategy: Any, path: str) -> str:
    """The step's compiled program as the attached device runs it (`as_text()`, gzipped
    at `path`): what the simulation priced, to read after the GPU has gone back."""
    step = workload.step(strategy)
    text = step.lower(*workload.abstract()).compile().as_text()
    with gzip.open(path, "wt") as f:
        f.write(text)
    return os.path.basename(path)


def timing(
    timed: list[dict],
    target: str,
    clock: Clock,
    batches: int,
    calls: int,
    keep: str | None = None,
) -> dict:
    """Each strategy of each workload: `ox.estimate` (compiled for `target`, simulated)
    beside the measured median, and device memory as the allocator saw it. With `keep`
    (a directory), a step predicted `OFF_BY` or more off keeps its compiled program
    there (the first `KEPT_PROGRAMS` of them)."""
    rows = []
    for case in timed:
        workload = case["workload"]
        for strategy in case["strategies"]:
            what = f"timing of {workload.name} under {strategy}"
            if not clock.allows(what, workload.name, case["prior"]):
                rows.append({"workload": workload.name, "strategy": strategy, "skipped": True})
                continue
            begin = time.perf_counter()
            row = {"workload": workload.name, "strategy": strategy}
            try:
                row |= _predicted(workload, strategy, target)
                row |= measure(workload, strategy, batches, calls)
            except Exception as error:  # noqa: BLE001 - reported in the row
                traceback.print_exc()
                row["error"] = _error(error)
            row["seconds"] = time.perf_counter() - begin
            clock.record(workload.name, row["seconds"])
            if row.get("predicted_seconds") and row.get("median_seconds"):
                row["ratio"] = row["predicted_seconds"] / row["median_seconds"]
            print(f"  {workload.name} / {strategy}: {_timing_line(row)}", flush=True)
            off = max(row.get("ratio", 1.0), 1 / row.get("ratio", 1.0)) >= OFF_BY
            if keep and off and sum("program" in r for r in rows) < KEPT_PROGRAMS:
                name = f"{workload.name}-{strategy}".replace(" ", "_").replace("(", "")
                path = os.path.join(keep, name.replace(")", "") + ".hlo.gz")
                try:
                    row["program"] = save_program(workload, strategy, path)
                except Exception as error:  # noqa: BLE001 - the timing stands without it
                    row["program_error"] = _error(error)
            rows.append(row)
    return {"rows": rows, "target": target, "batches": batches, "calls_per_batch": calls}


def _timing_line(row: dict) -> str:
    if "error" in row:
        return row["error"]
    predicted = row.get("predicted_seconds")
    shown = "-" if predicted is None else f"{predicted * 1e3:.2f}"
    return f"predicted {shown} ms, measured {row['median_seconds'] * 1e3:.2f} ms"


MEMORY_METHOD = (
    "JAX cannot reset a device's peak_bytes_in_use, so the strategies run one after "
    "another in one process, each with only its own arguments alive: a strategy's peak is "
    "measured when the peak rose while it ran (its arguments placed, then its calls), and "
    "'hidden' when an earlier strategy or its own placement had reached higher. The "
    "prediction is ox.estimate's compiled device total (temp + arguments + outputs - "
    "aliased), the figure ox.memory_report prints."
)


def memory(timing_result: dict) -> dict[str, Any]:
    """Peak device memory measured beside the compiled figure, from part 2's runs."""
    rows = []
    for row in timing_result["rows"]:
        if row.get("skipped") or "error" in row:
            continue
        before, after = row["memory_before"], row["memory_after"]
        measured = None
        if before and after and after["peak_bytes_in_use"] > before["peak_bytes_in_use"]:
            measured = after["peak_bytes_in_use"]
        rows.append(
            {
                "workload": row["workload"],
                "strategy": row["strategy"],
                "predicted_device_bytes": row.get("predicted_device_bytes"),
                "measured_peak_bytes": measured,
                "hidden": bool(before and after) and measured is None,
                "arguments_bytes_in_use": before and before["bytes_in_use"],
            }
        )
    available = any(r["arguments_bytes_in_use"] is not None for r in rows)
    method = MEMORY_METHOD if available else "device.memory_stats() is None on this backend"
    return {"rows": rows, "method": method, "available": available}


# -- 3. does ox.fit choose as the hardware would? ------------------------------------------


def kendall_tau(x: list[float], y: list[float]) -> float | None:
    """Kendall's tau-a: concordant minus discordant pairs over all pairs."""
    pairs = [(i, j) for i in range(len(x)) for j in range(i + 1, len(x))]
    if not pairs:
        return None
    agree = sum(np.sign(x[i] - x[j]) * np.sign(y[i] - y[j]) for i, j in pairs)
    return float(agree) / len(pairs)


def _budget(workload: Workload, target: str, case: dict) -> int:
    """`budget_bytes`, or `budget_fraction` of baseline's compiled device total."""
    if "budget_bytes" in case:
        return int(case["budget_bytes"])
    report = ox.memory_report(workload.step("baseline"), *workload.abstract(), target=target)
    return int(case["budget_fraction"] * report.total)


def fit_check(case: dict, target: str, clock: Clock, batches: int, calls: int) -> dict:
    """`ox.fit` under a budget that forces offloading, then every candidate it compiled
    that fits, timed: Kendall's tau of its simulated times against the measured ones, and
    whether its choice is the fastest measured."""
    workload = case["workload"]
    if not clock.allows(f"ox.fit on {workload.name}", "fit", case["prior_fit"]):
        return {"skipped": True}
    begin = time.perf_counter()
    budget = _budget(workload, target, case)
    try:
        result = ox.fit(
            workload.step("annotated"),
            *workload.abstract(),
            target=target,
            device_budget=budget,
            max_compiles=case["max_compiles"],
            progress=False,
        )
    except Exception as error:  # noqa: BLE001 - reported; the other parts stand
        traceback.print_exc()
        return {"workload": workload.name, "budget_bytes": budget, "error": _error(error)}
    clock.record("fit", time.perf_counter() - begin)
    rows = []
    for candidate in result.candidates:
        if candidate.simulated_seconds is None:
            continue
        row = {
            "label": candidate.label,
            "status": candidate.status,
            "simulated_seconds": candidate.simulated_seconds,
            "device_bytes": candidate.device_bytes,
        }
        if clock.allows(f"timing ox.fit's {candidate.label}", workload.name, case["prior"]):
            started = time.perf_counter()
            try:
                row |= measure(workload, candidate.strategy, batches, calls)
            except Exception as error:  # noqa: BLE001 - reported in the row
                row["error"] = _error(error)
            clock.record(workload.name, time.perf_counter() - started)
        rows.append(row)
    return {
        "workload": workload.name,
        "budget_bytes": budget,
        "chosen": result.strategy.name,
        "fit_seconds": result.seconds_searching,
        "compiles": result.compiles,
        "rows": rows,
        **_verdict(rows),
    }


def _verdict(rows: list[dict]) -> dict[str, Any]:
    timed = [r for r in rows if "median_seconds" in r]
    if not timed:
        return {"kendall_tau": None, "chosen_is_fastest": None, "chosen_over_fastest": None}
    tau = kendall_tau([r["simulated_seconds"] for r in timed], [r["median_seconds"] for r in timed])
    fastest = min(timed, key=lambda r: r["median_seconds"])
    chosen = [r for r in timed if r["status"] == "best"]
    ratio = chosen[0]["median_seconds"] / fastest["median_seconds"] if chosen else None
    return {
        "kendall_tau": tau,
        "fastest_measured": fastest["label"],
        "chosen_is_fastest": bool(chosen) and chosen[0] is fastest,
        "chosen_over_fastest": ratio,
    }


# -- 5. the link --------------------------------------------------------------------------


def _median_copy(x: jax.Array, sharding: Any, repeats: int) -> tuple[float, jax.Array]:
    times, copy = [], x
    for _ in range(repeats):
        begin = time.perf_counter()
        copy = jax.block_until_ready(jax.device_put(x, sharding))
        times.append(time.perf_counter() - begin)
    return float(np.median(times)), copy


def link(sizes: list[int], repeats: int) -> dict[str, Any]:
    """Pinned host memory to device memory and back, `jax.device_put` between the two
    memory kinds of one device: median seconds per copy, and bandwidth, per size."""
    device = jax.devices()[0]
    host = jax.sharding.SingleDeviceSharding(device, memory_kind="pinned_host")
    on_device = jax.sharding.SingleDeviceSharding(device, memory_kind="device")
    rows = []
    for size in sizes:
        x = jax.block_until_ready(jax.device_put(jnp.ones(size // 4, jnp.float32), on_device))
        d2h, there = _median_copy(x, host, repeats)
        h2d, _ = _median_copy(there, on_device, repeats)
        rows.append(
            {
                "bytes": size,
                "d2h_seconds": d2h,
                "h2d_seconds": h2d,
                "d2h_gb_per_s": size / d2h / 1e9,
                "h2d_gb_per_s": size / h2d / 1e9,
            }
        )
        del x, there
    return {"rows": rows, "repeats": repeats}
