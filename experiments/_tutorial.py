"""The hand-written code of JAX's host-offloading tutorial, and its published numbers.

Copied from the tutorial ("JAX Memories and Host Offloading") with one change so that it
compiles for any target: an in-program move names a memory space
(`jax.device_put(x, jax.memory.Space.Device)`) instead of a `NamedSharding` built on this
machine's CPU device, which means the same thing on the device the program is compiled for.
The shardings the tutorial gives `jax.jit` (host-resident arguments, `out_shardings`,
`donate_argnums`) become the `in_memory`/`out_memory`/`donate_argnums` options of
`ox.memory_report`: each program below is `(fn, args, options)`, ready for
`ox.compare_memory`.
"""

import argparse
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax import checkpoint_policies as cp
from jax.ad_checkpoint import checkpoint_name

MiB = 2**20
GiB = 2**30

# Published numbers (the tutorial's printouts: MB = 2**20 bytes, GB = 2**30 bytes).
PUBLISHED = {
    "activation": {
        "baseline": {"temp": 17.25 * MiB, "argument": 20.25 * MiB, "total": 57.50 * MiB},
        "offload x": {"temp": 6.50 * MiB, "argument": 20.25 * MiB, "total": 46.75 * MiB},
    },
    "parameter": {
        "offload x": {"temp": 6.50 * MiB, "argument": 20.25 * MiB, "total": 46.75 * MiB},
        "params on host + offload x": {
            "temp": 4.75 * MiB,
            "argument": 0.25 * MiB,
            "total": 25.00 * MiB,
        },
    },
    "optimizer": {
        "baseline": {"temp": 2.11 * GiB, "argument": 2.49 * GiB, "total": 4.59 * GiB},
        "offload optimizer state": {
            "temp": 1.91 * GiB,
            "argument": 0.96 * GiB,
            "total": 2.87 * GiB,
        },
    },
}


# -- activation and parameter offloading (10 scanned layers of x @ w1 @ w2) -----------------

POLICY = cp.save_and_offload_only_these_names(
    names_which_can_be_saved=[],
    names_which_can_be_offloaded=["x"],
    offload_src="device",
    offload_dst="pinned_host",
)


def two_layers(x, w):
    w1, w2 = w
    y = x @ w1
    return y @ w2, None


def scanned(w, x):
    result = jax.lax.scan(two_layers, x, w)[0]
    return jnp.sum(result)


def layer_name(x, w):
    w1, w2 = w
    x = checkpoint_name(x, "x")
    y = x @ w1
    return y @ w2, None


def offload_scanned(w, x):
    remat_layer = jax.remat(layer_name, policy=POLICY, prevent_cse=False)
    result = jax.lax.scan(remat_layer, x, w)[0]
    return jnp.sum(result)


def hybrid_layer(x, w):
    # The tutorial: `jax.device_put(x, s_dev)` with s_dev a device NamedSharding.
    w1, w2 = jax.tree.map(lambda a: jax.device_put(a, jax.memory.Space.Device), w)
    x = checkpoint_name(x, "x")
    y = x @ w1
    return y @ w2, None


def hybrid_scanned(w, x):
    remat_layer = jax.remat(hybrid_layer, policy=POLICY, prevent_cse=False)
    result = jax.lax.scan(remat_layer, x, w)[0]
    return jnp.sum(result)


def scan_arguments(layers: int = 10, batch: int = 256, width: int = 256, hidden: int = 1024):
    """The tutorial's `(w1, w2), input` as abstract values (nothing allocated)."""
    f32 = jnp.float32
    w = (
        jax.ShapeDtypeStruct((layers, width, hidden), f32),
        jax.ShapeDtypeStruct((layers, hidden, width), f32),
    )
    return w, jax.ShapeDtypeStruct((batch, width), f32)


def scan_programs(**sizes: int) -> dict[str, tuple]:
    """The tutorial's three scan programs, as `ox.compare_memory` entries."""
    w, x = scan_arguments(**sizes)
    return {
        "baseline": (jax.grad(scanned), (w, x), {}),
        "offload x": (jax.grad(offload_scanned), (w, x), {}),
        # wh1, wh2 = jax.device_put(w, s_host); jax.jit(jax.grad(hybrid_scanned))
        "params on host + offload x": (
            jax.grad(hybrid_scanned),
            (w, x),
            {"in_memory": ("pinned_host", "device")},
        ),
    }


