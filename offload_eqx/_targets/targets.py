"""Compile targets: this machine's CPU, or a GPU/TPU compiled for without the hardware.

The real XLA:GPU and XLA:TPU compilers run on a machine without the accelerator
("deviceless" compile): `jax.experimental.topologies` gives compile-only devices, and a
program traced on them compiles exactly as it would for the real chip, so its
`memory_analysis()` is the chip's. They come from optional extras:

    pip install 'offload_eqx[cuda]'   # jax-cuda12-plugin, jax-cuda12-pjrt: h100, a100, ...
    pip install 'offload_eqx[tpu]'    # libtpu: tpu-v5p, tpu-v5e, tpu-v6e, ...

No driver is needed, nor `ptxas`: a deviceless compile stops before machine code (measured:
the same memory analysis with and without `nvidia-cuda-nvcc-cu12`). `JAX_PLATFORMS=cpu` must
be set before jax is imported, or the CUDA plugin looks for a driver.

A GPU target is described by an XLA `GpuTargetConfig` text proto shipped in
`offload_eqx/targets/` (public figures of the chip). To add one, add a file there and a
`Target` to `TARGETS`, or call `register_target(Target(...))` from your own code.
"""

import dataclasses
import pathlib
import re
from typing import Literal, get_args

import numpy as np

from .matmul_efficiency import H100_MATMUL
from .speeds import Speeds

Platform = Literal["cpu", "cuda", "tpu"]

_TARGET_DIR = pathlib.Path(__file__).parent / "configs"

_EXTRAS: dict[str, tuple[str, str]] = {
    # platform: (module that the extra installs, extra name)
    "cuda": ("jax_plugins.xla_cuda12", "cuda"),
    "tpu": ("libtpu", "tpu"),
}

_UNKNOWN_TARGET = (
    "Unknown target {target!r}; expected one of {known}. Targets are described in "
    "`ox.TARGETS`; add your own with `register_target(Target(...))`."
)


@dataclasses.dataclass(frozen=True)
class Target:
    """A compile target.

    - `name`: what `ox.memory_report(..., target=name)` takes.
    - `platform`: `"cpu"` (this machine), `"cuda"` (XLA:GPU) or `"tpu"` (XLA:TPU).
    - `topology`: for `"cuda"`, `"<slices>x<hosts>x<gpus per host>"` (`"1x1x8"` is one
        host with 8 GPUs); for `"tpu"`, libtpu's topology name (`"v5p:2x2x1"`).
    - `config`: for `"cuda"`, the file in `offload_eqx/targets/` holding the
        `GpuTargetConfig` text proto, or an absolute path.
    - `chips_per_host`: for `"tpu"`, the chips per host when fewer than the default
        (a single-chip topology).
    - `description`: one line for listings.
    - `capacity`: bytes of memory of one device (HBM), the published figure; memory
        reports say whether a program fits in it. None: unknown (this machine's CPU).
    - `speeds`: the `Speeds` that `ox.estimate` prices a step with. None for this
        machine's CPU, whose speeds are measured when first asked for (`ox.estimate(...,
        target="cpu")` calibrates).
    """

    name: str
    platform: str  # a `Platform`, checked with a message when the target is made
    topology: str = ""
    config: str | None = None
    chips_per_host: tuple[int, ...] | None = None
    description: str = ""
    capacity: int | None = None
    speeds: Speeds | None = None

    def __post_init__(self) -> None:
        _check_target(self)

    @property
    def deviceless(self) -> bool:
        return self.platform != "cpu"

    @property
    def extra(self) -> str | None:
        return _EXTRAS[self.platform][1] if self.platform in _EXTRAS else None


