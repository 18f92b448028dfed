"""`Speeds`: the rates `ox.estimate` prices a step with, one set per target (the figures
themselves, with their sources, are beside the targets in `targets.py`)."""

import dataclasses
from typing import Any

import numpy as np

from .matmul_efficiency import MatmulEfficiency, canonical_dtype


@dataclasses.dataclass(frozen=True)
class Speeds:
    """The rates `ox.estimate` prices a step with, per device (figures in the table below,
    each with its source).

    - `flops`: peak dense matrix-multiply rate of the device, FLOP/s (bf16).
    - `efficiency`: the fraction of `flops` a training step's matmuls reach (an
        assumption: the MFU that well-tuned LLM training reports on the chip), where
        `matmul_efficiency` is None; with a table, the rate of the matmuls it has no
        shape for (convolutions, Pallas kernels).
    - `matmul_efficiency`: an `ox.MatmulEfficiency`, the fraction of `flops` each
        matmul reaches from its shape (M, N, K, dtype); None: `efficiency` for every
        matmul. `StepEstimate.with_speeds(efficiency=...)` sets it to None, so that a
        constant given by hand prices every matmul (`Speeds.replace`).
    - `memory_bandwidth`: device memory (HBM) bandwidth, bytes/s.
    - `h2d_bandwidth`, `d2h_bandwidth`: the host link, host-to-device and
        device-to-host, bytes/s (the two directions run at once).
    - `host_flops`, `host_bandwidth`: the host CPU cores and memory bandwidth that serve
        one device (the machine's figures divided by its devices), for host-side compute.
    - `host_memory`: host memory per device, bytes (the machine's divided by its devices).
    - `host_threads`, `host_thread_bandwidth`: the threads one host computation runs on
        (XLA:GPU: the machine's cores shared by its GPUs) and the bytes/s one streams
        from host memory; a host computation is priced at `host_threads *
        host_thread_bandwidth`, at most `host_bandwidth`. 0: at `host_bandwidth`.
    - `kernel_launch`: seconds every kernel takes beyond its roofline time (launch and
        ramp; on a CPU, XLA's dispatch of one instruction). 0: not priced.
    - `interconnect_bandwidth`: bytes/s one device sends to its peers in a collective
        (a ring's per-link rate). 0: collectives are not priced.
    - `first_touch_bandwidth`: bytes/s at which a step's temporary buffer is first
        written when the runtime allocates it afresh for every execution (XLA:CPU: each
        page faulted in from the operating system). 0: not priced (a GPU's or TPU's
        allocator keeps its memory).
    - `transpose_bandwidth`: bytes/s a kernel that transposes moves (its reads or writes
        strided; XLA:CPU's loop fusions). 0: at `memory_bandwidth` (a GPU's tiled
        transposes run near it).
    - `source`: where the figures come from, one line.

    The jaxpr count (`ox.estimate(..., compile=False)`) uses the first eight and
    `matmul_efficiency`; the compiled-program simulation all of them.
    """

    flops: float
    efficiency: float
    memory_bandwidth: float
    h2d_bandwidth: float
    d2h_bandwidth: float
    host_flops: float
    host_bandwidth: float
    host_memory: int
    source: str = ""
    kernel_launch: float = 0.0
    interconnect_bandwidth: float = 0.0
    first_touch_bandwidth: float = 0.0
    transpose_bandwidth: float = 0.0
    host_threads: int = 0
    host_thread_bandwidth: float = 0.0
    matmul_efficiency: MatmulEfficiency | None = None

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.name == "source":
                continue
            if field.name == "matmul_efficiency":
                if value is not None and not isinstance(value, MatmulEfficiency):
                    raise ValueError(
                        f"ox.Speeds(matmul_efficiency={value!r}): expected an "
                        "`ox.MatmulEfficiency` (the fraction of peak by a matmul's shape) "
                        "or None (every matmul at `efficiency`)."
                    )
                continue
            if field.name == "host_threads" and not _whole(value):
                raise ValueError(
                    f"ox.Speeds(host_threads={value!r}): expected a whole number of "
                    "threads (0: a host computation priced at `host_bandwidth`); a "
                    "computation runs on whole threads, `ox.calibrate_host` counts them."
                )
            if field.name in _MAY_BE_ZERO and _positive_or_zero(value):
                continue
            if not positive(value) or (field.name == "efficiency" and value > 1):
                allowed = "a fraction in (0, 1]" if field.name == "efficiency" else "a number > 0"
                raise ValueError(
                    f"ox.Speeds({field.name}={value!r}): expected {allowed}"
                    f"{' of bytes' if field.name == 'host_memory' else ''}. Each rate "
                    "divides a step's work, so a zero, negative or missing one cannot "
                    "price it; take the chip's published figure (see `ox.TARGETS`' own)."
                )

    def replace(self, **changes: Any) -> "Speeds":
        """These speeds with `changes`; setting `efficiency` without `matmul_efficiency`
        prices every matmul at that constant (the table is dropped), so that a figure
        given by hand, `efficiency=0.5`, means what it says."""
        if "efficiency" in changes:
            changes.setdefault("matmul_efficiency", None)
        return dataclasses.replace(self, **changes)


def matmul_efficiency(
    speeds: Speeds, m: int, n: int, k: int, dtype: object, batch: int = 1
) -> float:
    """The fraction of `speeds.flops` an (`m` x `k`) by (`k` x `n`) matmul of `dtype`
    inputs reaches (`batch` of them in one kernel): by `speeds.matmul_efficiency` where
    there is a table, else `speeds.efficiency`. Both of `ox.estimate`'s pricers (the
    jaxpr count and the compiled simulation) ask this one function."""
    table = speeds.matmul_efficiency
    if table is None or min(m, n, k, batch) <= 0:
        return speeds.efficiency
    return table(m, n, k, canonical_dtype(dtype), batch)


_MAY_BE_ZERO = (
    "kernel_launch",
    "interconnect_bandwidth",
    "first_touch_bandwidth",
    "transpose_bandwidth",
    "host_threads",
    "host_thread_bandwidth",
)


def _whole(value: object) -> bool:
    """A whole number >= 0 (an int or a NumPy integer, not a bool)."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool) and bool(value >= 0)


def _positive_or_zero(value: object) -> bool:
    return positive(value) or (
        isinstance(value, (int, float)) and not isinstance(value, bool) and value == 0
    )


def positive(value: object) -> bool:
    """A finite real number above zero (not a bool)."""
    return (
        isinstance(value, (int, float, np.integer, np.floating))
        and not isinstance(value, bool)
        and bool(np.isfinite(value))
        and bool(value > 0)
    )
