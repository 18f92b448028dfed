"""The planner experiment's tables and plot (`planner.py` runs it): presets and
`ox.fit`'s plans, the re-priced comparison, the search times, the 13B headline, and
predicted step time against device memory for every candidate."""

import textwrap
from pathlib import Path

from _report import format_table, pyplot

GB = 1e9
# Host-link bandwidths (GB/s, host-to-device) the presets' compiled programs are
# simulated again at (`StepEstimate.with_speeds`).
LINKS = (4, 8, 16, 32, 64)


# -- tables -----------------------------------------------------------------------------


def _gb(n: float | None) -> str:
    return "-" if n is None else f"{n / GB:.1f}"


def _fits(row: dict) -> str:
    if row["error"]:
        return row["error"].split(":")[0]
    return {True: "yes", False: "no", None: "-"}[row["fits"]]


def preset_table(results: list[dict]) -> str:
    header = [
        "config",
        "target",
        "plan",
        "step ms",
        "count ms",
        "tokens/s",
        "MFU counted",
        "MFU 6NT",
        "moved GB",
        "device GB",
        "host GB",
        "fits",
    ]
    body = []
    for r in results:
        for row in r["presets"]:
            plan = row["plan"]
            if plan == "ox.fit":
                plan = f"ox.fit: {row['strategy']}"
            if row["seconds"] is None:  # refused before any trace
                body.append([r["config"], r["target"], plan, *["-"] * 8, _fits(row)])
                continue
            body.append(
                [
                    r["config"],
                    r["target"],
                    plan,
                    f"{row['seconds'] * 1e3:.0f}",
                    f"{row['traced_seconds'] * 1e3:.0f}",
                    f"{row['tokens_per_s']:.0f}",
                    f"{row['mfu_counted']:.1%}",
                    f"{row['mfu_6nt']:.1%}",
                    _gb(row["moved"]),
                    _gb(row["device"]),
                    _gb(row["host"]),
                    _fits(row),
                ]
            )
    return format_table(header, body, markdown=True)


def comparison_table(results: list[dict]) -> str:
    header = [
        "config",
        "target",
        "qkv vs full remat",
        "by the count",
        "fwd+bwd only",
        "no overlap",
        *(f"link {bw} GB/s" for bw in LINKS),
        "break-even link GB/s",
        "q/k/v share of FLOPs",
        "matmul share of compute",
        "update ms: streamed / whole state",
        "ox.fit vs full remat",
        "blog",
    ]
    body = []
    for r in results:
        c = r["comparison"]
        even = c["break_even_link"]
        body.append(
            [
                r["config"],
                r["target"],
                f"{c['qkv_vs_remat']:+.1%}",
                f"{c['qkv_vs_remat_traced']:+.1%}",
                f"{c['qkv_vs_remat_fwd_bwd']:+.1%}",
                f"{c['qkv_vs_remat_no_overlap']:+.1%}",
                *(f"{c['qkv_vs_remat_at_link'][str(bw)]:+.1%}" for bw in LINKS),
                "< 0.1" if even is None else f"{even:.1f}",
                f"{c['recompute_saved_share']:.1%}",
                f"{c['matmul_share']:.0%}",
                f"{c['update_streamed_s'] * 1e3:.0f} / {c['update_whole_state_s'] * 1e3:.0f}",
                "-"
                if c["fit_vs_remat"] is None
                else f"{c['fit_vs_remat']:+.1%}"
                + ("" if c["full_remat_fits"] else " (full remat does not fit)"),
                c["blog"] or "-",
            ]
        )
    return format_table(header, body, markdown=True)


def search_table(results: list[dict]) -> str:
    header = [
        "config",
        "target",
        "chosen plan",
        "fraction",
        "s",
        "traces",
        "tracing s",
        "compiles",
        "compiling s",
    ]
    body = [
        [
            r["config"],
            r["target"],
            r["chosen"] or f"none: {r['search']['error'][:60]}",
            r.get("fraction") or "-",
            f"{r['search']['seconds']:.1f}",
            r["search"]["traces"],
            f"{r['search']['trace_s']:.1f}",
            r["search"]["compiles"],
            f"{r['search']['compile_s']:.1f}",
        ]
        for r in results
    ]
    return format_table(header, body, markdown=True)


# -- plot -------------------------------------------------------------------------------