def _check_target(target: "Target") -> None:
    """`ValueError` for a target that cannot compile: checked where it is made, not when
    a compile goes through another compiler's default."""
    where = f"ox.Target({target.name!r}, {target.platform!r}, ...)"
    if not isinstance(target.name, str) or not target.name:
        raise ValueError(f"ox.Target(name={target.name!r}): a target needs a non-empty name.")
    if target.platform not in get_args(Platform):
        raise ValueError(
            f"{where}: unknown platform {target.platform!r}; expected one of "
            f"{', '.join(map(repr, get_args(Platform)))} ('cuda' compiles with XLA:GPU "
            "for an NVIDIA GPU, 'tpu' with XLA:TPU, 'cpu' on this machine)."
        )
    if target.platform == "cuda" and not re.fullmatch(r"\d+x\d+x\d+", target.topology):
        raise ValueError(
            f"{where}: topology {target.topology!r}; a GPU topology is "
            "'<slices>x<hosts>x<gpus per host>', e.g. '1x1x8' for one host with 8 GPUs."
        )
    if target.platform == "tpu" and not target.topology:
        raise ValueError(f"{where}: a TPU target needs libtpu's topology name, e.g. 'v5p:2x2x1'.")
    if target.capacity is not None and not (
        isinstance(target.capacity, (int, np.integer)) and target.capacity > 0
    ):
        raise ValueError(
            f"{where}: capacity={target.capacity!r}; expected the device's memory in bytes "
            "(an integer > 0, e.g. 80 * 2**30), or None when unknown."
        )
    if target.speeds is not None and not isinstance(target.speeds, Speeds):
        raise ValueError(f"{where}: speeds={target.speeds!r}; expected an `ox.Speeds` or None.")


def _gpu_capacity(config: str) -> int:
    """`device_memory_size` of a shipped `GpuTargetConfig`: one figure for both the
    compiler and the reports."""
    text = (_TARGET_DIR / config).read_text()
    match = re.search(r"^\s*device_memory_size:\s*(\d+)", text, flags=re.MULTILINE)
    if match is None:
        raise ValueError(f"offload_eqx/_targets/configs/{config} has no `device_memory_size`.")
    return int(match.group(1))


# HBM per chip as Google Cloud's TPU pages publish it ("95GB", "16 GB", "32 GB"; v5p:
# cloud.google.com/tpu/docs/v5p, v5e: .../v5e, v6e: .../v6e), read as 10^9 bytes: the
# smaller reading, so a program reported to fit does.
_V5P_HBM = 95 * 10**9
_V5E_HBM = 16 * 10**9
_V6E_HBM = 32 * 10**9
# The GPU figures are the `device_memory_size` of their target files: the memory CUDA
# reports for an H100 80GB SXM5 (84,978,434,048 B, 79.1 GiB) and 80 GiB for the A100.
_H100_HBM = _gpu_capacity("h100.txtpb")
_A100_HBM = _gpu_capacity("a100.txtpb")
_GH200_HBM = _gpu_capacity("gh200.txtpb")

