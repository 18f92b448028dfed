"""The largest batch whose training step fits one chip, found with deviceless compiles.

`measure` compiles the decoder's full training step (`_decoder.make_step`) for a target at
one batch with `ox.memory_report` and reads device and host bytes; `largest_batch` searches
the batch with a bounded number of such compiles. Device memory is nearly linear in the
batch, so each probe is where the line through two measurements meets the chip's capacity
(a secant step), kept inside the bracket of known fits and misfits, with bisection when
there is no line.
"""

import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
from _decoder import STRATEGIES, Config, abstract_state, make_step, optimizer_for

import offload_eqx as ox

# Bytes a program may use on one chip: the H100's from the `GpuTargetConfig` that
# offload_eqx ships for it (80 GB HBM3 less what the driver reserves), the v5p's 95 GiB HBM.
CAPACITY = {"h100": 84_978_434_048, "tpu-v5p": 95 * 2**30}
GB = 1e9


def _out_of_memory(error: Exception) -> bool:
    # XLA refuses a program larger than the chip with a status text, not an exception type.
    text = str(error)
    return "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower()


def measure(config: Config, target: str, strategy: str, batch: int) -> dict:
    """Compile the full step of `strategy` (a name in `_decoder.STRATEGIES`) for `target`
    at `batch` and read its memory per space.

    `fits` is false when the compiler refuses (out of memory) or the device total
    (temp + argument + output - alias) exceeds the chip's capacity.
    """
    model, opt_state = abstract_state(config, strategy)
    tokens = jax.ShapeDtypeStruct((batch, config.seq + 1), jnp.int32)
    step = make_step(optimizer_for(strategy, config), STRATEGIES[strategy])
    start = time.perf_counter()
    try:
        report = ox.memory_report(step, model, opt_state, tokens, target=target, name=strategy)
    except Exception as error:
        # The TPU compiler refuses programs larger than HBM; at huge batches the GPU
        # compiler can fail to tile a GEMM. Either way the batch does not fit. Other
        # failures are compiler bugs (XLA:TPU crashes on the hybrid step, see the
        # README): recorded and shown, so that one strategy does not end the run.
        if not _out_of_memory(error):
            print(
                f"    {target} {strategy} batch {batch}: compile failed: "
                f"{str(error).splitlines()[0][:160]}",
                flush=True,
            )
        return {
            "error": str(error).split("\n")[0][:300],
            "out_of_memory": _out_of_memory(error),
            "batch": batch,
            "fits": False,
            "total": None,
            "host_total": None,
            "device": None,
            "host": None,
            "compile_s": time.perf_counter() - start,
        }
    return {
        "batch": batch,
        "fits": report.total <= CAPACITY[target],
        "total": report.total,
        "host_total": report.host_total,
        "device": dict(report.device),
        "host": dict(report.host),
        "compile_s": time.perf_counter() - start,
    }


def largest_batch(
    measure_at: Callable[[int], dict], capacity: int, first: dict, budget: int
) -> dict:
    """The largest batch whose step fits `capacity`, with at most `budget` more compiles.

    Device memory is nearly linear in the batch, so each probe is the batch where the line
    through the two nearest measurements meets the capacity (a secant step), kept strictly
    inside the bracket [largest fit + 1, smallest misfit - 1]; bisection takes over when
    there is no line (a refused compile). `exact` says the bracket closed.
    """
    probes = {first["batch"]: first}

    def predicted() -> int | None:
        # The line through the bracket's ends when both were measured (regula falsi),
        # otherwise through the two measurements nearest the capacity.
        measured = [(b, m["total"]) for b, m in probes.items() if m["total"] is not None]
        fits = [(b, t) for b, t in measured if probes[b]["fits"]]
        misfits = [(b, t) for b, t in measured if not probes[b]["fits"]]
        if fits and misfits:
            (b1, t1), (b2, t2) = max(fits), min(misfits)
        elif len(measured) >= 2:
            (b1, t1), (b2, t2) = sorted(measured, key=lambda bt: abs(bt[1] - capacity))[:2]
        else:
            return None
        slope = (t2 - t1) / (b2 - b1)
        return int(b1 + (capacity - t1) // slope) if slope > 0 else None

    for _ in range(budget):
        fit = [b for b, m in probes.items() if m["fits"]]
        misfit = [b for b, m in probes.items() if not m["fits"]]
        low = max(fit, default=0)
        high = min(misfit, default=None)
        if high is not None and high <= low + 1:
            break
        candidate = predicted()
        if candidate is None or candidate <= low or (high is not None and candidate >= high):
            # No usable line: double, or bisect the bracket.
            candidate = 2 * max(low, 1) if high is None else (low + high) // 2
        candidate = max(candidate, low + 1)
        if high is None:
            # Never jump more than 64x past the largest fit: a nearly flat line (memory
            # that hardly grows with the batch) would otherwise predict batches so large
            # that the GPU compiler fails to tile the GEMMs.
            candidate = min(candidate, 64 * max(low, 1))
        else:
            candidate = min(candidate, high - 1)
        probes[candidate] = measure_at(candidate)
    fit = [b for b, m in probes.items() if m["fits"]]
    misfit = [b for b, m in probes.items() if not m["fits"]]
    best = max(fit, default=0)
    return {
        "max_batch": best,
        "exact": bool(misfit) and min(misfit) == best + 1,
        # Where the line meets the capacity: the answer when the budget ran out first.
        "predicted": predicted(),
        "total_at_max": probes[best]["total"] if best else None,
        "probes": [
            {"batch": b, "fits": m["fits"], "total": m["total"], "compile_s": m["compile_s"]}
            for b, m in sorted(probes.items())
        ],
    }
