"""The same compiled program priced again: with nothing overlapped, over another host
link, and the link at which offloading breaks even with recomputation (`planner.py` and
`blog_comparison.py` use them)."""

from typing import Any

GB = 1e9


def no_overlap(phases: dict) -> float:
    """Seconds of a step with nothing overlapped: each phase takes its compute, both
    copies and its host work one after the other."""
    return sum(p["compute"] + p["h2d"] + p["d2h"] + p["host"] for p in phases.values())


def at_link(estimate: Any, bandwidth: float) -> Any:
    """The same compiled program simulated again with a host link of `bandwidth` bytes/s
    host-to-device (device-to-host scaled alike)."""
    speeds = estimate.speeds
    scale = bandwidth / speeds.h2d_bandwidth
    return estimate.with_speeds(h2d_bandwidth=bandwidth, d2h_bandwidth=speeds.d2h_bandwidth * scale)


def break_even(offloaded: Any, remat: Any) -> float | None:
    """The host-to-device bandwidth (GB/s; device-to-host scaled alike) below which
    `offloaded` is predicted slower than `remat`, its compiled program simulated at each
    bandwidth (None: faster down to 0.1 GB/s; inf: slower even at ten times the
    target's link)."""
    nominal = offloaded.speeds.h2d_bandwidth / GB

    def gain(bandwidth: float) -> float:
        return remat.seconds - at_link(offloaded, bandwidth * GB).seconds

    low, high = 0.1, 10 * nominal
    if gain(high) <= 0:
        return float("inf")  # slower even at ten times the link's bandwidth
    if gain(low) > 0:
        return None
    for _ in range(16):  # to within 2.5% of the bandwidth
        middle = (low * high) ** 0.5
        low, high = (low, middle) if gain(middle) > 0 else (middle, high)
    return high