_G = 1e9
_T = 1e12
# The bytes/s one host thread streams while it updates optimizer state (reading and
# writing several arrays): an assumption, 20 GB/s, until a GPU machine's host measures
# it (`benchmarks/gpu_check.py`, part 7; `ox.calibrate_host`). Little's law bounds it: a
# server core keeps about 48 cache misses of 64 B in flight over ~120 ns of DDR5 latency
# (~25 GB/s); this machine's core streams 10-14. With a DGX's 14 cores per GPU it does not
# bind (14 x 20 > 77 GB/s): the host's bandwidth share does; on a host with few cores it
# does.
_HOST_THREAD = 20 * _G
# NVIDIA H100 SXM5: 989 TFLOP/s dense BF16 and 3.35 TB/s HBM3 (NVIDIA H100 datasheet; the
# 1,979 TFLOP/s there is with sparsity). Host link PCIe Gen5 x16 as NVIDIA's nvbandwidth
# measures it: about 35 GB/s host-to-device, 53 GB/s device-to-host. Host: a DGX H100
# (NVIDIA DGX H100 datasheet: 2 TB memory, 2x Xeon Platinum 8480C, 112 cores) shared by 8
# GPUs: 14 cores at 2.0 GHz x 64 FP32 FLOP/cycle (2 AVX-512 FMA units) = 1.8 TFLOP/s, and
# 2 sockets x 8 channels of DDR5-4800 (614 GB/s) / 8 = 77 GB/s. Matmuls: by their shape
# (`matmul_efficiency.H100_MATMUL`: tile and wave quantization over 132 SMs, 0.73 of peak
# for a large GEMM as measured on an H100); `efficiency`, the ~50% MFU that tuned LLM
# training reports on H100s, is what `with_speeds(efficiency=...)` replaces it with and
# what prices the matmuls without a shape (convolutions, Pallas kernels).
_H100_SPEEDS = Speeds(
    flops=989 * _T,
    efficiency=0.5,
    memory_bandwidth=3350 * _G,
    h2d_bandwidth=35 * _G,
    d2h_bandwidth=53 * _G,
    host_flops=1.8 * _T,
    host_bandwidth=77 * _G,
    host_memory=2 * 10**12 // 8,
    source="NVIDIA H100 SXM5 and DGX H100 datasheets; PCIe Gen5 x16 by nvbandwidth",
    # Measured on an H100 80GB HBM3 (2026-11-26, jax 0.11.2, a jax.profiler trace of
    # benchmarks/step_time.py's steps): kernels whose roofline time is under 0.2 us ran
    # 1.43 us on average (median 1.25 us), back to back inside CUDA graphs.
    kernel_launch=1.4e-6,
    # NVLink 4: 900 GB/s per GPU both ways together (H100 datasheet), 450 GB/s each way.
    interconnect_bandwidth=450 * _G,
    # XLA:GPU runs a host computation (the optimizer update on the host) as a task of a
    # per-GPU pool, its XLA:CPU (NanoRt) loops split over an intra-op pool of the
    # machine's cores (XLA's host_execute_thunk.cc, host_offloading_nanort_executable.cc):
    # a DGX H100's 112 cores shared by 8 GPUs, 14 each, at _HOST_THREAD apiece.
    host_threads=14,
    host_thread_bandwidth=_HOST_THREAD,
    matmul_efficiency=H100_MATMUL,
)
# NVIDIA GH200 Grace Hopper Superchip (NVIDIA GH200 datasheet), 96GB HBM3 version: its
# H100 GPU (989 TFLOP/s dense BF16) with 4 TB/s HBM3, and the Grace CPU beside it over
# NVLink-C2C, 900 GB/s both ways together: 450 GB/s each way, where a PCIe Gen5 x16 H100
# gets 35/53. Grace: 72 Arm Neoverse V2 cores and up to 480 GB of LPDDR5X at up to
# 512 GB/s, all of it this GPU's; FP32 7.1 TFLOP/s (the Grace CPU Superchip datasheet's
# 7.1 TFLOP/s FP64 for 144 cores, halved for 72, doubled for FP32). Kernel launch as
# measured on the H100; interconnect NVLink 4, and matmuls by shape, as the H100 (the
# same GPU: 132 SMs at the same 989 TFLOP/s).
_GH200_SPEEDS = dataclasses.replace(
    _H100_SPEEDS,
    memory_bandwidth=4000 * _G,
    h2d_bandwidth=450 * _G,
    d2h_bandwidth=450 * _G,
    host_flops=7.1 * _T,
    host_bandwidth=512 * _G,
    host_memory=480 * 10**9,
    source="NVIDIA GH200 and Grace CPU Superchip datasheets; kernel launch measured on an H100",
    host_threads=72,  # Grace's 72 cores are this GPU's alone (per thread as assumed above)
)
# NVIDIA A100 80GB SXM: 312 TFLOP/s dense BF16, 2,039 GB/s HBM2e (A100 datasheet). PCIe Gen4
# x16: about 25 GB/s each way (half of Gen5). Host: a DGX A100 (2 TB, 2x EPYC 7742, 128
# cores) shared by 8 GPUs: 16 cores x 2.25 GHz x 32 FP32 FLOP/cycle = 1.15 TFLOP/s; 2 x 8
# channels of DDR4-3200 (410 GB/s) / 8 = 51 GB/s. Efficiency: assumed, as for the H100;
# no table by shape (`matmul_efficiency`): no A100 measurement of a large GEMM's fraction
# of peak is at hand to anchor one, so every matmul is at the constant.
_A100_SPEEDS = Speeds(
    flops=312 * _T,
    efficiency=0.5,
    memory_bandwidth=2039 * _G,
    h2d_bandwidth=25 * _G,
    d2h_bandwidth=25 * _G,
    host_flops=1.15 * _T,
    host_bandwidth=51 * _G,
    host_memory=2 * 10**12 // 8,
    source="NVIDIA A100 and DGX A100 datasheets; PCIe Gen4 x16 assumed at 25 GB/s",
    interconnect_bandwidth=300 * _G,  # NVLink 3: 600 GB/s both ways (A100 datasheet)
    host_threads=16,  # a DGX A100's 128 cores shared by 8 GPUs, as on the H100
    host_thread_bandwidth=_HOST_THREAD,
)
# TPU v5p: 459 TFLOP/s BF16, 2,765 GB/s HBM2e (cloud.google.com/tpu/docs/v5p). Its host
# link is not published: assumed 32 GB/s each way (PCIe Gen4 x16 class). Host: a
# ct5p-hightpu-4t VM (208 vCPUs, 448 GB, 4 chips): 26 cores x 2.0 GHz x 64 FP32 FLOP/cycle
# = 3.3 TFLOP/s and 112 GB per chip; memory bandwidth 2 x 8 channels DDR5-4800 / 4 = 154
# GB/s. Efficiency: assumed 0.55, the MFU MaxText reports for dense LLMs on v5p, for every
# matmul: Google publishes no MXU utilisation by matmul shape that a table could hold
# (none found), so the TPUs keep the constant (`matmul_efficiency` None).
_V5P_SPEEDS = Speeds(
    flops=459 * _T,
    efficiency=0.55,
    memory_bandwidth=2765 * _G,
    h2d_bandwidth=32 * _G,
    d2h_bandwidth=32 * _G,
    host_flops=3.3 * _T,
    host_bandwidth=154 * _G,
    host_memory=448 * 10**9 // 4,
    source="Google Cloud TPU v5p page; ct5p-hightpu-4t VM; host link assumed",
    # ICI: 4,800 Gbps per chip (the v5p page) over the 6 links of its 3D torus; a ring
    # along one axis uses 2 of them: 200 GB/s.
    interconnect_bandwidth=200 * _G,
)
# TPU v5e: 197 TFLOP/s BF16, 819 GB/s HBM2 (cloud.google.com/tpu/docs/v5e); host
# ct5lp-hightpu-1t (24 vCPUs, 48 GB). v6e: 918 TFLOP/s BF16, 1,640 GB/s
# (cloud.google.com/tpu/docs/v6e); host ct6e-standard-1t (44 vCPUs, 176 GB). Host links
# not published: assumed 16 GB/s each way. Host FLOP/s: vCPUs/2 cores x 2.0 GHz x 64.
_V5E_SPEEDS = Speeds(
    flops=197 * _T,
    efficiency=0.55,
    memory_bandwidth=819 * _G,
    h2d_bandwidth=16 * _G,
    d2h_bandwidth=16 * _G,
    host_flops=1.5 * _T,
    host_bandwidth=50 * _G,
    host_memory=48 * 10**9,
    source="Google Cloud TPU v5e page; ct5lp-hightpu-1t VM; host link assumed",
    interconnect_bandwidth=100 * _G,  # ICI 1,600 Gbps over 4 links (2D torus); 2 per ring
)
_V6E_SPEEDS = Speeds(
    flops=918 * _T,
    efficiency=0.55,
    memory_bandwidth=1640 * _G,
    h2d_bandwidth=16 * _G,
    d2h_bandwidth=16 * _G,
    host_flops=2.8 * _T,
    host_bandwidth=77 * _G,
    host_memory=176 * 10**9,
    source="Google Cloud TPU v6e page; ct6e-standard-1t VM; host link assumed",
    interconnect_bandwidth=224 * _G,  # ICI 3,584 Gbps over 4 links (2D torus); 2 per ring
)