def pareto(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The points no other point beats in both memory and time, by memory."""
    front: list[tuple[float, float]] = []
    for memory, seconds in sorted(points):
        if not front or seconds < front[-1][1]:
            front.append((memory, seconds))
    return front


# How a plan that did not compile is named on the plot, from its recorded error.
def _why_not(error: str) -> str:
    if "does not support" in error:
        return "refused by offload_eqx"
    return error.split(":")[0]


def _place_labels(axis, points: list[tuple[float, float, str]], fontsize: float = 8) -> None:
    """Label each (x, y) data point with its text, choosing for each the first of a few
    offsets whose box overlaps no label placed before (an estimate of the text's size)."""
    offsets = [(8, 6), (8, -14), (-8, 6), (-8, -14), (8, 20), (8, -28), (-8, 20), (-8, -28)]
    placed: list[tuple[float, float, float, float]] = []
    scale = axis.figure.dpi / 72  # points to pixels
    for x, y, text in points:
        px, py = axis.transData.transform((x, y))
        width, height = 0.6 * fontsize * len(text) * scale, 1.3 * fontsize * scale
        for dx, dy in offsets:
            x0 = px + dx * scale - (width if dx < 0 else 0)
            box = (x0, py + dy * scale, x0 + width, py + dy * scale + height)
            if not any(
                box[0] < b[2] and b[0] < box[2] and box[1] < b[3] and b[1] < box[3] for b in placed
            ):
                break
        placed.append(box)
        axis.annotate(
            text, (x, y), xytext=(dx, dy), textcoords="offset points", fontsize=fontsize,
            ha="right" if dx < 0 else "left", va="bottom",
            arrowprops={"arrowstyle": "-", "color": "0.5", "lw": 0.6},
        )  # fmt: skip


def marks_of(r: dict) -> tuple[list[tuple[str, float, float | None]], int]:
    """What one panel draws, at one pricing (each compiled program's schedule simulated,
    as `ox.fit` ranks the plans that fit and as the presets are priced): `(kind, device
    GB, ms)` for each plan `ox.fit` compiled ("fits", "best"; "over" a budget: not
    simulated, ms None) and each preset ("preset" fits, "preset over" does not); and how
    many candidates were priced by the jaxpr count alone (not compiled: not drawn)."""
    marks: list[tuple[str, float, float | None]] = []
    hidden = 0
    for p in r["candidates"]:
        if p["compiled_by"] is None:
            hidden += 1
        elif p["compiled_by"] == "ox.fit":  # "planner": a preset's plan, drawn below
            simulated = p.get("simulated_seconds")
            kind = "over" if simulated is None else "best" if p["status"] == "best" else "fits"
            ms = None if simulated is None else simulated * 1e3
            marks.append((kind, p["device_bytes"] / GB, ms))
    for row in r["presets"]:  # a preset outside the search (host_update) is drawn too
        if row["plan"] != "ox.fit" and row["device"] is not None:
            kind = "preset" if row["fits"] else "preset over"
            marks.append((kind, row["device"] / GB, row["seconds"] * 1e3))
    return marks, hidden


def plot(results: list[dict], path: Path, batch: int) -> bool:
    """Step time against device memory, one panel per (config, target), at one pricing:
    each compiled program's schedule simulated. The candidates of `ox.fit`'s search that
    it compiled and that fit (green), those compiled over a budget (their memory, red
    ticks along the bottom: not simulated), its plan (star), the presets (green fits, red
    does not), the Pareto front of what fits, the device capacity; candidates priced
    only by the jaxpr count are counted in the panel, not drawn."""
    plt = pyplot()
    if plt is None or not results:
        return False
    from matplotlib.lines import Line2D
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    configs = list(dict.fromkeys(r["config"] for r in results))
    targets = list(dict.fromkeys(r["target"] for r in results))
    drawn: set[str] = set()  # the legend's entries: only what some panel draws
    width = max(7.5 * len(targets), 10.5)
    figure, axes = plt.subplots(
        len(configs),
        len(targets),
        figsize=(width, 5.2 * len(configs) + 1.2),
        squeeze=False,
        layout="constrained",
    )
    for r in results:
        axis = axes[configs.index(r["config"])][targets.index(r["target"])]
        chosen = f"ox.fit chose {r['chosen']}" if r["chosen"] else "ox.fit found no plan"
        missing = [
            f"{row['plan']} ({_why_not(row['error'] or 'not compiled')})"
            for row in r["presets"]
            if row["plan"] != "ox.fit" and row["device"] is None
        ]
        title = textwrap.fill(f"{r['config']} on {r['target']}: {chosen}", 80)
        if missing and r["candidates"]:
            title += "\n" + textwrap.fill("presets not compiled: " + ", ".join(missing), 80)
        axis.set_title(title, fontsize=9.5)
        if not r["candidates"]:
            # Nothing to draw: no axes, the reason and the presets' outcomes as text.
            axis.set_axis_off()
            first, *rest = (r["search"].get("error_full") or r["search"]["error"] or "-").split(
                "\n"
            )
            lines = [
                textwrap.fill(first, 100),
                *(textwrap.shorten(line, 100, placeholder=" ...") for line in rest[:12]),
                "",
                "Presets (predicted step time, compile outcome):",
                *(
                    f"  {row['plan']}: "
                    + ("-" if row["seconds"] is None else f"{row['seconds'] * 1e3:.0f} ms")
                    + ", "
                    + (_why_not(row["error"]) if row["error"] else _fits(row))
                    for row in r["presets"]
                ),
            ]
            axis.text(0.5, 0.5, "\n".join(lines), fontsize=8, transform=axis.transAxes,
                      ha="center", va="center", multialignment="left",
                      bbox={"facecolor": "0.95", "edgecolor": "0.6"})  # fmt: skip
            continue
        marks, hidden = marks_of(r)
        left = min((memory for _, memory, _ in marks), default=1.0) / 2
        xy = [(memory, ms) for kind, memory, ms in marks if kind in ("fits", "best", "preset")]
        for kind, memory, ms in marks:
            if kind == "over":  # compiled over a budget: its memory only, not simulated
                axis.plot(memory, 0.02, "|", color="tab:red", ms=12, mew=2,
                          transform=axis.get_xaxis_transform())  # fmt: skip
            elif kind == "best":
                axis.plot(memory, ms, "o", color="tab:green", ms=7, zorder=4)
                axis.plot(memory, ms, "*", color="gold", ms=18, mec="k", zorder=5)
                drawn.add("fits")
            else:
                fits = kind in ("fits", "preset")
                axis.plot(memory, ms, "o", color="tab:green" if fits else "tab:red", ms=7, zorder=4)
                kind = "fits" if fits else "too big"
            drawn.add(kind)
        if hidden:
            axis.text(0.97, 0.9, f"{hidden} candidates priced by the jaxpr count only\n"
                      "(not compiled) are not drawn", transform=axis.transAxes, ha="right",
                      va="top", fontsize=7.5, color="0.4")  # fmt: skip
        front = pareto(xy)
        if front:
            axis.step(*zip(*front), where="post", color="tab:blue", lw=1)
            drawn.add("front")
        capacity = r["capacity"] / GB
        axis.axvline(capacity, color="k", ls="--", lw=1)
        drawn.add("capacity")
        axis.text(capacity, 1.0, f" {capacity:.0f} GB", transform=axis.get_xaxis_transform(),
                  va="top", fontsize=8)  # fmt: skip
        axis.set_xscale("log")
        axis.set_xlim(left=left)
        axis.xaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        axis.xaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
        axis.xaxis.set_minor_formatter(NullFormatter())
        axis.tick_params(labelsize=9)
        axis.grid(alpha=0.3, which="major")
        axis.set_xlabel("device memory of one step, GB (1e9 B; log scale)", fontsize=9.5)
        axis.set_ylabel("step time, ms (compiled schedule simulated)", fontsize=9.5)
        _place_labels(
            axis,
            [
                (row["device"] / GB, row["seconds"] * 1e3, row["plan"])
                for row in r["presets"]
                if row["plan"] != "ox.fit" and row["device"] is not None
            ],
        )
    entries = {
        "fits": Line2D([], [], marker="o", color="tab:green", ls="", ms=7,
                       label="compiled, fits"),
        "too big": Line2D([], [], marker="o", color="tab:red", ls="", ms=7,
                          label="compiled, does not fit"),
        "over": Line2D([], [], marker="|", color="tab:red", ls="", ms=12, mew=2,
                       label="compiled, over a budget (memory only: not simulated)"),
        "best": Line2D([], [], marker="*", color="gold", mec="k", ls="", ms=14,
                       label="ox.fit's plan"),
        "front": Line2D([], [], color="tab:blue", lw=1, label="Pareto front"),
        "capacity": Line2D([], [], color="k", ls="--", lw=1, label="device capacity (one chip)"),
    }  # fmt: skip
    # A legend entry only for a kind of mark some panel draws (a smoke run compiles no plan
    # that does not fit, for one).
    handles = [handle for key, handle in entries.items() if key in drawn]
    if handles:
        figure.legend(
            handles=handles,
            loc="outside lower center",
            ncols=min(len(handles), 4 if width > 11 else 3),
            fontsize=9.5,
        )
    title = (
        f"ox.fit's candidate plans for the Llama-like decoder, {batch} x 2048 tokens per step: "
        "step time (each compiled program's schedule simulated, as ox.fit ranks the plans "
        "that fit) against device memory (presets labelled by name)"
    )
    figure.suptitle(textwrap.fill(title, int(width * 12)), fontsize=11)
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return True
