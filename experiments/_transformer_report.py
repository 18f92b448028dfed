"""The tables and the plot of `transformer_offload.py`, from the rows it measured.

`memory_table`: device and host bytes per strategy at batch 1 and the bytes the step moves
each way (`ox.audit`); `refusals`: why offload_eqx refused a step for a target;
`batch_table`: the largest batch per strategy (exact: `ox.max_batch`) and the compiles that
decided it; `loss_table`: the CPU losses per step; `plot`: both measurements as bars.
GB = 1e9 bytes.
"""

from pathlib import Path

from _batch_search import GB, capacity
from _decoder import CONFIGS, STRATEGIES
from _report import format_table, pyplot


def format_gb(n: int | None) -> str:
    return "-" if n is None else f"{n / GB:.2f}"


def memory_table(rows: list[dict]) -> str:
    header = [
        "config",
        "target",
        "strategy",
        "temp GB",
        "argument GB",
        "output GB",
        "alias GB",
        "device total GB",
        "host total GB",
        "h2d GB / step",
        "d2h GB / step",
        "compile s",
    ]
    body = []
    for r in rows:
        d = r["device"] or {}
        moved = r.get("transfers") or {}
        body.append(
            [
                r["config"],
                r["target"],
                r["strategy"],
                format_gb(d.get("temp")),
                format_gb(d.get("argument")),
                format_gb(d.get("output")),
                format_gb(d.get("alias")),
                format_gb(r["total"]) if "error" not in r else _failure(r),
                format_gb(r["host_total"]),
                format_gb(moved.get("h2d")),
                format_gb(moved.get("d2h")),
                f"{r['compile_s']:.1f}",
            ]
        )
    return format_table(header, body, markdown=True)


def refusals(rows: list[dict]) -> list[str]:
    """One line per step that offload_eqx refused to compile for its target, with why."""
    return [
        f"{r['config']} {r['target']} {r['strategy']} refused: {r['refused']}"
        for r in rows
        if r.get("refused")
    ]


def _failure(row: dict) -> str:
    if row.get("refused"):
        return "refused (see below)"
    return "refused: out of memory" if row.get("out_of_memory") else "compiler crashed"


def _best(row: dict) -> str:
    s = row["search"]
    if s["max_batch"] == 0:
        return "0 (batch 1 does not fit)"
    if s["max_batch"] is not None:
        return str(s["max_batch"])
    if row.get("refused"):
        return "- (refused)"
    if "error" in row and not row.get("out_of_memory"):
        return "- (compiler crashed)"
    # The search stopped early (a compiler failure at a larger batch, or --max-compiles):
    # what its compiles settled.
    misfit = min((p["batch"] for p in s["probes"] if not p["fits"]), default=None)
    fit = max(
        (p["batch"] for p in s["probes"] if p["fits"] and (misfit is None or p["batch"] < misfit)),
        default=0,
    )
    between = f">= {fit}" if misfit is None else f"{fit}-{misfit - 1}"
    return f"{between} (stopped)"


def batch_table(rows: list[dict]) -> str:
    header = [
        "config",
        "target",
        "capacity GB",
        "strategy",
        "max batch",
        "device GB at max",
        "compiles",
        "search s",
        "probes in order (batch: device GB, x = does not fit)",
    ]
    body = []
    for r in (r for r in rows if "search" in r):
        s = r["search"]
        probes = ", ".join(
            f"{p['batch']}: {format_gb(p['total'])}{'' if p['fits'] else ' x'}" for p in s["probes"]
        )
        body.append(
            [
                r["config"],
                r["target"],
                format_gb(capacity(r["target"])),
                r["strategy"],
                _best(r),
                format_gb(s["total_at_max"]),
                str(s["compiles"]),
                f"{s['seconds']:.0f}",
                probes,
            ]
        )
    return format_table(header, body, markdown=True)


def loss_table(cpu: dict) -> str:
    header = ["strategy", *(f"loss {i + 1}" for i in range(cpu["steps"])), "max rel diff"]
    body = [
        [name, *(f"{x:.6f}" for x in history), f"{cpu['max_rel_diff'][name]:.1e}"]
        for name, history in cpu["losses"].items()
    ]
    return format_table(header, body, markdown=True)


def _cell(row: dict | None) -> str | None:
    """What a memory cell says instead of a bar: why there is no figure (None: a figure)."""
    if row is None:
        return "not compiled"
    if row.get("refused"):
        return "refused by offload_eqx for this target"
    if "error" in row:
        return "does not fit at batch 1" if row.get("out_of_memory") else "compiler crashed"
    return None


def _batch_cell(row: dict | None) -> str | None:
    """What a largest-batch cell says instead of a bar (None: a bar of `max_batch`)."""
    if row is None or row.get("refused") or ("error" in row and "search" not in row):
        return _cell(row)
    if "search" not in row:
        return "not searched (batch 1 only)"
    found = row["search"]["max_batch"]
    if found == 0:
        return "0: batch 1 does not fit"
    return None if found is not None else f"search ended: {_best(row)}"


