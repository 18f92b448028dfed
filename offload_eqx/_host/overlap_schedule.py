"""A delayed host update spread over the whole step on XLA:GPU, by telling XLA's scheduler
how long it runs.

A delayed update (`ox.offload_optimizer(..., delay=1)`) reads only the step's inputs and
writes only its outputs, so its host computation can start before the forward pass and be
waited for after the backward pass. XLA:GPU's latency-hiding scheduler decides where the
call's start and done go, and it gives every asynchronous computation the same latency,
5,000 of its units, the cost it gives five matmuls (`GpuLatencyEstimator::
GetLatencyBetween` in xla/service/gpu/gpu_latency_hiding_scheduler.cc; a host call is an
async computation there). Scheduling bottom-up, it places the done, covers those 5,000
units with whatever comes before it (at Llama-2-13B, the gradients' copies to host
memory after the backward loop), and then places the start: the call ran after both
loops, and the device waited the whole update (13B ZeRO-Offload at batch 6 on h100:
5.48 s of host work waited for in full). Measured in its log
(`TF_CPP_VMODULE=latency_hiding_scheduler=2`: the start's "Ready time" was the done's
plus 5,000).

The scheduler takes an instruction's latency from a profile when one is given
(`xla_gpu_pgle_profile_file_or_directory_path`, a `ProfiledInstructionsProto`; for an
async pair it reads the start's cost: `ProfileGuidedLatencyEstimator::
GetLatencyBetween`), and falls back to its own estimate for everything the profile does
not name. So a step with a delayed host update is compiled twice on XLA:GPU: once to
learn the names XLA gave the delayed calls' starts (deterministic for a module and its
options), then with a profile naming only those starts, each with a latency longer than
any step (`LATENCY_US`). That latency is not a price (`ox.estimate` prices the call from
the bytes it moves); it tells the scheduler that nothing covers the call, so the start
goes as early and the done as late as the program's dependencies allow: before the
forward loop and after the backward loop, where nothing reads its results. Measured
deviceless (2026-12-08, jaxlib 0.10.2): Llama-2-13B, batch 6, parameters streamed from
host memory, q/k/v offloaded: the 4.73 s of host work hidden beside 3.80 s of compute,
5.14 s a step (compiled once: 6.01 s, of which the device waited 0.87 s for the host).

The price: the call's results that XLA places in device memory (the new bfloat16
parameters of device-resident parameters, written from float32 masters) are allocated at
the call's start, so they are live during the passes: 2 bytes a parameter more (13B with
its parameters on the device, batch 6: 86.5 GiB against 62.3). A spanning program that
needs more device memory than the device's capacity and than the first, or more host
memory than one device's share of the host and than the first (13B on a GH200, batch 4:
358 GiB against 339, within Grace's 480 GB), is not taken (the first is kept, and
`ox.memory_report` reports it), so nothing that fitted stops fitting; `ox.fit` and
`ox.max_batch` see whichever was kept.
A delayed update computed in slices (a host call per trip of a loop: `update=
"host_sliced"`, or the default for a delayed update on XLA:GPU) is left as compiled: it
runs between or after the passes by design, and spanning the scalar call it leaves in the
entry only made the host hold the gradients longer (the 70B block stack: +65 GiB).

Nothing else changes: the program computes the same values; the profile names only
instructions XLA already has. The file is written where only this process can read it
(a private temporary directory) and removed once the compile returns.
"""

import contextlib
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from .compute import OVERLAP_OPTIONS
from .remat_limit import device_bytes

PROFILE_OPTION = "xla_gpu_pgle_profile_file_or_directory_path"
# Longer than any training step (about 17 minutes, in the profile's microseconds): the
# scheduler then finds nothing that covers the call.
LATENCY_US = 1e9
# A delayed update's host computation, as its name scope reaches XLA's metadata
# (`compute.DELAYED_SCOPE`).
_DELAYED = "ox_host[delayed "
_ASYNC_START = re.compile(r"^\s*%?([\w.\-]+) = .*\b(?:async-start|custom-call-start)\(")
_ENTRY = re.compile(r"^ENTRY ", re.MULTILINE)
_SCHEDULING_NAME = re.compile(r'scheduling_name="([^"]+)"')


