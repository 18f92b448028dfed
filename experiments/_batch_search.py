"""The decoder's training step compiled for a chip without the hardware: its memory at one
batch (`measure`), and the largest batch that fits the chip (`largest_batch`, which is
`ox.max_batch` with every compile recorded).

Both compile the full step (`_decoder.make_step`) from `jax.ShapeDtypeStruct`s with
`ox.memory_report`; a compile the compiler refuses for lack of memory is a batch that does
not fit, any other failure is recorded in the row (XLA:TPU crashes on the steps with
host-resident parameters, see the README) so that one strategy does not end the run.
"""

import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from _decoder import STRATEGIES, Config, abstract_state, make_step, optimizer_for

import offload_eqx as ox

GB = 1e9


def capacity(target: str) -> int:
    """Bytes one device of `target` has (`ox.Target.capacity`): the H100's from the
    `GpuTargetConfig` offload_eqx ships (80 GB HBM3 less what the driver reserves), the
    v5p's 95 GB HBM."""
    value = ox.TARGETS[target].capacity
    assert value is not None, f"target {target!r} has no capacity"
    return value


def _step_and_args(config: Config, strategy: str):
    model, opt_state = abstract_state(config, strategy)
    step = make_step(optimizer_for(strategy, config), STRATEGIES[strategy])

    def make_args(batch: int) -> tuple:
        return model, opt_state, jax.ShapeDtypeStruct((batch, config.seq + 1), jnp.int32)

    return step, make_args


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0][:300]


def _out_of_memory(error: BaseException) -> bool:
    text = str(error)
    return "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower()


def _memory(report: ox.MemoryReport | None, batch: int, seconds: float) -> dict:
    """One compile as a row of the memory table."""
    return {
        "batch": batch,
        "fits": bool(report and report.fits),
        "total": None if report is None else report.total,
        "host_total": None if report is None else report.host_total,
        "device": None if report is None else dict(report.device),
        "host": None if report is None else dict(report.host),
        "compile_s": seconds,
    }


def _failed(error: BaseException, batch: int, seconds: float) -> dict:
    # A `ValueError` is offload_eqx refusing the program for the target before XLA sees it
    # (a host computation for XLA:TPU), not the compiler failing.
    return {
        **_memory(None, batch, seconds),
        "error": _first_line(error),
        "out_of_memory": _out_of_memory(error),
        "refused": str(error) if isinstance(error, ValueError) else None,
    }


def transfers(step, args: tuple) -> dict[str, int]:
    """Bytes the step moves per call between device and host, by `ox.audit` (a trace, no
    compile: the same on every target)."""
    report = ox.audit(step, *args)
    return {"h2d": report.total("host-to-device"), "d2h": report.total("device-to-host")}


def measure(config: Config, target: str, strategy: str, batch: int) -> dict:
    """Compile the full step of `strategy` (a name in `_decoder.STRATEGIES`) for `target`
    at `batch` and read its memory per space."""
    step, make_args = _step_and_args(config, strategy)
    start = time.perf_counter()
    try:
        report = ox.memory_report(step, *make_args(batch), target=target, name=strategy)
    except Exception as error:
        return _failed(error, batch, time.perf_counter() - start)
    row = _memory(report, batch, time.perf_counter() - start)
    return {**row, "transfers": transfers(step, make_args(batch))}


def largest_batch(
    config: Config,
    target: str,
    strategy: str,
    max_compiles: int | None = None,
    on_probe: Callable[[dict], Any] | None = None,
) -> dict:
    """`ox.max_batch` of the step of `strategy` on `target`, starting at batch 1: the row
    of batch 1's memory, with `search` holding the answer and every compile.

    `search["max_batch"]` is the exact answer (it fits, the next batch does not), 0 when
    batch 1 does not fit, None when the search could not finish (`search["stopped"]` says
    why: the compiler failed, or `max_compiles` was spent). `on_probe` is called after
    each compile with its probe (`batch`, `total`, `fits`, `seconds`, `report`).
    """
    step, make_args = _step_and_args(config, strategy)
    probes: list[dict] = []
    stopped, cause = None, None
    started = time.perf_counter()
    try:
        best = ox.max_batch(
            step,
            make_args,
            target=target,
            max_compiles=max_compiles,
            probes=probes,
            # `ox.max_batch` appends each probe before it reports progress.
            progress=None if on_probe is None else lambda _: on_probe(probes[-1]),
        )
    except ValueError:
        best = 0  # batch 1 does not fit (its probe says by how much)
    except RuntimeError as error:
        best, stopped, cause = None, _first_line(error.__cause__ or error), error.__cause__
    if probes:
        first = probes[0]
        row = _memory(first["report"], first["batch"], first["seconds"])
        row["transfers"] = transfers(step, make_args(first["batch"]))
    else:  # the compile of batch 1 failed
        refusal = cause if isinstance(cause, ValueError) else RuntimeError(stopped)
        row = _failed(refusal, 1, time.perf_counter() - started)
    at_best = next((p for p in probes if p["batch"] == best), None)
    row["search"] = {
        "max_batch": best,
        "stopped": stopped,
        "total_at_max": None if at_best is None else at_best["total"],
        "compiles": len(probes),
        "seconds": sum(p["seconds"] for p in probes),
        "probes": [
            {"batch": p["batch"], "fits": p["fits"], "total": p["total"], "seconds": p["seconds"]}
            for p in probes
        ],
    }
    return row
