"""`gpu_check.py`'s results as markdown: one table per part, the verdict first."""

from typing import Any

from _gpu_check_matmuls import markdown as matmul_lines
from _gpu_check_parts import equivalence_lines


def _table(header: tuple[str, ...], rows: list[tuple]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.2f}"


def _gib(count: int | None) -> str:
    return "-" if count is None else f"{count / 2**30:.3f}"


def _equivalence(part: dict) -> list[str]:
    rows = [
        (
            r["workload"],
            r["strategy"],
            "skipped"
            if r.get("skipped")
            else ("PASS" if r["passed"] else "FAIL: " + r.get("error", "see below")),
            "-" if "max_difference" not in r else f"{r['max_difference']:.2e}",
            r.get("worst_leaf", "-") or "-",
            "-" if "leaves" not in r else f"{r['host_leaves']} of {r['leaves']}",
        )
        for r in part["rows"]
    ]
    header = ("workload", "strategy", "result", "max rel. difference", "at", "host leaves")
    return [*equivalence_lines(part), "", *_table(header, rows)]


def _timing(part: dict, memory: dict) -> list[str]:
    peaks = {(r["workload"], r["strategy"]): r for r in memory["rows"]}
    rows = []
    for r in part["rows"]:
        if r.get("skipped") or "error" in r:
            status = "skipped" if r.get("skipped") else r["error"]
            rows.append((r["workload"], r["strategy"], status, "", "", "", "", ""))
            continue
        peak = peaks[(r["workload"], r["strategy"])]
        measured = "hidden" if peak["hidden"] else _gib(peak["measured_peak_bytes"])
        ratio = r.get("ratio")
        rows.append(
            (
                r["workload"],
                r["strategy"],
                _ms(r.get("predicted_seconds")),
                _ms(r["median_seconds"]),
                "-" if ratio is None else f"{ratio:.2f}",
                _gib(r.get("predicted_device_bytes")),
                measured,
                f"{r['first_two_calls_seconds']:.1f} + {r['estimate_seconds']:.1f}",
            )
        )
    header = (
        "workload", "strategy", "predicted ms", "measured ms", "predicted/measured",
        "compiled GiB", "peak GiB", "s (calls + estimate)",
    )  # fmt: skip
    target = f"Target {part['target']!r}; median of {part['batches']} batches of "
    method = f"{part['calls_per_batch']} calls. Memory: {memory['method']}"
    return [target + method, "", *_table(header, rows)]


def _fit(part: dict) -> list[str]:
    if part.get("skipped"):
        return ["skipped for time"]
    if "error" in part:
        return [f"ox.fit failed: {part['error']}"]
    rows = [
        (
            r["label"],
            r["status"],
            _ms(r["simulated_seconds"]),
            _ms(r.get("median_seconds")),
            _gib(r["device_bytes"]),
        )
        for r in part["rows"]
    ]
    tau = part["kendall_tau"]
    ratio = part["chosen_over_fastest"]
    return [
        f"{part['workload']}, device budget {_gib(part['budget_bytes'])} GiB: chose "
        f"{part['chosen']} ({part['compiles']} compiles, {part['fit_seconds']:.1f} s). "
        f"Kendall's tau (simulated vs measured): {'-' if tau is None else f'{tau:.2f}'}; "
        f"chosen is the fastest measured: {part['chosen_is_fastest']}"
        + ("" if ratio is None else f" (chosen / fastest {ratio:.2f})"),
        "",
        *_table(("plan", "status", "simulated ms", "measured ms", "compiled GiB"), rows),
    ]


def _link(part: dict) -> list[str]:
    rows = [
        (
            f"{r['bytes'] / 2**10:.0f}",
            f"{r['h2d_seconds'] * 1e6:.1f}",
            f"{r['h2d_gb_per_s']:.2f}",
            f"{r['d2h_seconds'] * 1e6:.1f}",
            f"{r['d2h_gb_per_s']:.2f}",
        )
        for r in part["rows"]
    ]
    header = ("KiB", "host-to-device us", "GB/s", "device-to-host us", "GB/s")
    return [f"Median of {part['repeats']} copies each.", "", *_table(header, rows)]


