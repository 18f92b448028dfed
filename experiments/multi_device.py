"""Llama-2-70B planned over several devices: FSDP on 8 H100s and on a v5p slice.

The decoder of `_decoder.py` at Llama-2-70B's shape (d 8192, ffn 28672, 80 layers, 64
query heads sharing 8 key/value heads: 68.98B parameters, bf16 weights and AdamW state)
trains on sequences of 4,096 tokens, one per device and step. Every weight and every
optimizer-state leaf is sharded over the mesh's `fsdp` axis (fully sharded data
parallel: each device holds an eighth, or a quarter, and gathers a layer's weights when
it runs the layer), the tokens over the same axis. The update is AdamW streamed layer by
layer (`ox.offload_optimizer(..., stream="layer")`), so one step serves every plan.

For each target, compiled without the hardware (the 8-device CPU mesh stands for the
target's devices):

- the presets, priced with `ox.estimate` (the compiled schedule simulated, collectives
  on the interconnect as rings): `full_remat` (everything on the device, everything
  recomputed), `state_on_host` (optimizer state in host memory), `hybrid` (parameters
  and optimizer state in host memory, q/k/v offloaded, the rest recomputed) and
  `host_update` (`hybrid` with the AdamW update run on the host);
- `ox.fit`'s plan within the device's memory.

Printed and written to `experiments/results/multi_device[_TAG].json`: per plan the step
time (simulated, and the jaxpr count's, which prices no collective), tokens/s over all
devices, MFU (6 x parameters x tokens over the peak of every device), device and host
memory per device, the interconnect's busy time and what the compute stream waited for.

    python experiments/multi_device.py --smoke   # a 4-layer GQA decoder on h100-8
    python experiments/multi_device.py           # the same on h100-8 and tpu-v5p-4
    python experiments/multi_device.py --full    # Llama-2-70B on h100-8 and tpu-v5p-4
    python experiments/multi_device.py --full --zero-offload 2e12  # the 2 TB node's rows

`--zero-offload HOST_BYTES` plans the ZeRO-Offload recipe of `largest_models.py` instead
(float32 masters and moments in host memory, the update on the host, delayed and not) on
h100-8, `ox.fit` within each device's memory and its eighth of the node's host memory.
"""

import os
import sys

# Eight CPU devices stand for the target's: set before JAX starts.
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v5p-8")
os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import argparse  # noqa: E402
import json  # noqa: E402
import multiprocessing  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from _decoder import CONFIGS, Config, abstract_state, make_step, optimizer_for  # noqa: E402
from _report import RESULTS, format_table, target_available  # noqa: E402
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P  # noqa: E402
from largest_models import FRUGAL, optimizer as zero_offload_optimizer  # noqa: E402

import offload_eqx as ox  # noqa: E402

GB = 1e9
QKV = dict.fromkeys(("q", "k", "v"), "offload")
PRESETS = {
    "full_remat": ox.Strategy("full_remat", "device", "device", "remat"),
    "state_on_host": ox.Strategy("state_on_host", "device", "pinned_host", "remat"),
    "hybrid": ox.Strategy("hybrid", "pinned_host", "pinned_host", "remat", names=QKV),
    "host_update": ox.Strategy(
        "host_update", "pinned_host", "pinned_host", "remat", names=QKV, update="host"
    ),
}
# (target, devices in its mesh)
TARGETS = {"h100-8": 8, "tpu-v5p-4": 4}
# A decoder small enough to compile in seconds, with grouped-query attention as 70B has.
SMALL = Config("small", vocab=4096, dim=1024, ffn=2816, layers=4, heads=8, seq=1024, kv_heads=2)
# (config, targets, max_compiles of each search, seconds one compile may take)
SIZES: dict[str, tuple[Config, list[str], int, float]] = {
    "smoke": (SMALL, ["h100-8"], 3, 300),
    "default": (SMALL, ["h100-8", "tpu-v5p-4"], 4, 300),
    "full": (CONFIGS["70B"], ["h100-8", "tpu-v5p-4"], 8, 300),
}