def plot(rows: list[dict], path: Path) -> bool:
    """Device memory and host memory at batch 1, and the largest batch, per strategy, for
    each (config, target), into `path`; False when there is nothing to plot or no matplotlib.

    Horizontal bars, one colour per (config, target), one panel per quantity (device and
    host memory side by side, never stacked); a cell without a figure says why in text
    (not compiled, not searched, refused, crashed)."""
    plt = pyplot()
    if plt is None or not rows:
        return False
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    groups = sorted(
        {(r["config"], r["target"]) for r in rows}, key=lambda g: (list(CONFIGS).index(g[0]), g[1])
    )
    # A (config, target) without a single bar (a short run compiles only a refused plan on
    # tpu-v5p) is no series: it is left out, its refusals said above the legend instead.
    without_bars = [
        g
        for g in groups
        if all(_cell(r) is not None for r in rows if (r["config"], r["target"]) == g)
    ]
    groups = [g for g in groups if g not in without_bars]
    if not groups:
        return False
    left_out = [
        f"{c} on {t}: {r['strategy']} {_cell(r)}"
        for c, t in without_bars
        for r in rows
        if (r["config"], r["target"]) == (c, t) and not str(_cell(r)).startswith("not ")
    ]
    rows = [r for r in rows if (r["config"], r["target"]) in groups]
    names = [n for n in STRATEGIES if any(r["strategy"] == n for r in rows)]
    colors = plt.get_cmap("tab10").colors
    height = 0.8 / len(groups)
    panels = [
        ("device memory at batch 1, GB (1e9 B)", lambda r: r["total"] / GB, _cell),
        ("host memory at batch 1, GB (1e9 B)", lambda r: r["host_total"] / GB, _cell),
    ]
    if any("search" in r for r in rows):  # the largest batch only when a search ran
        panels.append(
            (
                "largest batch that fits one device (sequences of 2048 tokens)",
                lambda r: r["search"]["max_batch"],
                _batch_cell,
            )
        )
    figure, axes = plt.subplots(
        1,
        len(panels),
        figsize=(5.7 * len(panels), max(3.5, 1.2 + 0.32 * len(names) * max(len(groups), 2))),
        sharey=True,
        layout="constrained",
    )
    for axis, (label, value, missing) in zip(axes, panels):
        cells = []
        for i, group in enumerate(groups):
            by_name = {r["strategy"]: r for r in rows if (r["config"], r["target"]) == group}
            for j, name in enumerate(names):
                row = by_name.get(name)
                y = j + (i - (len(groups) - 1) / 2) * height
                why = missing(row)
                cells.append((y, None if why else value(row), why, colors[i % len(colors)]))
        top = max((v for _, v, _, _ in cells if v is not None), default=1) or 1
        for y, v, why, color in cells:
            if why is not None:
                # What was not asked for in grey; what failed in red.
                quiet = why.startswith("not ")
                axis.text(
                    top * 0.01, y, why, va="center", fontsize=8, style="italic",
                    color="0.5" if quiet else "tab:red",
                )  # fmt: skip
                continue
            axis.barh(y, v, height * 0.92, color=color)
            text = f"{v:.2f}" if isinstance(v, float) else str(v)
            axis.text(v + top * 0.01, y, text, va="center", fontsize=8)
        axis.set_xlim(0, top * 1.18)
        axis.set_xlabel(label, fontsize=10)
        axis.tick_params(labelsize=9)
        axis.grid(axis="x", alpha=0.3)
    left = axes[0]
    for target in dict.fromkeys(t for _, t in groups):
        capacity_gb = capacity(target) / GB
        left.axvline(capacity_gb, color="k", ls="--", lw=1)
        left.text(
            capacity_gb, (len(names) - 1) / 2, f"{target} capacity: {capacity_gb:.0f} GB ",
            rotation=90, ha="right", va="center", fontsize=8,
        )  # fmt: skip
    left.set_xlim(0, max(left.get_xlim()[1], 1.12 * max(capacity(t) for _, t in groups) / GB))
    left.set_yticks(range(len(names)), names, fontsize=10)
    left.set_ylabel("strategy", fontsize=10)
    left.set_ylim(len(names) - 0.5, -0.5)  # the first strategy on top
    handles = [
        Patch(color=colors[i % len(colors)], label=f"{c} on {t}") for i, (c, t) in enumerate(groups)
    ]
    handles.append(Line2D([], [], color="k", ls="--", label="device capacity (one chip)"))
    legend = figure.legend(
        handles=handles,
        loc="outside lower center",
        ncols=len(handles),
        fontsize=10,
        # Above the entries, where constrained layout leaves it room.
        title=("Not drawn, no figure: " + "; ".join(left_out)) if left_out else None,
        title_fontsize=9,
    )
    legend.get_title().set_color("tab:red")
    figure.suptitle(
        "Llama-like decoder, full training step (AdamW), bf16, seq 2048: one step compiled "
        "per strategy (numbers at the bar ends)",
        fontsize=12,
    )
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return True
