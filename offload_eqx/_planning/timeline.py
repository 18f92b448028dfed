"""A simulated step written as a timeline: Chrome trace-event JSON, the format
`jax.profiler` traces are read in (Perfetto, `chrome://tracing`, TensorBoard's trace
viewer), and a Gantt chart with matplotlib.

One track per resource, in `schedule.RESOURCES` order; each slice is one kernel, copy,
host computation or collective, named by its instruction, with its `op_name`, phase,
FLOPs and bytes as arguments. Times are microseconds from the step's start.
"""

import json
import os
from typing import Any

from .events import RESOURCES, Simulation

_PHASE_COLOURS = {"forward": "#4c72b0", "backward": "#dd8452", "update": "#55a868"}


def trace_events(simulation: Simulation, title: str) -> dict[str, Any]:
    """The trace-event document of a simulated step."""
    events: list[dict[str, Any]] = [
        {"ph": "M", "pid": 1, "name": "process_name", "args": {"name": title}},
    ]
    for tid, resource in enumerate(RESOURCES, start=1):
        events.append(
            {"ph": "M", "pid": 1, "tid": tid, "name": "thread_name", "args": {"name": resource}}
        )
        events.append(
            {
                "ph": "M",
                "pid": 1,
                "tid": tid,
                "name": "thread_sort_index",
                "args": {"sort_index": tid},
            }
        )
    tids = {resource: tid for tid, resource in enumerate(RESOURCES, start=1)}
    for event in simulation.events:
        events.append(
            {
                "ph": "X",
                "pid": 1,
                "tid": tids[event.resource],
                "name": event.name,
                "cat": event.phase,
                "ts": event.start * 1e6,
                "dur": max(event.end - event.start, 0.0) * 1e6,
                "args": {
                    "op_name": event.op_name,
                    "phase": event.phase,
                    "flops": event.flops,
                    "bytes": event.bytes,
                },
            }
        )
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {
            "step_seconds": simulation.seconds,
            "events_complete": not simulation.truncated,
            "notes": list(simulation.notes),
        },
    }


def write_timeline(simulation: Simulation, path: str, title: str) -> str:
    """Write `trace_events` to `path` (`.json`, or `.json.gz` compressed). Returns `path`."""
    document = json.dumps(trace_events(simulation, title))
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    if path.endswith(".gz"):
        import gzip

        with gzip.open(path, "wt") as f:
            f.write(document)
    else:
        with open(path, "w") as f:
            f.write(document)
    return path


def plot_timeline(simulation: Simulation, ax: Any = None, title: str = "") -> Any:
    """A Gantt chart of the simulated step on a matplotlib axis (made if not given): one
    row per busy resource, slices coloured by phase. Needs matplotlib (the
    `experiments` extra). Returns the axis."""
    import matplotlib.pyplot as plt  # pyright: ignore[reportMissingImports]  (optional: the plot only)

    if ax is None:
        _, ax = plt.subplots(figsize=(10, 2.6))
    rows = [r for r in RESOURCES if simulation.busy.get(r)]
    labelled: set[str] = set()
    for row, resource in enumerate(rows):
        spans = [
            (e.start * 1e3, (e.end - e.start) * 1e3, e.phase)
            for e in simulation.events
            if e.resource == resource
        ]
        for phase, colour in _PHASE_COLOURS.items():
            mine = [(s, d) for s, d, p in spans if p == phase]
            if mine:
                label = None if phase in labelled else phase
                labelled.add(phase)
                ax.broken_barh(mine, (row - 0.4, 0.8), facecolors=colour, label=label)
    ax.set_yticks(range(len(rows)), rows)
    ax.invert_yaxis()
    ax.set_xlabel("ms from the step's start")
    ax.set_title(title or f"simulated step: {simulation.seconds * 1e3:.3f} ms")
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize="small", frameon=False)
    return ax