def _kernels(part: dict) -> list[str]:
    shape = " x ".join(map(str, part["shape"]))
    spaces = ", ".join(f"{name}: {size:,} B" for name, size in part["workspaces"]) or "none"
    rows = [
        ("temp GiB", _gib(part["temp_bytes"]), _gib(part["predicted_temp_bytes"])),
        ("step ms", _ms(part["median_seconds"]), _ms(part["predicted_seconds"])),
    ]
    header = ("", "measured (this device)", f"compiled for {part['target']} without it")
    return [
        f"Causal attention, forward and backward, q/k/v {shape} (`{part['implementation']}`).",
        f"Workspaces the GPU compile gave cuDNN's kernels: {spaces}.",
        *(f"Deviceless report: {note}" for note in part["report_notes"]),
        "",
        *_table(header, rows),
    ]


def _host(part: dict) -> list[str]:
    rows = [
        ("step ms", _ms(part["median_seconds"])),
        ("parameters per second", f"{part['parameters_per_second']:.3g}"),
        ("threads busy", f"{part['threads_busy']:.2f} of {part['cores']} cores"),
        ("one host thread GB/s (ox.calibrate_host)", f"{part['host_thread_GBps']:.1f}"),
        ("all cores GB/s", f"{part['host_all_cores_GBps']:.1f}"),
        (f"predicted ms ({part['target']})", _ms(part["predicted_seconds"])),
        ("predicted ms (host measured)", _ms(part["predicted_seconds_calibrated"])),
        ("kernel calls in the compiled step", str(part["kernel_calls"])),
        ("optax's operations (XLA's loops): step ms", _ms(part["optax_median_seconds"])),
        ("optax's operations: threads busy", f"{part['optax_threads_busy']:.2f}"),
        ("kernel speed-up over optax's operations", f"{part['kernel_speedup']:.2f}x"),
        ("bit for bit optax's results", "yes" if part["bit_equal_to_optax"] else "no"),
        ("largest difference from optax's results", f"{part['max_abs_difference']:.3g}"),
    ]
    kernels = "; ".join(f"{k}: {v}" for k, v in part["host_kernels"].items())
    return [
        f"AdamW, float32 masters of {part['parameters']:,} bfloat16 parameters, updated on "
        "the host.",
        f"`ox.host_kernels()`: {kernels}.",
        "",
        *_table(("", "value"), rows),
    ]


def markdown(result: dict[str, Any]) -> str:
    parts = result["parts"]
    took = ", ".join(f"{k} {v:.0f} s" for k, v in result["part_seconds"].items())
    lines = [
        f"# GPU check, {result['date']}: {result['device']} ({result['backend']}), "
        f"jax {result['versions']['jax']}",
        "",
        f"`{result['command']}`: {result['seconds']:.0f} s of {result['budget_seconds']:.0f} "
        f"({took}).",
        "",
    ]
    sections = (
        ("equivalence", "1. Equivalence", lambda: _equivalence(parts["equivalence"])),
        (
            "timing",
            "2 and 4. Predicted against measured: time and memory",
            lambda: _timing(parts["timing"], parts["memory"]),
        ),
        ("fit", "3. ox.fit against the hardware", lambda: _fit(parts["fit"])),
        ("link", "5. The link", lambda: _link(parts["link"])),
        ("kernels", "6. Fused attention: workspace and time", lambda: _kernels(parts["kernels"])),
        ("host", "7. The optimizer update on the host", lambda: _host(parts["host"])),
        (
            "matmuls",
            "8. Matmuls by shape: measured and table",
            lambda: matmul_lines(parts["matmuls"]),
        ),
    )
    for part, title, body in sections:
        if part in parts:  # `--parts` may have left it out
            lines += [f"## {title}", "", *body(), ""]
    lines.pop()
    if result["skipped"]:
        lines += ["", "## Skipped", "", *(f"- {s}" for s in result["skipped"])]
    return "\n".join(lines) + "\n"