def _spec(x: jax.ShapeDtypeStruct) -> P:
    """FSDP: a stacked weight (layers, in, out) over its input rows, a large matrix
    over its first axis; norms and scalars replicated."""
    if x.ndim == 3:
        return P(None, "fsdp", None)
    if x.ndim == 2 and x.size >= 2**20:
        return P("fsdp", None)
    return P()


def sharded_args(config: Config, devices: int) -> tuple[Any, Any, Any, Any]:
    """The mesh, and the model, optimizer state and tokens as sharded
    `ShapeDtypeStruct`s on it (one sequence per device)."""
    mesh = jax.make_mesh(
        (devices,), ("fsdp",), axis_types=(AxisType.Auto,), devices=jax.devices()[:devices]
    )

    def shard(tree: Any) -> Any:
        return jax.tree_util.tree_map(
            lambda x: jax.ShapeDtypeStruct(
                x.shape, x.dtype, sharding=NamedSharding(mesh, _spec(x))
            ),
            tree,
        )

    model, state = abstract_state(config, "hybrid")
    tokens = jax.ShapeDtypeStruct(
        (devices, config.seq + 1), jnp.int32, sharding=NamedSharding(mesh, P("fsdp"))
    )
    return mesh, (shard(model), shard(state), tokens)


def _row(name: str, estimate: Any, config: Config, target: ox.Target, devices: int) -> dict:
    speeds = target.speeds
    assert speeds is not None and target.capacity is not None
    tokens = devices * config.seq
    sim = estimate.simulation
    host = estimate.host_bytes or 0
    return {
        "plan": name,
        "strategy": estimate.strategy,
        "seconds": estimate.seconds,
        "traced_seconds": estimate.traced_seconds,
        "tokens_per_s": tokens / estimate.seconds,
        "mfu_6nt": 6 * config.parameters * tokens / estimate.seconds / (speeds.flops * devices),
        "device": estimate.device_bytes,
        "host": estimate.host_bytes,
        "fits": estimate.device_bytes <= target.capacity and host <= speeds.host_memory,
        "network_s": sim.busy.get("network", 0.0) if sim else None,
        "waited": dict(sim.waited) if sim else None,
        "error": None,
    }


def _failed(name: str, error: Exception) -> dict:
    text = str(error).splitlines()[0][:200]
    return {"plan": name, "error": f"{type(error).__name__}: {text}"}


def _preset_row(config: Config, target_name: str, name: str) -> dict:
    """One preset compiled for the target and its schedule simulated."""
    devices, target = TARGETS[target_name], ox.TARGETS[target_name]
    mesh, args = sharded_args(config, devices)
    step = make_step(optimizer_for("hybrid", config), PRESETS[name], mesh)  # AdamW by layer
    try:
        estimate = ox.estimate(step, *args, target=target_name)
    except Exception as error:  # a refusal or a compiler crash: recorded, the run goes on
        return _failed(name, error)
    return _row(name, estimate, config, target, devices)


def _fit_row(config: Config, target_name: str, max_compiles: int) -> tuple[dict, dict]:
    """`ox.fit`'s plan within the device's memory, and what its search cost."""
    devices, target = TARGETS[target_name], ox.TARGETS[target_name]
    mesh, args = sharded_args(config, devices)
    step = make_step(optimizer_for("hybrid", config), None, mesh)
    try:
        result = ox.fit(step, *args, target=target_name, max_compiles=max_compiles)
    except Exception as error:  # no plan fits, or a compile failed
        return _failed("ox.fit", error), {"error": str(error)}
    row = _row(f"ox.fit: {result.strategy.name}", result.estimate, config, target, devices)
    return row, {"traces": result.traces, "compiles": result.compiles, "table": result.table(8)}


