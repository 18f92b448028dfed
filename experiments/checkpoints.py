"""State that never passes through the device: created, checkpointed and restored in place.

Part 1, creation: a stacked model built the way users build it (`eqx.filter_vmap` over
keys) with host-resident layers several times the H100's memory, and its Adam state,
compiled for h100 and tpu-v5p without the hardware. Built on the device and moved to
`pinned_host` afterwards (what a plain `jax.jit` + `device_put` does), the whole model is
on the device first; built by `ox.filter_jit(lambda key: Model(key), strategy="hybrid")`
the host-resident part is computed on the host (`compute_on`), where the target can.

Part 2, restart: train under `hybrid` for one step, checkpoint with Orbax
(`ox.save_checkpoint`), restore in a new process (`ox.restore_checkpoint`) and train two
more steps; compare with three uninterrupted steps, bit for bit, on one device and on a 2x4
mesh (8 CPU devices, FSDP-sharded), and record where each leaf is right after the restore.

Run: `python experiments/checkpoints.py [--smoke | --full]` (`--full`: the 240 GiB model).
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v5p-8")
os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from _report import RESULTS, GiB, format_table, target_available  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import offload_eqx as ox  # noqa: E402

EIGHT_DEVICES = "--xla_force_host_platform_device_count=8"


class Layer(eqx.Module):
    w: jax.Array = ox.field(memory="device", spec=None)  # moved to the host by `hybrid`

    def __init__(self, width: int, key):
        self.w = jax.random.normal(key, (width, width)) / np.sqrt(width)

    def __call__(self, x):
        return x + jnp.tanh(x @ self.w)


class Model(eqx.Module):
    layers: Layer
    head: jax.Array

    def __init__(self, key, depth: int, width: int):
        k_layers, k_head = jax.random.split(key)
        self.layers = eqx.filter_vmap(lambda k: Layer(width, k))(jax.random.split(k_layers, depth))
        self.head = jax.random.normal(k_head, (width,)) / np.sqrt(width)

    def __call__(self, x):
        return ox.scan(self.layers, x) @ self.head


# -- Part 1: creation ---------------------------------------------------------------------


def creation(depth: int, width: int, targets=("h100", "tpu-v5p")) -> list[dict]:
    key = jax.random.key(0)
    model_bytes = depth * width * width * 4

    def moved_afterwards(key):
        model = eqx.filter(Model(key, depth, width), eqx.is_array)
        return jax.tree.map(lambda x: jax.device_put(x, jax.memory.Space.Host), model)

    build = ox.filter_jit(lambda key: Model(key, depth, width), strategy="hybrid")
    like = ox.abstract(eqx.filter_eval_shape(Model, key, depth, width), "hybrid")
    init = ox.filter_jit(ox.offload_optimizer(optax.adam(1e-3)).init, strategy="hybrid")
    programs = {
        "built on the device, then moved to pinned_host": (moved_afterwards, (key,)),
        "ox.filter_jit(Model, strategy='hybrid')": (build, (key,)),
        "ox.filter_jit(opt.init, strategy='hybrid')": (init, (like,)),
    }
    rows = []
    for target in (t for t in targets if target_available(t)):
        for name, (fn, args) in programs.items():
            row = dict(target=target, program=name, model_gib=model_bytes / GiB)
            try:
                report = ox.memory_report(fn, *args, target=target)
            except jax.errors.JaxRuntimeError as error:  # XLA:TPU refuses a program over HBM
                row.update(device_gib=None, host_gib=None, device_share=None, fits=False)
                row["refused"] = str(error).split("\n")[0]
            else:
                row.update(
                    device_gib=report.total / GiB,
                    host_gib=report.host_total / GiB,
                    device_share=report.total / model_bytes,
                    fits=report.fits,
                )
            rows.append(row)
    return rows


def _gib(value: float | None) -> str:
    return "refused" if value is None else f"{value:.2f}"


# -- Part 2: restart in a new process ----------------------------------------------------------


def _setup(layout: str):
    opt = ox.offload_optimizer(optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3)))
    mesh = None
    if layout == "mesh":
        mesh = jax.make_mesh((2, 4), ("data", "fsdp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)

    def build():
        model = Model(jax.random.key(0), depth=4, width=64)
        if mesh is not None:  # FSDP: each layer's rows over the `fsdp` axis
            model = ox.annotate(
                model, lambda m: m.layers, memory="device", spec=P(None, "fsdp", None)
            )
        return model

    x, y = jax.random.normal(jax.random.key(1), (2, 8, 64))
    y = jnp.sum(y, axis=-1) / 8  # a regression target per example
    if mesh is not None:
        x, y = ox.shard(x, P("data", None), mesh), ox.shard(y, P("data"), mesh)
    return opt, mesh, build, (x, y)


def worker(phase: str, layout: str, directory: str, steps: int, output: str) -> None:
    """One process of the restart: `straight`, `save` or `resume` (see the module doc)."""
    opt, mesh, build, batch = _setup(layout)
    result: dict = {}
    if phase == "resume":
        like = eqx.filter_eval_shape(lambda: (build(), opt.init(eqx.filter(build(), eqx.is_array))))
        model, opt_state = ox.restore_checkpoint(directory, like, "hybrid", mesh=mesh)
        result["restored"] = {
            jax.tree_util.keystr(
                path
            ): f"{leaf.sharding.memory_kind} {getattr(leaf.sharding, 'spec', '')}"
            for path, leaf in jax.tree_util.tree_leaves_with_path((model, opt_state))
        }
    else:
        model = ox.place(build(), "hybrid", mesh=mesh)
        opt_state = ox.place(opt.init(eqx.filter(model, eqx.is_array)), "hybrid")

    @ox.filter_jit(strategy="hybrid", donate="all")
    def step(model, opt_state, batch):
        x, y = batch
        loss, grads = eqx.filter_value_and_grad(lambda m: jnp.mean((jax.vmap(m)(x) - y) ** 2))(
            model
        )
        model, opt_state = ox.update_and_apply(opt, grads, opt_state, model)
        return model, opt_state, loss

    losses = []
    for _ in range(steps):
        model, opt_state, loss = step(model, opt_state, batch)
        losses.append(float(loss).hex())
    if phase == "save":
        ox.save_checkpoint(directory, (model, opt_state))
    result["losses"] = losses
    with open(output, "w") as f:
        json.dump(result, f)


def _process(phase: str, layout: str, directory: str, steps: int) -> dict:
    output = os.path.join(os.path.dirname(directory), f"{phase}-{layout}.json")
    env = dict(os.environ)
    if layout == "mesh":
        env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {EIGHT_DEVICES}".strip()
    command = [sys.executable, __file__, "--worker", phase, layout, directory, str(steps), output]
    subprocess.run(command, env=env, check=True, timeout=600)
    with open(output) as f:
        return json.load(f)


def restart(layout: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        straight = _process("straight", layout, os.path.join(tmp, "unused"), 3)
        saved = _process("save", layout, os.path.join(tmp, "ckpt"), 1)
        resumed = _process("resume", layout, os.path.join(tmp, "ckpt"), 2)
    losses = saved["losses"] + resumed["losses"]
    restored = resumed["restored"]
    return dict(
        layout="one device" if layout == "one" else "2x4 mesh",
        uninterrupted=[float.fromhex(v) for v in straight["losses"]],
        resumed=[float.fromhex(v) for v in losses],
        bitwise_equal=losses == straight["losses"],
        w=restored["[0].layers.w"],
        mu=restored["[1].inner[1][0].mu.layers.w"],
    )


def run(full: bool = False, results_dir: str = RESULTS) -> dict:
    depth, width = (240, 16384) if full else (8, 2048)
    created = creation(depth, width)
    print(f"Creating a {depth} x {width}^2 float32 stacked model and its Adam state (GiB):")
    print(
        format_table(
            ["target", "program", "model", "device", "host", "device/model", "fits"],
            [
                [r["target"], r["program"], f"{r['model_gib']:.2f}", _gib(r["device_gib"]),
                 _gib(r["host_gib"]),
                 "-" if r["device_share"] is None else f"{100 * r['device_share']:.2f}%",
                 r["fits"]]
                for r in created
            ],
        )
    )  # fmt: skip
    for r in created:
        if "refused" in r:
            print(f"  {r['target']}, {r['program']}: {r['refused']}")
    restarts = [restart("one"), restart("mesh")]
    print("\nRestart after step 1 in a new process (Orbax), losses of steps 1-3:")
    print(
        format_table(
            ["layout", "uninterrupted", "resumed", "bitwise", "layers.w restored", "its Adam mu"],
            [
                [r["layout"], " ".join(f"{v:.6f}" for v in r["uninterrupted"]),
                 " ".join(f"{v:.6f}" for v in r["resumed"]), r["bitwise_equal"], r["w"], r["mu"]]
                for r in restarts
            ],
        )
    )  # fmt: skip
    results = dict(creation=created, restart=restarts, depth=depth, width=width)
    os.makedirs(results_dir, exist_ok=True)
    with open(os.path.join(results_dir, "checkpoints.json"), "w") as f:
        json.dump(results, f, indent=2)
    return results


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        phase, layout, directory, steps, output = sys.argv[2:]
        worker(phase, layout, directory, int(steps), output)
    else:
        parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
        size = parser.add_mutually_exclusive_group()
        size.add_argument("--smoke", action="store_true", help="the default: an 8 x 2048^2 model")
        size.add_argument("--full", action="store_true", help="a 240 x 16384^2 model (240 GiB)")
        run(full=parser.parse_args().full)
