"""What the experiment scripts share: the command line, the targets, tables, JSON and plots.

`run_workload` compiles each of the tutorial's hand-written programs (`_tutorial.py`) beside
the same workload written with offload_eqx, on each target, with `ox.memory_report`, counts
the bytes each offload_eqx program moves per step with `ox.audit`, prints one table and
writes it as JSON (and a bar chart, when matplotlib is installed) into `experiments/results/`.
Public API only: nothing here imports a private module of the package.
"""

import argparse
import json
import os
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from _tutorial import PUBLISHED

import offload_eqx as ox

MiB = 2**20
GiB = 2**30

# The compilers every script compiles for, by default: XLA:GPU and XLA:TPU without the
# hardware (the `cuda` and `tpu` extras), and this machine's CPU.
DEFAULT_TARGETS = ("h100", "tpu-v5p", "cpu")
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def target_available(target: str) -> bool:
    """Whether the compiler of `target` is installed, printing why not when it is not.

    `ox.memory_report` raises an `ImportError` naming the missing extra; asking it to compile
    a one-element program is the public way to find out (a second compile of the same
    target reuses its devices).
    """
    try:
        ox.memory_report(lambda x: x + 1, jax.ShapeDtypeStruct((1,), jnp.float32), target=target)
    except ImportError as error:
        print(f"skipping {target}: {str(error).split('. ')[0]}.")
        return False
    return True


def format_table(header: Sequence[str], rows: Sequence[Sequence[Any]], markdown=False) -> str:
    """Columns padded to their widest cell; `markdown` draws `| a | b |` rows."""
    cells = [[str(c) for c in header], *([str(c) for c in row] for row in rows)]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    lines = [[c.ljust(w) for c, w in zip(row, widths)] for row in cells]
    if markdown:
        rule = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
        text = ["| " + " | ".join(line) + " |" for line in lines]
    else:
        rule = "-+-".join("-" * w for w in widths)
        text = [" | ".join(line) for line in lines]
    return "\n".join([text[0], rule, *text[1:]])


def script_main(run: Callable[..., Any], doc: str) -> None:
    """The command line of the scan scripts (`activation_`, `parameter_offloading.py`)."""
    parser = argparse.ArgumentParser(description=doc.split("\n")[0])
    parser.add_argument("--targets", nargs="+", default=list(DEFAULT_TARGETS))
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--smoke", action="store_true", help="the default: the tutorial's sizes")
    size.add_argument("--full", action="store_true", help="same sizes (the workload is small)")
    run(targets=parser.parse_args().targets)


def transfer_totals(fn: Callable[..., Any], args: tuple) -> dict[str, int]:
    """Bytes moved per step between device and host, found by `ox.audit`."""
    report = ox.audit(fn, *args)
    return {"h2d": report.total("host-to-device"), "d2h": report.total("device-to-host")}


def _fmt(n: float | None, unit: int) -> str:
    return "-" if n is None else f"{n / unit:.2f}"


def run_workload(
    workload: str,
    pairs: Any,
    bounds: Any,
    targets: tuple[str, ...],
    unit: int,
    results_dir: str = RESULTS,
) -> dict:
    """Compile each `(tutorial program, offload_eqx program)` pair on each target.

    `pairs[name] = ((fn, args, options) | None, (ox_fn, ox_args))`; `bounds[name]` is the
    analytic lower bound of the device total. Either may be a function of the target name
    (a workload compiled at another size on the CPU). An offload_eqx program whose compile
    raises a `ValueError` (a host computation for XLA:TPU) is a row marked `refused`, its
    reason printed under the table. Returns the results (also in JSON).
    """
    unit_name = "MiB" if unit == MiB else "GiB"
    rows = []
    for target in (t for t in targets if target_available(t)):
        target_pairs = pairs(target) if callable(pairs) else pairs
        target_bounds = bounds(target) if callable(bounds) else bounds
        for name, (tutorial, (ox_fn, ox_args)) in target_pairs.items():
            published = PUBLISHED[workload].get(name) if target == "h100" else None
            tutorial_report = None
            if tutorial is not None:
                fn, args, options = tutorial
                report = ox.memory_report(fn, *args, target=target, name=name, **options)
                tutorial_report = report.as_dict()
            try:
                ours, refused = ox.memory_report(ox_fn, *ox_args, target=target, name=name), None
            except ValueError as error:
                # A program the target cannot run (a host computation on XLA:TPU) is
                # refused when compiled: a row saying why, not a crash.
                ours, refused = None, str(error)
            rows.append(
                {
                    "workload": workload,
                    "program": name,
                    "target": target,
                    "published_total": published["total"] if published else None,
                    "tutorial": tutorial_report,
                    "offload_eqx": ours and ours.as_dict(),
                    "refused": refused,
                    "bound": target_bounds.get(name),
                    "transfers": None if refused else transfer_totals(ox_fn, ox_args),
                }
            )
    notes = [
        f"refused: {r['program']} on {r['target']}: {r['refused']}" for r in rows if r["refused"]
    ]
    text = (
        f"{workload} offloading, device memory in {unit_name} (total = temp + argument + "
        "output - alias; published = the tutorial's GPU printout)\n"
        + format_table(_HEADER, [_table_row(row, unit) for row in rows])
        + "".join("\n" + note for note in notes)
    )
    print(text)
    os.makedirs(results_dir, exist_ok=True)
    result = {"workload": workload, "unit": unit_name, "rows": rows, "table": text.split("\n")}
    with open(os.path.join(results_dir, f"{workload}_offloading.json"), "w") as f:
        json.dump(result, f, indent=1, default=str)
    _plot(workload, rows, unit, unit_name, os.path.join(results_dir, f"{workload}_offloading.png"))
    return result


