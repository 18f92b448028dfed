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
    panel_notes: Callable[[str], str | None] | None = None,
) -> dict:
    """Compile each `(tutorial program, offload_eqx program)` pair on each target.

    `pairs[name] = ((fn, args, options) | None, (ox_fn, ox_args))`; `bounds[name]` is the
    analytic lower bound of the device total. Either may be a function of the target name
    (a workload compiled at another size on the CPU). An offload_eqx program whose compile
    raises a `ValueError` (a host computation for XLA:TPU) is a row marked `refused`, its
    reason printed under the table. `panel_notes(target)` is said on that target's panel
    of the plot. Returns the results (also in JSON).
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
    path = os.path.join(results_dir, f"{workload}_offloading.png")
    _plot(workload, rows, unit, unit_name, path, panel_notes)
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


# What each target's compiler is, for the panel titles.
_TARGET_TITLES = {
    "h100": "h100: XLA:GPU, compile-only",
    "tpu-v5p": "tpu-v5p: XLA:TPU, compile-only",
    "cpu": "cpu: this machine's XLA:CPU",
}
# Said on every CPU panel: its totals include what the other targets keep in host memory.
CPU_NOTE = (
    "A CPU has one memory: arrays placed in host memory are counted in this total "
    "(offloading is only a type here), so a bound that assumes a separate host memory "
    "need not hold."
)
_COLORS = {"tutorial": "tab:blue", "ox": "tab:orange"}


def _plot(
    workload: str,
    rows: list[dict],
    unit: int,
    unit_name: str,
    path: str,
    notes: Callable[[str], str | None] | None = None,
) -> None:
    """One panel per target: the device total of the tutorial's code and of offload_eqx per
    program, the analytic bound and the published figure; cells with no program (the
    tutorial has none) or a refused one say so in text. `notes(target)` adds a note to a
    panel (the CPU panel always says that a CPU has one memory)."""
    plt = pyplot()
    if plt is None or not rows:
        return
    import textwrap

    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    targets = list(dict.fromkeys(r["target"] for r in rows))
    figure, axes = plt.subplots(
        1, len(targets), figsize=(5.4 * len(targets), 5.6), squeeze=False, layout="constrained"
    )
    for axis, target in zip(axes[0], targets):
        mine = [r for r in rows if r["target"] == target]
        values = [
            v
            for r in mine
            for v in (
                r["tutorial"] and r["tutorial"]["total"],
                r["offload_eqx"] and r["offload_eqx"]["total"],
                r["bound"],
                r["published_total"],
            )
            if v is not None
        ]
        # A panel whose figures are all small (the CPU at a smaller size) in MiB.
        scale, scale_name = (unit, unit_name)
        if unit == GiB and max(values, default=0) < GiB / 2:
            scale, scale_name = MiB, "MiB"
        top = max(values, default=1) / scale
        for x, r in enumerate(mine):
            refused = "refused for\nthis target" if r["refused"] else "-"
            cells = (
                ("tutorial", x - 0.2, r["tutorial"], "no tutorial\nprogram"),
                ("ox", x + 0.2, r["offload_eqx"], refused),
            )
            for kind, position, report, missing in cells:
                if report is None:
                    axis.text(
                        position, top * 0.02, missing, rotation=90, ha="center", va="bottom",
                        fontsize=8, color="tab:red" if r["refused"] and kind == "ox" else "0.4",
                    )  # fmt: skip
                    continue
                value = report["total"] / scale
                axis.bar(position, value, 0.38, color=_COLORS[kind])
                # The value inside the bar (above a short one), at the first of half, a
                # quarter or three quarters of its height clear of the bound and the star.
                inside = value > 0.12 * top
                marks = [m / scale for m in (r["bound"], r["published_total"]) if m is not None]
                height = next(
                    (
                        value * f
                        for f in (0.5, 0.25, 0.75)
                        if all(abs(value * f - m) > 0.06 * top for m in marks)
                    ),
                    value / 2,
                )
                axis.text(
                    position, height if inside else value, f"{value:.2f}", ha="center",
                    va="center" if inside else "bottom", fontsize=8,
                    color="white" if inside else "black", fontweight="bold" if inside else None,
                    zorder=5, bbox={"facecolor": _COLORS[kind] if inside else "white",
                                    "edgecolor": "none", "pad": 1},
                )  # fmt: skip
            if r["bound"] is not None:
                axis.hlines(r["bound"] / scale, x - 0.42, x + 0.42, colors="k", linestyles="--")
            if r["published_total"] is not None:
                axis.plot(
                    [x - 0.2], [r["published_total"] / scale], "*", color="red", ms=11, zorder=6
                )
        labels = [textwrap.fill(r["program"], 13) for r in mine]
        axis.set_xticks(range(len(mine)), labels, fontsize=9)
        axis.tick_params(axis="y", labelsize=9)
        axis.set_xlim(-0.6, len(mine) - 0.4)
        axis.set_title(_TARGET_TITLES.get(target, target), fontsize=11)
        axis.set_ylabel(f"device memory of one step ({scale_name})", fontsize=10)
        axis.set_xlabel("program", fontsize=10)
        note = " ".join(
            n for n in (CPU_NOTE if target == "cpu" else None, notes and notes(target)) if n
        )
        # Room above the tallest bar for its value and the note.
        axis.set_ylim(0, top * (1.5 if note else 1.15))
        if note:
            axis.text(
                0.03, 0.97, textwrap.fill(note, 58), transform=axis.transAxes, va="top",
                fontsize=8, bbox={"boxstyle": "round", "facecolor": "lightyellow", "alpha": 0.9},
            )  # fmt: skip
    # A legend entry only for what some panel draws: no star without the h100 panel (the
    # `cuda` extra), no blue bar where the tutorial has no program.
    entries = [
        (
            any(r["tutorial"] for r in rows),
            Patch(color=_COLORS["tutorial"], label="the tutorial's hand-written code"),
        ),
        (any(r["offload_eqx"] for r in rows), Patch(color=_COLORS["ox"], label="offload_eqx")),
        (
            any(r["bound"] is not None for r in rows),
            Line2D([], [], color="k", ls="--", label="analytic lower bound"),
        ),
        (
            any(r["published_total"] is not None for r in rows),
            Line2D(
                [], [], color="red", marker="*", ms=11, ls="", label="published (tutorial, GPU)"
            ),
        ),
    ]
    handles = [handle for drawn, handle in entries if drawn]
    if handles:
        figure.legend(handles=handles, loc="outside lower center", ncols=len(handles), fontsize=10)
    figure.suptitle(
        f"{workload} offloading: device memory of one step "
        "(temp + argument + output - alias; numbers on the bars)",
        fontsize=12,
    )
    figure.savefig(path, dpi=110)
    plt.close(figure)