def _zero_offload_row(
    config: Config, target_name: str, max_compiles: int, host_budget: float, delay: int
) -> tuple[dict, dict]:
    """The ZeRO-Offload recipe over the node (`largest_models.py`'s: float32 masters and
    AdamW's moments in host memory, updated on the host, parameters streamed by layer),
    every leaf sharded FSDP: `ox.fit`'s plan within each device's memory and its share of
    the node's host memory (`host_budget`, per device)."""
    devices, target = TARGETS[target_name], ox.TARGETS[target_name]
    mesh, (model, _, tokens) = sharded_args(config, devices)
    opt = zero_offload_optimizer(delay)
    state = jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, _spec(x))),
        eqx.filter_eval_shape(opt.init, model),
    )
    name = f"ZeRO-Offload, delay {delay}"
    step = make_step(opt, FRUGAL, mesh)
    try:
        result = ox.fit(
            step, model, state, tokens, target=target_name, host_budget=int(host_budget),
            max_compiles=max_compiles,
        )  # fmt: skip
    except Exception as error:  # no plan fits, or a compile failed
        return _failed(name, error), {"error": str(error)}
    row = _row(f"{name}: {result.strategy.name}", result.estimate, config, target, devices)
    row["fits"] = row["fits"] and (result.estimate.host_bytes or 0) <= host_budget
    row["binding"] = result.binding()
    return row, {"traces": result.traces, "compiles": result.compiles, "table": result.table(8)}


def zero_offload(size: str, host_budget: float, tag: str) -> list[dict]:
    """The ZeRO-Offload rows on h100-8: the update delayed and not, each `ox.fit`'s plan
    within the devices and `host_budget` bytes of host memory for the node."""
    config, _, max_compiles, timeout = SIZES[size]
    target_name = "h100-8"
    per_device = host_budget / TARGETS[target_name]
    rows, searches = [], []
    for delay in (1, 0):
        start = time.perf_counter()
        row, search = _guarded(
            f"ZeRO-Offload, delay {delay}", 2 * timeout, _zero_offload_row,
            config, target_name, max_compiles, per_device, delay,
        )  # fmt: skip
        search["seconds"] = time.perf_counter() - start
        seconds = search["seconds"]
        print(f"  {config.name} {target_name} ZeRO-Offload delay {delay}: {seconds:.1f} s")
        rows.append(row)
        searches.append(search)
    result = {"config": config.name, "parameters": config.parameters, "target": target_name,
              "devices": TARGETS[target_name], "host_budget": host_budget, "rows": rows,
              "search": {"ZeRO-Offload": searches}}  # fmt: skip
    print(table([result]))
    os.makedirs(RESULTS, exist_ok=True)
    path = os.path.join(RESULTS, f"multi_device_zero_offload{tag}.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1, default=str)
    print(f"wrote {path}")
    return [result]


def _guarded(name: str, timeout: float, function: Any, *args: Any) -> Any:
    """`function(*args)` in a child process (spawned, so it sets up its own eight CPU
    devices), or a row saying it did not finish within `timeout` seconds: XLA:TPU
    compiles some host-offloaded plans of 70B for more than 20 minutes."""
    pool = multiprocessing.get_context("spawn").Pool(1)
    pending = pool.apply_async(function, args)
    try:
        result = pending.get(timeout)
    except multiprocessing.TimeoutError:
        pool.terminate()  # the compile still running: nothing else to lose
        row = {"plan": name, "error": f"TimeoutError: not compiled within {timeout:.0f} s"}
        return (row, {"error": row["error"]}) if function is not _preset_row else row
    pool.close()  # the worker exits on its own (terminating it makes XLA print a trace)
    pool.join()
    return result


def plan_one(config: Config, target_name: str, max_compiles: int, timeout: float) -> dict:
    """The presets and `ox.fit`'s plan for `config` over `target_name`'s devices, each
    in a child process that may take at most `timeout` seconds."""
    rows = []
    for name in PRESETS:
        start = time.perf_counter()
        rows.append(_guarded(name, timeout, _preset_row, config, target_name, name))
        print(f"  {config.name} {target_name} {name}: {time.perf_counter() - start:.1f} s")
    start = time.perf_counter()
    fit_limit = 2 * timeout  # most compiles take seconds; one that does not takes it all
    row, search = _guarded("ox.fit", fit_limit, _fit_row, config, target_name, max_compiles)
    rows.append(row)
    search["seconds"] = time.perf_counter() - start
    print(f"  {config.name} {target_name} ox.fit: {search['seconds']:.1f} s")
    target = ox.TARGETS[target_name]
    return {
        "config": config.name,
        "parameters": config.parameters,
        "target": target_name,
        "devices": TARGETS[target_name],
        "capacity": target.capacity,
        "rows": rows,
        "search": search,
    }


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.4g}"


