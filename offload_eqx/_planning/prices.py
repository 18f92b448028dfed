"""What one kernel and one collective take on a target: the simulator's prices
(`schedule.py` runs them in the compiled schedule's order).

- A kernel takes its roofline time, `max(FLOPs / (peak x efficiency), device bytes /
  HBM bandwidth, host bytes / link bandwidth)`, plus the target's `kernel_launch`. Its
  dots run at the efficiency their shapes reach where the target has a table
  (`matmul_efficiency`, the function the jaxpr count asks too), its other FLOPs at the
  target's `efficiency`, a fused kernel's at its own where its rule gives one; a
  kernel that transposes moves its device bytes at `transpose_bandwidth` where that is
  given, and one of offload_eqx's host kernels at the bandwidth of a host computation.
- A collective takes the ring's time over its replica group of `n` devices: all-reduce
  `2 (n-1)/n x bytes`, all-gather and reduce-scatter `(n-1)/n x` the larger side,
  all-to-all `(n-1)/n x bytes`, a permute its bytes, at `interconnect_bandwidth`.
"""

from .._targets.speeds import matmul_efficiency
from .._targets.targets import Speeds
from .hlo import Computation, Instruction, Module, nbytes
from .host_work import host_computation_bandwidth
from .kernels import Work, group_size


def kernel_seconds(s: Speeds, work: Work) -> float:
    """One kernel's time on a target of speeds `s`."""
    strided = work.transposes and s.transpose_bandwidth
    bandwidth = s.transpose_bandwidth if strided else s.memory_bandwidth
    if work.host:  # our AdamW kernel, inlined where the host is the device (XLA:CPU)
        bandwidth = host_computation_bandwidth(s)
    return s.kernel_launch + max(
        compute_seconds(s, work),
        work.device_bytes / bandwidth,
        work.host_read / s.h2d_bandwidth,
        work.host_write / s.d2h_bandwidth,
    )


def compute_seconds(s: Speeds, work: Work) -> float:
    """A kernel's FLOPs over the rate they run at: each dot's at the efficiency of its
    shape where the target has a table, the rest at the target's constant (or the
    kernel's own)."""
    if work.efficiency or s.matmul_efficiency is None or not work.matmuls:
        return work.flops / (s.flops * (work.efficiency or s.efficiency))
    shaped = sum(d.flops for d in work.matmuls)
    seconds = sum(
        d.flops / (s.flops * matmul_efficiency(s, d.m, d.n, d.k, d.dtype, d.batch))
        for d in work.matmuls
    )
    return seconds + max(work.flops - shaped, 0.0) / (s.flops * s.efficiency)


def collective_seconds(
    s: Speeds, module: Module, opcode: str, instruction: Instruction, computation: Computation
) -> float | None:
    """One collective's time; None where the target has no interconnect bandwidth."""
    n = group_size(instruction)
    if opcode == "collective-permute":
        n = 2
    out = float(nbytes(instruction.type))
    operand = float(sum(nbytes(module.operand_type(computation, o)) for o in instruction.operands))
    if n <= 1:
        return 0.0
    if not s.interconnect_bandwidth:
        return None
    factor = {"all-reduce": 2.0 * (n - 1) / n, "collective-permute": 1.0}.get(opcode, (n - 1) / n)
    return s.kernel_launch + factor * max(out, operand) / s.interconnect_bandwidth