# -- optimizer state offloading (4 dense layers of DIM x DIM with GELU, Adam) ---------------

OPTIMIZER = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(learning_rate=0.1))


def gelu(x):
    return 0.5 * x * (1 + jnp.tanh(jnp.sqrt(2 / jnp.pi) * (x + 0.044715 * x**3)))


def forward(params, x):
    for i in range(1, 5):
        x = gelu(x @ params[f"w{i}"])
    return x


def compute_loss(params, inputs):
    outputs = forward(params, inputs)
    loss = jnp.mean((outputs - inputs) ** 2)
    l2_reg = 0.001 * sum(jnp.sum(w**2) for w in jax.tree_util.tree_leaves(params))
    return loss + l2_reg


def step(params, opt_state, inputs):
    grads = jax.grad(lambda p: compute_loss(p, inputs))(params)
    updates, new_opt_state = OPTIMIZER.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), new_opt_state


def offload_step(params, opt_state, inputs):
    grads = jax.grad(lambda p: compute_loss(p, inputs))(params)
    # The tutorial: `jax.device_put(opt_state, s_dev)` with s_dev a SingleDeviceSharding.
    opt_state = jax.device_put(opt_state, jax.memory.Space.Device)
    updates, new_opt_state = OPTIMIZER.update(grads, opt_state, params)
    new_params = optax.apply_updates(params, updates)
    return new_params, new_opt_state


def optimizer_arguments(dim: int) -> tuple[Any, Any, Any]:
    """`params, opt_state, input` of the tutorial as abstract values (nothing allocated)."""
    params = {f"w{i}": jax.ShapeDtypeStruct((dim, dim), jnp.float32) for i in range(1, 5)}
    opt_state = jax.eval_shape(OPTIMIZER.init, params)
    return params, opt_state, jax.ShapeDtypeStruct((dim, dim), jnp.float32)


def optimizer_programs(dim: int) -> dict[str, tuple]:
    params, opt_state, x = optimizer_arguments(dim)
    return {
        # jax.jit(step, donate_argnums=(0, 1))
        "baseline": (step, (params, opt_state, x), {"donate_argnums": (0, 1)}),
        # opt_state = jax.device_put(opt_state, s_host);
        # jax.jit(step, donate_argnums=(0,), out_shardings=(s_dev, s_host))
        "offload optimizer state": (
            offload_step,
            (params, opt_state, x),
            {
                "in_memory": ("device", "pinned_host", "device"),
                "out_memory": ("device", "pinned_host"),
                "donate_argnums": (0,),
            },
        ),
    }


# -- shared runner: compile every program on every target, print, write JSON and a plot ------

TARGETS = ("h100", "tpu-v5p", "cpu")


def scan_script_main(run: Callable[..., Any], doc: str) -> None:
    """The command line of the scan scripts (`activation_`, `parameter_offloading.py`)."""
    parser = argparse.ArgumentParser(description=doc.split("\n")[0])
    parser.add_argument("--targets", nargs="+", default=list(TARGETS))
    parser.add_argument("--smoke", action="store_true", help="the default: the tutorial's sizes")
    parser.add_argument("--full", action="store_true", help="same sizes (the workload is small)")
    run(targets=parser.parse_args().targets)


def transfer_totals(fn, args) -> dict[str, int] | None:
    """Bytes moved per step by the audit (`offload_eqx._audit.audit`), or None without it."""
    try:
        from offload_eqx._audit import audit
    except ImportError:
        return None
    report = audit(fn, *args)
    return {"h2d": report.total("host-to-device"), "d2h": report.total("device-to-host")}


def _fmt(n, unit: int) -> str:
    return "-" if n is None else f"{n / unit:.2f}"


