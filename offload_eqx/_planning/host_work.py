"""What a host computation moves, as XLA:CPU compiles it, and how fast the host moves it.

XLA:GPU compiles a host computation (`ox.offload_optimizer(update_on="host")`) with
XLA:CPU when the step first runs; the step's compiled text holds it unfused. XLA:CPU
fuses elementwise work into loops with one result each: every result of the computation
(Adam's new `mu`, `nu`, the new master, the parameter cast from it) is its own pass over
memory, which reads what that result is computed from and writes the result. A value
that is itself a result is read back from memory by the passes that use it (it was
written by its own loop), not recomputed; a reduction (a global norm) is one more pass
over what it reduces. So AdamW with float32 masters for bfloat16 parameters moves 42
bytes a parameter (mu 10, nu 10, master 16, parameter 6) where one fused pass would move
28; the benchmark `benchmarks/host_update.py` measures both.

The host runs it on its threads: XLA:GPU runs each host computation as a task of a
per-GPU pool (at most 8 tasks at once), and the computation's loops are split over an
intra-op pool sized by the machine's cores (`NPROC` or the cores it may use), shared by
every GPU's host computations. `Speeds.host_threads` (the threads one GPU's update gets)
times `Speeds.host_thread_bandwidth` (what one thread streams), at most the host's share
`Speeds.host_bandwidth`, is what the estimate divides by (`host_computation_bandwidth`);
`ox.calibrate_host` measures the figures on the machine itself.
"""

from .hlo import Computation, Instruction, Module, nbytes
from .kernels import parameter_read_bytes

# Operations XLA:CPU never fuses into a consumer's loop: their results are read from
# memory by whoever uses them.
_MATERIALISED = {"reduce", "dot", "convolution", "sort", "custom-call", "while", "conditional"}


def host_computation_bandwidth(speeds) -> float:
    """Bytes/s one host computation streams: `host_threads` threads at
    `host_thread_bandwidth` each (0: the host's whole `host_bandwidth`), never more than
    the host's `host_bandwidth`."""
    per_thread = getattr(speeds, "host_thread_bandwidth", 0.0) or 0.0
    threads = getattr(speeds, "host_threads", 0) or 0
    if not per_thread or not threads:
        return speeds.host_bandwidth
    return min(speeds.host_bandwidth, threads * per_thread)


def _results(computation: Computation) -> list[Instruction]:
    root = computation.root
    if root.opcode != "tuple":
        return [root]
    by_name = computation.by_name
    return [by_name[name] for name, _ in root.operands if name in by_name]


def _pass_bytes(computation: Computation, result: Instruction, stops: set[str]) -> float:
    """One loop computing `result`: what it reads (parameters, other results, values
    that are never fused) and what it writes."""
    read: dict[str, float] = {}
    seen: set[str] = set()
    pending = [name for name, _ in result.operands]
    if result.opcode == "parameter" or result.opcode in _MATERIALISED:
        return 0.0  # a parameter passed through; a materialised value priced where made
    while pending:
        name = pending.pop()
        if name in seen:
            continue
        seen.add(name)
        operand = computation.by_name.get(name)
        if operand is None:
            continue
        if operand.opcode == "parameter":
            read[name] = parameter_read_bytes(computation, operand)
        elif name in stops or operand.opcode in _MATERIALISED:
            read[name] = float(nbytes(operand.type))
        else:
            pending.extend(n for n, _ in operand.operands)
    return sum(read.values()) + float(nbytes(result.type))


def host_bytes(module: Module, name: str) -> float:
    """The bytes the host computation `name` moves as XLA:CPU compiles it: one pass per
    result (see the module docstring), one per reduction, and what its dots and other
    unfused operations read and write. 0 for a name the module does not have."""
    computation = module.computations.get(name)
    if computation is None:
        return 0.0
    results = _results(computation)
    stops = {r.name for r in results}
    moved = sum(_pass_bytes(computation, r, stops) for r in results)
    for instruction in computation.instructions:
        if instruction.opcode in _MATERIALISED:
            moved += float(nbytes(instruction.type)) + sum(
                float(nbytes(module.operand_type(computation, operand)))
                for operand in instruction.operands
            )
    return moved