TARGETS: dict[str, Target] = {
    t.name: t
    for t in (
        Target("cpu", "cpu", description="this machine's CPU (offloading is only a type here)"),
        Target(
            "h100",
            "cuda",
            "1x1x1",
            "h100.txtpb",
            description="one NVIDIA H100 80GB SXM",
            capacity=_H100_HBM,
            speeds=_H100_SPEEDS,
        ),
        Target(
            "h100-8",
            "cuda",
            "1x1x8",
            "h100.txtpb",
            description="8 NVIDIA H100 80GB, one host",
            capacity=_H100_HBM,
            speeds=_H100_SPEEDS,
        ),
        Target(
            "gh200",
            "cuda",
            "1x1x1",
            "gh200.txtpb",
            description="one NVIDIA GH200 Grace Hopper Superchip (96GB HBM3, NVLink-C2C)",
            capacity=_GH200_HBM,
            speeds=_GH200_SPEEDS,
        ),
        Target(
            "a100",
            "cuda",
            "1x1x1",
            "a100.txtpb",
            description="one NVIDIA A100 80GB SXM",
            capacity=_A100_HBM,
            speeds=_A100_SPEEDS,
        ),
        Target(
            "tpu-v5p",
            "tpu",
            "v5p:1x1x1",
            chips_per_host=(1, 1, 1),
            description="one TPU v5p",
            capacity=_V5P_HBM,
            speeds=_V5P_SPEEDS,
        ),
        Target(
            "tpu-v5p-4",
            "tpu",
            "v5p:2x2x1",
            description="4 TPU v5p chips (one host)",
            capacity=_V5P_HBM,
            speeds=_V5P_SPEEDS,
        ),
        Target(
            "tpu-v5e",
            "tpu",
            "v5e:1x1",
            chips_per_host=(1, 1, 1),
            description="one TPU v5e",
            capacity=_V5E_HBM,
            speeds=_V5E_SPEEDS,
        ),
        Target(
            "tpu-v6e",
            "tpu",
            "v6e:1x1",
            chips_per_host=(1, 1, 1),
            description="one TPU v6e",
            capacity=_V6E_HBM,
            speeds=_V6E_SPEEDS,
        ),
    )
}
"""The compile targets by name: `cpu` (this machine), `h100`, `h100-8`, `gh200`, `a100`,
`tpu-v5p`, `tpu-v5p-4`, `tpu-v5e`, `tpu-v6e`. Each is an `ox.Target` with its device
memory (`capacity`) and the `ox.Speeds` that `ox.estimate` prices a step with;
`ox.register_target` adds one."""


def register_target(target: Target) -> Target:
    """Make `target` available by name to `ox.memory_report`, `ox.compare_memory` and
    the planners (it is added to `ox.TARGETS`, replacing one of the same name).

    ```python
    ox.register_target(ox.Target("h100-2", "cuda", "1x1x2", "h100.txtpb"))
    ox.memory_report(step, model, x, target="h100-2")
    ```

    **Returns:** `target`. **Raises:** `TypeError` for anything but an `ox.Target`.
    """
    if not isinstance(target, Target):
        raise TypeError(
            f"register_target({target!r}): expected an `offload_eqx.Target`, e.g. "
            "`Target('h100-2', 'cuda', '1x1x2', 'h100.txtpb')`."
        )
    TARGETS[target.name] = target
    return target


def get_target(target: "str | Target") -> Target:
    """The `Target` called `target` (a `Target` is returned unchanged)."""
    if isinstance(target, Target):
        return target
    try:
        return TARGETS[target]
    except (KeyError, TypeError):
        known = ", ".join(repr(t) for t in TARGETS)
        raise ValueError(_UNKNOWN_TARGET.format(target=target, known=known)) from None
