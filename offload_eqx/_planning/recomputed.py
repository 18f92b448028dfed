"""The clones XLA's rematerialization left in a compiled program, read and priced by the
compiled-module reader (`hlo`) and the kernel prices' FLOP count (`kernels`): what
`MemoryReport.recomputed` lists (`_inspect/recomputed.py`, which this module hands the
reader to when the planning layer is imported)."""

from .._inspect.recomputed import REMAT_MARK, Recomputed, read_clones_with
from .hlo import Computation, Module, parse_module
from .kernels import inner_flops, own_flops


def _runs(module: Module) -> dict[str, int]:
    """How many times each computation the entry reaches runs in one step: a `while`'s
    body and condition once per trip (once where the trip count is unknown)."""
    runs = {module.entry: 1}
    pending = [module.entry_computation]
    while pending:
        computation = pending.pop()
        for instruction in computation.instructions:
            trips = 1
            if instruction.opcode == "while":
                trips = module.trip_count(computation, instruction) or 1
            for name in instruction.calls:
                called = module.computations.get(name)
                if called is None or name in runs:
                    continue
                runs[name] = runs[computation.name] * trips
                pending.append(called)
    return runs


def _flops(module: Module, computation: Computation, instruction) -> float:
    """One run's FLOPs: the instruction's own (a dot, a cuBLAS call) and those of the
    computations it calls (a fusion's dots)."""
    inner = sum(inner_flops(module, name) for name in instruction.calls)
    return own_flops(module, computation, instruction) + inner


def clones(text: str) -> tuple[Recomputed, ...]:
    """Every instruction of `text` (a compiled program's `as_text()`) whose name marks it
    as XLA's rematerialized clone, with its FLOPs in one step."""
    module = parse_module(text)
    runs = _runs(module)
    found = []
    for name, computation in module.computations.items():
        times = runs.get(name, 1)
        for instruction in computation.instructions:
            if REMAT_MARK in instruction.name:
                flops = _flops(module, computation, instruction) * times
                op = instruction.opcode
                if op == "fusion" and flops:
                    op = "fusion (matmul)"
                found.append(Recomputed(instruction.name, op, flops, times))
    return tuple(found)


read_clones_with(clones)
