"""The tables and the plot of `transformer_offload.py`, from the rows it measured.

`memory_table`: device and host bytes per strategy at batch 1 and the bytes the step moves
each way (`ox.audit`); `refusals`: why offload_eqx refused a step for a target;
`batch_table`: the largest batch per strategy (exact: `ox.max_batch`) and the compiles that
decided it; `loss_table`: the CPU losses per step; `plot`: both measurements as bars.
GB = 1e9 bytes.
"""

from pathlib import Path

import numpy as np
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


def plot(rows: list[dict], path: Path) -> bool:
    """Device memory at batch 1 and the largest batch, per strategy, for each
    (config, target), into `path`; False when there is nothing to plot or no matplotlib."""
    plt = pyplot()
    if plt is None or not rows:
        return False
    groups = sorted(
        {(r["config"], r["target"]) for r in rows}, key=lambda g: (list(CONFIGS).index(g[0]), g[1])
    )
    names = list(STRATEGIES)
    width = 0.8 / len(groups)
    figure, (left, right) = plt.subplots(1, 2, figsize=(13, 4.5))
    for i, group in enumerate(groups):
        by_name = {r["strategy"]: r for r in rows if (r["config"], r["target"]) == group}
        x = np.arange(len(names)) + (i - (len(groups) - 1) / 2) * width
        device = [(by_name[n]["total"] or 0) / GB if n in by_name else 0 for n in names]
        host = [(by_name[n]["host_total"] or 0) / GB if n in by_name else 0 for n in names]
        best = [
            (by_name[n].get("search") or {}).get("max_batch") or 0 if n in by_name else 0
            for n in names
        ]
        label = f"{group[0]} {group[1]}"
        bars = left.bar(x, device, width, label=label)
        left.bar(
            x, host, width, bottom=device, color=bars[0].get_facecolor(), alpha=0.3, hatch="//"
        )
        right.bar(x, best, width, label=label)
    for axis, title in (
        (left, "device GB at batch 1 (hatched: host GB)"),
        (right, "largest batch that fits"),
    ):
        axis.set_xticks(np.arange(len(names)), names, rotation=20)
        axis.set_title(title)
        axis.legend(fontsize=8)
    figure.suptitle("Llama-like decoder, full training step (AdamW), bf16, seq 2048")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return True
