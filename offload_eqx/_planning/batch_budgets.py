"""What fits within both budgets of `ox.max_batch`: the device's and the host's.

With a host budget the search follows the larger of the two totals, each as a fraction of
its budget in units of 1 / `SCALE` (rounded up: a batch fits exactly when its pressure is
at most `SCALE`); the maximum of two lines bends once, which the search handles as it
handles any bend.
"""

from typing import Any

from .._base.table import format_bytes

SCALE = 2**32


def host_limit_of(target: Any, host_budget: int | None) -> int | None:
    """The host budget searched within: `host_budget`, else the target's host memory per
    device; None for this machine's CPU (its host is its device) or unknown speeds."""
    if host_budget is not None:
        return host_budget
    speeds = target.speeds if target.platform != "cpu" else None
    return getattr(speeds, "host_memory", None)


def within(host: int | None, limit: int | None) -> bool:
    """Whether `host` bytes are within the host budget `limit` (None: not checked)."""
    return limit is None or (host is not None and host <= limit)


def pressure(total: int | None, budget: int, host: int | None, limit: int | None) -> int | None:
    """What the search compares with its budget: the device total without a host budget,
    else the larger share of either budget in units of 1 / `SCALE`."""
    if total is None or limit is None:
        return total
    device = -(-total * SCALE // budget)
    if limit == 0:
        return max(device, 0 if not host else 2 * SCALE)
    return max(device, -(-(host or 0) * SCALE // limit))


def host_words(host: int | None, limit: int | None) -> str:
    """The host's part of the batch-one error, when a host budget was checked."""
    if host is None or limit is None:
        return ""
    return f"; {format_bytes(host)} ({host} bytes) in host memory, host budget {limit} bytes"


def progress_line(entry: dict[str, Any], target: str, budget: int, limit: int | None) -> str:
    """One compile of the search, in words."""
    total, host = entry["total"], entry["host_total"]
    needs = "refused (out of memory)" if total is None else format_bytes(total)
    needs += f" of {format_bytes(budget)}"
    if limit is not None and host is not None:
        needs += f", host {format_bytes(host)} of {format_bytes(limit)}"
    verdict = "fits" if entry["fits"] else "does not fit"
    return (
        f"max_batch {target}: batch {entry['batch']}: {needs}, {verdict} ({entry['seconds']:.1f} s)"
    )
