"""A plan as a table: each leaf's path, shape, bytes and memory, and the activations."""

from typing import Any

from .._base.table import format_bytes, format_table
from .._declare.strategy import STRATEGIES


def format_plan(plan: Any) -> str:
    header = ("path", "shape", "dtype", "bytes", "memory", "declared")
    rows = [
        (
            leaf.path,
            "x".join(map(str, leaf.shape)) or "()",
            str(leaf.dtype),
            format_bytes(leaf.nbytes),
            leaf.memory or "(as given)",
            leaf.declared or "-",
        )
        for leaf in plan.leaves
    ]
    lines = [f"Plan (strategy {plan.strategy.name!r})", format_table(header, rows)]
    if plan.strategy.name not in STRATEGIES:  # composed: say what it does
        lines.insert(1, f"strategy: {plan.strategy.describe()}")
    totals: dict[str, int] = {}
    for leaf in plan.leaves:
        key = leaf.memory or "(as given)"
        totals[key] = totals.get(key, 0) + leaf.nbytes
    lines.append(
        "totals: " + ", ".join(f"{k} {format_bytes(v)}" for k, v in sorted(totals.items()))
    )
    if plan.activations:
        rest = "saved" if plan.saves_everything else "recomputed"
        lines.append(
            "activations: "
            + ", ".join(f"{n}={p}" for n, p in sorted(plan.activations.items()))
            + f" (everything else in a region: {rest})"
        )
    return "\n".join(lines)
