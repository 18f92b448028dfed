"""A dot's shape, in both forms of a program `ox.estimate` prices: a jaxpr's
`dot_general` (the jaxpr count, `flops.py`) and a compiled module's `dot` or cuBLAS gemm
custom call (the simulation, `kernels.py`). Its FLOPs are 2 x (result elements) x
(contracted elements); its shape `(m, n, k, batch)` and input type go to the target's
efficiency by shape (`ox.matmul_efficiency`), one function for both.
"""

import math
import re
from collections.abc import Callable
from typing import NamedTuple

from .._targets.matmul_efficiency import dot_shape
from .hlo import Array, Computation, Instruction, Module, arrays


def dot_general_shape(eqn) -> tuple[int, int, int, int]:
    """`(m, n, k, batch)` of a jaxpr's `dot_general` equation."""
    (lhs_contracting, rhs_contracting), (lhs_batch, rhs_batch) = eqn.params["dimension_numbers"]
    lhs, rhs = eqn.invars[0].aval.shape, eqn.invars[1].aval.shape
    return dot_shape(lhs, rhs, lhs_contracting, rhs_contracting, lhs_batch, rhs_batch)


def eqn_flops(eqn) -> float:
    """A `dot_general`'s or `conv_general_dilated`'s FLOPs: twice the output's size times
    the contracted size (a conv: its kernel's window times its input features, which the
    kernel already holds per group)."""
    out = eqn.outvars[0].aval
    if eqn.primitive.name == "dot_general":
        (lhs_contracting, _), _ = eqn.params["dimension_numbers"]
        lhs = eqn.invars[0].aval
        return 2.0 * math.prod(out.shape) * math.prod(lhs.shape[d] for d in lhs_contracting)
    _, rhs_spec, _ = eqn.params["dimension_numbers"]
    rhs = eqn.invars[1].aval
    return 2.0 * math.prod(out.shape) * math.prod(rhs.shape[d] for d in rhs_spec[1:])


def dot_rate(
    eqn, constant: float | None, peak: float | None, efficiency: Callable | None
) -> float | None:
    """The FLOP rate a matmul equation runs at: `peak` times `efficiency(m, n, k, dtype,
    batch)` for a `dot_general` where a table by shape is given, else `constant`."""
    if efficiency is None or peak is None or eqn.primitive.name != "dot_general":
        return constant
    m, n, k, batch = dot_general_shape(eqn)
    return peak * efficiency(m, n, k, eqn.invars[0].aval.dtype, batch)


class Matmul(NamedTuple):
    """One dot of a kernel: its FLOPs and its shape, `(m x k) @ (k x n)`, `batch` times,
    with inputs of `dtype` (HLO's name, `"bf16"`)."""

    flops: float
    m: int
    n: int
    k: int
    dtype: str
    batch: int = 1


def dims(text: str | None) -> tuple[int, ...]:
    return tuple(int(d) for d in re.findall(r"\d+", text or ""))


def first(value: object) -> Array | None:
    return next(arrays(value), None)  # type: ignore[arg-type]


def dot_flops(module: Module, computation: Computation, instruction: Instruction) -> float:
    """2 x (result elements) x (contracted elements) of a `dot`."""
    result = first(instruction.type)
    lhs = first(module.operand_type(computation, instruction.operands[0]))
    if result is None or lhs is None:
        return 0.0
    contracted = math.prod(
        lhs.dims[d]
        for d in dims(instruction.attribute("lhs_contracting_dims"))
        if d < len(lhs.dims)
    )
    return 2.0 * result.elements * contracted


def gemm_flops(module: Module, computation: Computation, instruction: Instruction) -> float:
    """A cuBLAS gemm custom call (`__cublas$gemm`, or cuBLASLt's `__cublas$lt$matmul`,
    which XLA:GPU picks when it autotunes on an attached GPU): its dot's dimensions are
    in the backend configuration."""
    result = first(instruction.type)
    lhs = first(module.operand_type(computation, instruction.operands[0]))
    match = re.search(r'"lhs_contracting_dimensions":\[([^\]]*)\]', instruction.attributes)
    if result is None or lhs is None or match is None:
        return 0.0
    contracted = math.prod(lhs.dims[d] for d in dims(match.group(1)) if d < len(lhs.dims))
    return 2.0 * result.elements * contracted


def _matmul(
    module: Module, computation: Computation, instruction: Instruction, numbers: dict, flops: float
) -> Matmul | None:
    """A dot's `Matmul` from its operands and dimension numbers (`numbers`: the text of
    `lhs_contracting`, `rhs_contracting`, `lhs_batch`, `rhs_batch`)."""
    if len(instruction.operands) < 2:
        return None
    lhs, rhs = (first(module.operand_type(computation, o)) for o in instruction.operands[:2])
    if lhs is None or rhs is None:
        return None
    m, n, k, batch = dot_shape(
        lhs.dims, rhs.dims, *(dims(numbers.get(key)) for key in _DOT_NUMBERS)
    )
    return Matmul(flops, m, n, k, lhs.dtype, batch)


_DOT_NUMBERS = ("lhs_contracting", "rhs_contracting", "lhs_batch", "rhs_batch")


def dot_matmul(module: Module, computation: Computation, instruction: Instruction) -> Matmul | None:
    """The `Matmul` of a `dot` instruction, or of a cuBLAS gemm custom call (its
    dimension numbers in the backend configuration); None for anything else."""
    if instruction.opcode == "dot":
        numbers = {key: instruction.attribute(f"{key}_dims") for key in _DOT_NUMBERS}
        flops = dot_flops(module, computation, instruction)
    elif instruction.opcode == "custom-call" and is_gemm(instruction):
        numbers = {
            key: match.group(1)
            for key in _DOT_NUMBERS
            if (match := re.search(rf'"{key}_dimensions":\[([^\]]*)\]', instruction.attributes))
        }
        flops = gemm_flops(module, computation, instruction)
    else:
        return None
    return _matmul(module, computation, instruction, numbers, flops)


def is_gemm(instruction: Instruction) -> bool:
    target = instruction.attribute("custom_call_target") or ""
    return "gemm" in target.lower() or target.startswith("__cublas$lt$matmul")


def inner_matmuls(module: Module, name: str, seen: frozenset = frozenset()) -> tuple[Matmul, ...]:
    """The dots of computation `name` at any depth, with their shapes."""
    computation = module.computations.get(name)
    if computation is None or name in seen:
        return ()
    found: list[Matmul] = []
    for instruction in computation.instructions:
        matmul = dot_matmul(module, computation, instruction)
        if matmul is not None:
            found.append(matmul)
        for called in instruction.calls:
            found += inner_matmuls(module, called, seen | {name})
    return tuple(found)