def entry_lines(hlo: str) -> list[str]:
    """The lines of the entry computation of a scheduled HLO module's text."""
    found = _ENTRY.search(hlo)
    if found is None:
        return []
    end = hlo.find("\n}", found.start())
    return hlo[found.start() : end if end >= 0 else None].splitlines()


def delayed_starts(hlo: str) -> list[str]:
    """The names, as XLA's scheduler saw them (`scheduling_name`), of the starts of the
    delayed host calls in the entry computation of a compiled program's text; none
    where a delayed update is computed in slices (a host call per trip of a loop, with
    at most a scalar's call left in the entry): that form runs between or after the
    passes by design, and spanning its scalar call only lengthens what the host holds."""
    names, sliced = [], False
    entry = set(entry_lines(hlo))
    for line in hlo.splitlines():
        found = _ASYNC_START.match(line)
        if found is None or _DELAYED not in line:
            continue
        if line not in entry:
            sliced = True
            continue
        scheduled = _SCHEDULING_NAME.search(line)
        names.append(scheduled.group(1) if scheduled else found.group(1))
    return [] if sliced else names


def profile_text(names: list[str]) -> str:
    """A `ProfiledInstructionsProto` in text form giving each of `names` `LATENCY_US`."""
    return "".join(f'costs {{ name: "{name}" cost_us: {LATENCY_US:.1f} }}\n' for name in names)


@contextlib.contextmanager
def profile_file(names: list[str]) -> Iterator[str]:
    """The path of a profile of `names` (`profile_text`), in a directory only this
    process's user can read, removed when the block ends."""
    directory = tempfile.mkdtemp(prefix="offload_eqx_schedule_")  # mode 0700
    try:
        path = os.path.join(directory, "delayed_host_calls.pbtxt")
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(descriptor, "w") as file:
            file.write(profile_text(names))
        yield path
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def overlapped(
    compiled: Any,
    options: Mapping[str, Any] | None,
    recompile: Callable[[dict[str, Any]], Any],
    capacity: int | None,
    host_capacity: int | None = None,
) -> Any:
    """`compiled`, or, where it is a step compiled to overlap a delayed host update
    (`options` hold `compute.OVERLAP_OPTIONS`) and has such calls outside loops, the
    same step compiled again by `recompile(options)` with a profile that makes each of
    them span the step (the module docstring). The spanning program is kept only where
    it fits as well as the first: its device memory within `capacity` (the device's
    bytes) or no more than the first's, and its host memory within `host_capacity` (the
    host memory one device may use) or no more than the first's; None: unknown, no
    limit. A step that fits is never traded for one that does not."""
    if not options or PROFILE_OPTION in options or not wants_overlap(options):
        return compiled
    names = delayed_starts(compiled.as_text() or "")
    if not names:
        return compiled
    with profile_file(names) as path:
        spanning = recompile({**options, PROFILE_OPTION: path})
    if _fits_as_well(spanning, compiled, capacity, "") and _fits_as_well(
        spanning, compiled, host_capacity, "host_"
    ):
        return spanning
    return compiled


def _fits_as_well(spanning: Any, first: Any, capacity: int | None, memory: str) -> bool:
    held = device_bytes(spanning, memory)
    return capacity is None or held <= capacity or held <= device_bytes(first, memory)


def wants_overlap(options: Mapping[str, Any]) -> bool:
    """Whether compile `options` are those of a step whose delayed host update XLA:GPU
    should overlap (`compute.OVERLAP_OPTIONS`)."""
    return all(options.get(key) == value for key, value in OVERLAP_OPTIONS.items())