def run_workload(
    workload: str,
    pairs: Any,
    bounds: Any,
    targets: tuple[str, ...],
    unit: int,
    results_dir: str,
    ox_targets: dict[str, tuple[str, ...]] | None = None,
) -> dict:
    """Compile each `(tutorial program, offload_eqx program)` pair on each target.

    `pairs[name] = ((fn, args, options) | None, (ox_fn, ox_args))`; `bounds[name]` is the
    analytic lower bound of the device total. Either may be a function of the target name
    (a workload compiled at another size on the CPU). Returns the results (also in JSON).
    """
    import json
    import os

    from offload_eqx._memory import memory_report

    unit_name = "MiB" if unit == MiB else "GiB"
    rows = []
    transfers = {}
    for target in targets:
        target_pairs = pairs(target) if callable(pairs) else pairs
        target_bounds = bounds(target) if callable(bounds) else bounds
        for name, (tutorial, ours) in target_pairs.items():
            if ox_targets is not None and target not in ox_targets.get(name, targets):
                continue
            row = {"workload": workload, "program": name, "target": target}
            published = PUBLISHED[workload].get(name) if target == "h100" else None
            row["published_total"] = published["total"] if published else None
            if tutorial is not None:
                fn, args, options = tutorial
                row["tutorial"] = memory_report(
                    fn, *args, target=target, name=name, **options
                ).as_dict()
            else:
                row["tutorial"] = None
            ox_fn, ox_args = ours
            row["offload_eqx"] = memory_report(ox_fn, *ox_args, target=target, name=name).as_dict()
            row["bound"] = target_bounds.get(name)
            row["transfers"] = transfers[(target, name)] = transfer_totals(ox_fn, ox_args)
            rows.append(row)
    have_audit = any(t is not None for t in transfers.values())
    header = [
        "program",
        "target",
        "published",
        "tutorial temp",
        "tutorial total",
        "ox temp",
        "ox argument",
        "ox host arg+temp",
        "ox total",
        "bound",
        "ox <= tutorial",
    ]
    if have_audit:
        header += ["h2d / step", "d2h / step"]
    table = []
    for row in rows:
        tut, ox = row["tutorial"], row["offload_eqx"]
        line = [
            row["program"],
            row["target"],
            _fmt(row["published_total"], unit),
            _fmt(tut and tut["device"]["temp"], unit),
            _fmt(tut and tut["total"], unit),
            _fmt(ox["device"]["temp"], unit),
            _fmt(ox["device"]["argument"], unit),
            _fmt(ox["host"]["argument"] + ox["host"]["temp"], unit),
            _fmt(ox["total"], unit),
            _fmt(row["bound"], unit),
            "-" if tut is None else ("yes" if ox["total"] <= tut["total"] else "NO"),
        ]
        if have_audit:
            t = row["transfers"]
            line += [_fmt(t and t["h2d"], unit), _fmt(t and t["d2h"], unit)]
        table.append(line)
    widths = [max(len(str(r[i])) for r in [header, *table]) for i in range(len(header))]
    text = [
        f"{workload} offloading, device memory in {unit_name} (total = temp + argument + "
        "output - alias; published = the tutorial's GPU printout)"
    ]
    text.append(" | ".join(h.ljust(w) for h, w in zip(header, widths)))
    text.append("-+-".join("-" * w for w in widths))
    text += [" | ".join(str(c).ljust(w) for c, w in zip(r, widths)) for r in table]
    print("\n".join(text))
    os.makedirs(results_dir, exist_ok=True)
    result = {"workload": workload, "unit": unit_name, "rows": rows, "table": text}
    with open(os.path.join(results_dir, f"{workload}_offloading.json"), "w") as f:
        json.dump(result, f, indent=1, default=str)
    _plot(workload, rows, unit, unit_name, os.path.join(results_dir, f"{workload}_offloading.png"))
    return result


def _plot(workload, rows, unit, unit_name, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    targets = list(dict.fromkeys(r["target"] for r in rows))
    fig, axes = plt.subplots(1, len(targets), figsize=(5 * len(targets), 4), squeeze=False)
    for ax, target in zip(axes[0], targets):
        mine = [r for r in rows if r["target"] == target]
        labels = [r["program"] for r in mine]
        xs = range(len(mine))
        tut = [(r["tutorial"]["total"] / unit) if r["tutorial"] else 0 for r in mine]
        ox = [r["offload_eqx"]["total"] / unit for r in mine]
        ax.bar([x - 0.2 for x in xs], tut, 0.4, label="tutorial code")
        ax.bar([x + 0.2 for x in xs], ox, 0.4, label="offload_eqx")
        for x, r in zip(xs, mine):
            if r["bound"] is not None:
                ax.hlines(r["bound"] / unit, x - 0.4, x + 0.4, colors="k", linestyles="dashed")
            if r["published_total"] is not None:
                ax.plot([x - 0.2], [r["published_total"] / unit], "r*")
        ax.set_xticks(list(xs), labels, rotation=20, ha="right", fontsize=7)
        ax.set_title(target)
        ax.set_ylabel(f"device total ({unit_name})")
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"{workload} offloading (dashed: lower bound, star: published)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