_HEADER = [
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
    "h2d / step",
    "d2h / step",
]


def _table_row(row: dict, unit: int) -> list[str]:
    tutorial, ours, moved = row["tutorial"], row["offload_eqx"], row["transfers"]
    if ours is None:  # refused by the target's compiler (the reason follows the table)
        return [
            row["program"],
            row["target"],
            _fmt(row["published_total"], unit),
            _fmt(tutorial and tutorial["device"]["temp"], unit),
            _fmt(tutorial and tutorial["total"], unit),
            "refused",
            *["-"] * 3,
            _fmt(row["bound"], unit),
            *["-"] * 3,
        ]
    return [
        row["program"],
        row["target"],
        _fmt(row["published_total"], unit),
        _fmt(tutorial and tutorial["device"]["temp"], unit),
        _fmt(tutorial and tutorial["total"], unit),
        _fmt(ours["device"]["temp"], unit),
        _fmt(ours["device"]["argument"], unit),
        _fmt(ours["host"]["argument"] + ours["host"]["temp"], unit),
        _fmt(ours["total"], unit),
        _fmt(row["bound"], unit),
        "-" if tutorial is None else ("yes" if ours["total"] <= tutorial["total"] else "NO"),
        _fmt(moved["h2d"], unit),
        _fmt(moved["d2h"], unit),
    ]


def pyplot() -> Any:
    """`matplotlib.pyplot` on a file-only backend, or None (with a note) without matplotlib,
    which the `experiments` extra installs."""
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed (`pip install -e .[experiments]`): no plot.")
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _plot(workload: str, rows: list[dict], unit: int, unit_name: str, path: str) -> None:
    plt = pyplot()
    if plt is None or not rows:
        return
    targets = list(dict.fromkeys(r["target"] for r in rows))
    fig, axes = plt.subplots(1, len(targets), figsize=(5 * len(targets), 4), squeeze=False)
    for ax, target in zip(axes[0], targets):
        mine = [r for r in rows if r["target"] == target]
        xs = range(len(mine))
        tutorial = [(r["tutorial"]["total"] / unit) if r["tutorial"] else 0 for r in mine]
        ours = [(r["offload_eqx"]["total"] / unit) if r["offload_eqx"] else 0 for r in mine]
        ax.bar([x - 0.2 for x in xs], tutorial, 0.4, label="tutorial code")
        ax.bar([x + 0.2 for x in xs], ours, 0.4, label="offload_eqx")
        for x, r in zip(xs, mine):
            if r["bound"] is not None:
                ax.hlines(r["bound"] / unit, x - 0.4, x + 0.4, colors="k", linestyles="dashed")
            if r["published_total"] is not None:
                ax.plot([x - 0.2], [r["published_total"] / unit], "r*")
        ax.set_xticks(list(xs), [r["program"] for r in mine], rotation=20, ha="right", fontsize=7)
        ax.set_title(target)
        ax.set_ylabel(f"device total ({unit_name})")
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"{workload} offloading (dashed: lower bound, star: published)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
