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
28; the benchmark `benchmarks/host_update.py` measures both. Where the program is
compiled for the CPU, `optax.adam(w)` on float32 masters is one call per leaf of our own
kernel instead (`_optimizer.fused_adamw`): a `custom-call`, priced by the operands it
reads and the results it writes, 28 bytes a parameter.

The host runs it on its threads: XLA:GPU runs each host computation as a task of a
per-GPU pool (at most 8 tasks at once), and the computation's loops are split over an
intra-op pool sized by the machine's cores (`NPROC` or the cores it may use), shared by
every GPU's host computations. `Speeds.host_threads` (the threads one GPU's update gets)
times `Speeds.host_thread_bandwidth` (what one thread streams), at most the host's share
`Speeds.host_bandwidth`, is what the estimate divides by (`host_computation_bandwidth`);
`ox.calibrate_host` measures the figures on the machine itself.
"""

from .._targets.speeds import Speeds
from .hlo import Computation, Instruction, Module, nbytes
from .kernels import parameter_read_bytes

# Operations XLA:CPU never fuses into a consumer's loop: their results are read from
# memory by whoever uses them. A conditional or a loop is priced by what it calls.
_KERNELS = {"reduce", "dot", "convolution", "sort", "custom-call"}
_CALLS = {"conditional", "while"}
_MATERIALISED = _KERNELS | _CALLS


def host_computation_bandwidth(speeds: Speeds) -> float:
    """Bytes/s one host computation streams: `host_threads` threads at
    `host_thread_bandwidth` each (0: the host's whole `host_bandwidth`), never more than
    the host's `host_bandwidth`."""
    per_thread, threads = speeds.host_thread_bandwidth, speeds.host_threads
    if not per_thread or not threads:
        return speeds.host_bandwidth
    return min(speeds.host_bandwidth, threads * per_thread)


def _results(computation: Computation) -> list[Instruction]:
    root = computation.root
    if root.opcode != "tuple":
        return [root]
    by_name = computation.by_name
    return [by_name[name] for name, _ in root.operands if name in by_name]


def _written_elsewhere(computation: Computation, instruction: Instruction) -> bool:
    """A value no loop of its own writes: a parameter, a value an unfused operation
    writes, or an element of either."""
    if instruction.opcode == "get-tuple-element" and instruction.operands:
        source = computation.by_name.get(instruction.operands[0][0])
        return source is None or _written_elsewhere(computation, source)
    return instruction.opcode == "parameter" or instruction.opcode in _MATERIALISED


def _pass_bytes(computation: Computation, result: Instruction, stops: set[str]) -> float:
    """One loop computing `result`: what it reads (parameters, other results, values
    written elsewhere) and what it writes."""
    if _written_elsewhere(computation, result):
        return 0.0  # passed through, or written by its own operation (priced there)
    read: dict[str, float] = {}
    seen: set[str] = set()
    pending = [name for name, _ in result.operands]
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
        elif name in stops or _written_elsewhere(computation, operand):
            read[name] = float(nbytes(operand.type))
        else:
            pending.extend(n for n, _ in operand.operands)
    return sum(read.values()) + float(nbytes(result.type))


def _unfused_bytes(module: Module, computation: Computation, instruction: Instruction) -> float:
    """An operation with a loop of its own: a reduction or a dot reads its operands and
    writes its result; a conditional moves what its costliest branch does (the update
    of a delayed step, not the branch that keeps the state); a loop, its body's bytes
    times its trip count (once, where XLA does not know it)."""
    if instruction.opcode in _KERNELS:
        return float(nbytes(instruction.type)) + sum(
            float(nbytes(module.operand_type(computation, operand)))
            for operand in instruction.operands
        )
    if instruction.opcode == "conditional":
        return max((host_bytes(module, branch) for branch in instruction.calls), default=0.0)
    if instruction.opcode == "while":
        trips = instruction.trip_count or 1
        return trips * sum(host_bytes(module, called) for called in instruction.calls)
    return 0.0


def host_bytes(module: Module, name: str) -> float:
    """The bytes the host computation `name` moves as XLA:CPU compiles it: one pass per
    result (see the module docstring) and what each unfused operation moves. 0 for a
    name the module does not have."""
    computation = module.computations.get(name)
    if computation is None:
        return 0.0
    results = _results(computation)
    stops = {r.name for r in results}
    moved = sum(_pass_bytes(computation, r, stops) for r in results)
    return moved + sum(
        _unfused_bytes(module, computation, instruction) for instruction in computation.instructions
    )