def table(results: list[dict]) -> str:
    header = [
        "config", "target", "plan", "step ms", "jaxpr count ms", "tokens/s", "MFU 6NT",
        "device GB", "host GB", "fits", "network ms", "waited for (ms)",
    ]  # fmt: skip
    lines = []
    for r in results:
        for row in r["rows"]:
            if row.get("error"):
                lines.append([r["config"], r["target"], row["plan"], *["-"] * 8, row["error"]])
                continue
            waited = ", ".join(f"{k} {_ms(v)}" for k, v in sorted(row["waited"].items()))
            lines.append([
                r["config"], r["target"], row["plan"], _ms(row["seconds"]),
                _ms(row["traced_seconds"]), f"{row['tokens_per_s']:.0f}",
                f"{row['mfu_6nt']:.1%}", f"{row['device'] / GB:.2f}", f"{row['host'] / GB:.2f}",
                "yes" if row["fits"] else "no", _ms(row["network_s"]), waited or "-",
            ])  # fmt: skip
    return format_table(header, lines, markdown=True)


def run(size: str, tag: str, only: list[str] | None = None) -> list[dict]:
    config, targets, max_compiles, timeout = SIZES[size]
    targets = only or targets
    print(
        f"{config.name}: {config.parameters / 1e9:.2f}B parameters, d {config.dim}, ffn "
        f"{config.ffn}, {config.layers} layers, heads {config.heads} (kv {config.kv_heads}); "
        f"one sequence of {config.seq} tokens per device; FSDP over each target's devices"
    )
    results = [plan_one(config, t, max_compiles, timeout) for t in targets if target_available(t)]
    print(table(results))
    for r in results:
        if "table" in r["search"]:
            print(f"\nox.fit on {r['target']} ({r['search']['seconds']:.0f} s):")
            print(r["search"]["table"])
    os.makedirs(RESULTS, exist_ok=True)
    path = os.path.join(RESULTS, f"multi_device{tag}.json")
    with open(path, "w") as f:
        json.dump(results, f, indent=1, default=str)
    print(f"wrote {path}")
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--smoke", action="store_true", help="the small decoder on h100-8")
    group.add_argument("--full", action="store_true", help="Llama-2-70B on h100-8 and v5p")
    parser.add_argument("--targets", nargs="+", choices=list(TARGETS), help="only these")
    parser.add_argument(
        "--zero-offload",
        type=float,
        metavar="HOST_BYTES",
        help="instead: the ZeRO-Offload recipe on h100-8 within this much host memory for "
        "the node (2e12 for a 2 TB node), the update delayed and not",
    )
    options = parser.parse_args()
    size = "smoke" if options.smoke else "full" if options.full else "default"
    tag = "" if size == "full" else f"_{size}"
    if options.zero_offload:
        zero_offload(size, options.zero_offload, tag)
        return
    run(size, tag + "".join(f"_{t}" for t in options.targets or ()), options.targets)


if __name__ == "__main__":
    main()
