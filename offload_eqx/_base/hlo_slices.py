"""The address walks XLA:GPU annotates on loop slices, checked against the program.

XLA:GPU's `DynamicSliceAnnotator` stamps each dynamic-slice and dynamic-update-slice in a
while loop's body with a `dynamic_slice_config`: the byte offset of the slice at the loop's
first iteration and the bytes it moves by at each further one. Copies of host memory are
emitted from that annotation. `misannotated_host_slices(text)` reads the compiled HLO
text, evaluates each annotated slice of a host-memory buffer (`S(5)`) at the loop's first
two iterations from the program itself (the loop's induction variable through scalar
integer arithmetic, into the computation the slice sits in), and returns those whose
annotation disagrees: the fault `compiler_faults` names (openxla/xla#46231). A slice
whose offset it cannot evaluate here (another operation, a deeper call) is left out: no
verdict, not a pass.
"""

import dataclasses
import json
import re
from collections.abc import Callable

# A computation's first line: `%region_2.11 (arg: ...) -> ... {`, `ENTRY %main.13 (...`.
_HEADER = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s+\(.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_OPCODE = re.compile(r"\s*([\w\-]+)\(")
_ARRAY = re.compile(r"^(\w+)\[([\d,]*)\](?:\{([\d,]*)(?::([^}]*))?\})?")
_METADATA = re.compile(r"metadata=\{[^}]*\}")
_NAME = re.compile(r"%([\w.\-]+)")
_HOST_MEMORY = "S(5)"
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2}
_BYTES |= {"s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8}
_SLICES = ("dynamic-slice", "dynamic-update-slice")
_ARITHMETIC: dict[str, Callable[..., int]] = {
    "add": lambda a, b: a + b,
    "subtract": lambda a, b: a - b,
    "multiply": lambda a, b: a * b,
    "maximum": max,
    "minimum": min,
    "negate": lambda a: -a,
    "copy": lambda a: a,
    "bitcast": lambda a: a,
    "convert": lambda a: a,
    "clamp": lambda low, x, high: min(max(x, low), high),
}


@dataclasses.dataclass(frozen=True)
class Instruction:
    name: str
    shape: str
    opcode: str
    operands: tuple[str, ...]  # operand names; a constant's literal text
    attributes: str  # the text after the operands, metadata removed
    config: dict  # the backend config (JSON), {} where none


@dataclasses.dataclass(frozen=True)
class Misannotated:
    """A slice whose annotated address walk is not the one the program computes."""

    slice: str
    loop: str
    offsets: tuple[int, int]  # bytes at the first two iterations, as the program computes
    annotated: tuple[int, int]  # bytes at the first two iterations, as annotated
    buffer: str = ""  # the host buffer's type, `f32[8,128,64]`

    def __str__(self) -> str:
        (o0, o1), (a0, a1) = self.offsets, self.annotated
        return (
            f"`{self.slice}` in loop `{self.loop}` addresses bytes {o0}, {o1}, ... "
            f"(step {o1 - o0:+d}) but is annotated {a0}, {a1}, ... (step {a1 - a0:+d})"
        )


def _balanced(text: str, start: int) -> int:
    """The index just past the bracket group opening at `text[start]`."""
    pairs = {"(": ")", "{": "}", "[": "]"}
    stack = []
    for index in range(start, len(text)):
        char = text[index]
        if char in pairs:
            stack.append(pairs[char])
        elif stack and char == stack[-1]:
            stack.pop()
            if not stack:
                return index + 1
    return len(text)


def _split_top(text: str) -> list[str]:
    parts, depth, current = [], 0, []
    for char in text:
        depth += char in "([{"
        depth -= char in ")]}"
        if char == "," and depth == 0:
            parts.append("".join(current).strip())
            current = []
        else:
            current.append(char)
    tail = "".join(current).strip()
    return parts + [tail] if tail else parts


def _config(attributes: str) -> dict:
    start = attributes.find("backend_config=")
    if start < 0 or attributes[start + 15 : start + 16] != "{":
        return {}
    start += 15
    try:
        return json.loads(attributes[start : _balanced(attributes, start)])
    except ValueError:
        return {}


def _instruction(line: str) -> Instruction | None:
    match = _INSTRUCTION.match(line)
    if match is None:
        return None
    name, rest = match.groups()
    end = _balanced(rest, 0) if rest.startswith("(") else rest.find(" ")
    shape, rest = rest[: max(end, 0)], rest[max(end, 0) :]
    opcode = _OPCODE.match(rest)
    if opcode is None:
        return None
    open_at = opcode.end() - 1
    close_at = _balanced(rest, open_at)
    operands = []
    for part in _split_top(rest[open_at + 1 : close_at - 1]):
        names = _NAME.findall(part)
        operands.append(names[-1] if names else part)
    attributes = _METADATA.sub("", rest[close_at:])
    return Instruction(
        name, shape, opcode.group(1), tuple(operands), attributes, _config(attributes)
    )


def computations(text: str) -> dict[str, dict[str, Instruction]]:
    """Each computation of an HLO module's text: its instructions by name, in order."""
    found: dict[str, dict[str, Instruction]] = {}
    current: dict[str, Instruction] | None = None
    for line in text.splitlines():
        header = _HEADER.match(line)
        if header is not None:
            current = found.setdefault(header.group(1), {})
        elif current is not None:
            instruction = _instruction(line)
            if instruction is not None:
                current[instruction.name] = instruction
    return found


def _attribute(instruction: Instruction, key: str) -> str | None:
    match = re.search(rf"\b{key}=%?([\w.\-]+)", instruction.attributes)
    return match.group(1) if match else None


class _Evaluator:
    """Scalar integer values of a loop body's instructions at one induction value."""

    def __init__(self, module: dict, body: str, induction_index: int, value: int):
        self.module, self.body = module, body
        self.induction_index, self.value = induction_index, value

    def of(self, computation: str, name: str, bind: Callable[[int], int | None] | None):
        instruction = self.module[computation].get(name)
        if instruction is None:
            return None
        op, operands = instruction.opcode, instruction.operands
        if op == "constant":
            return int(operands[0]) if re.fullmatch(r"-?\d+", operands[0]) else None
        if op == "parameter":
            return bind(int(operands[0])) if bind is not None else None
        if op == "get-tuple-element" and computation == self.body:
            source = self.module[computation].get(operands[0])
            index = _attribute(instruction, "index")
            if source is not None and source.opcode == "parameter" and index is not None:
                return self.value if int(index) == self.induction_index else None
            return None
        if op in ("fusion", "call"):
            callee = _attribute(instruction, "calls") or _attribute(instruction, "to_apply")
            if callee is None or callee not in self.module:
                return None
            root = list(self.module[callee])[-1]
            return self.of(callee, root, lambda p: self.of(computation, operands[p], bind))
        if op in _ARITHMETIC:
            values = [self.of(computation, operand, bind) for operand in operands]
            if any(v is None for v in values):
                return None
            return _ARITHMETIC[op](*values)
        return None


def _byte_strides(dims: list[int], layout: list[int], element: int) -> list[int]:
    strides, size = [0] * len(dims), element
    for dim in layout:
        strides[dim] = size
        size *= dims[dim]
    return strides


def _slice_bytes(
    module: dict, computation: str, slice_: Instruction, at: Callable[[str], int | None]
) -> tuple[int, int] | None:
    """The slice's byte offset (unclamped, clamped) with offsets valued by `at`."""
    buffer = module[computation].get(slice_.operands[0])
    array = _ARRAY.match(buffer.shape) if buffer is not None else None
    if array is None or array.group(1) not in _BYTES:
        return None
    dims = [int(d) for d in array.group(2).split(",") if d]
    layout = [int(d) for d in (array.group(3) or "").split(",") if d] or list(
        reversed(range(len(dims)))
    )
    first = 1 if slice_.opcode == "dynamic-slice" else 2
    if slice_.opcode == "dynamic-slice":
        sizes_text = re.search(r"dynamic_slice_sizes=\{([\d,]*)\}", slice_.attributes)
        sizes = [int(d) for d in sizes_text.group(1).split(",")] if sizes_text else None
    else:
        update = module[computation].get(slice_.operands[1])
        update_array = _ARRAY.match(update.shape) if update is not None else None
        sizes = [int(d) for d in update_array.group(2).split(",") if d] if update_array else None
    if sizes is None or len(sizes) != len(dims):
        return None
    strides = _byte_strides(dims, layout, _BYTES[array.group(1)])
    unclamped = clamped = 0
    for dim, (extent, size, stride) in enumerate(zip(dims, sizes, strides)):
        if extent == size:
            continue
        value = at(slice_.operands[first + dim])
        if value is None:
            return None
        unclamped += value * stride
        clamped += min(max(value, 0), extent - size) * stride
    return unclamped, clamped


def _annotation(slice_: Instruction) -> tuple[int, int] | None:
    config = slice_.config.get("dynamic_slice_config")
    if not isinstance(config, dict) or int(config.get("loop_index", 0)) != 0:
        return None
    walk = config.get("linear", config)  # newer releases nest the walk under "linear"
    return int(walk.get("byte_offset", 0)), int(walk.get("byte_stride", 0))


def _host_slices(module: dict, body: str):
    """(computation, slice, caller in the body or None) for each annotated slice of a
    host-memory buffer in `body` or in a computation an instruction of `body` calls."""
    places: list[tuple[str, Instruction | None]] = [(body, None)]
    for instruction in module[body].values():
        callee = _attribute(instruction, "calls")
        if callee is not None and callee in module:
            places.append((callee, instruction))
    for computation, caller in places:
        for instruction in module[computation].values():
            buffer = module[computation].get(
                instruction.operands[0] if instruction.operands else ""
            )
            if (
                instruction.opcode in _SLICES
                and "dynamic_slice_config" in instruction.config
                and buffer is not None
                and _HOST_MEMORY in buffer.shape
            ):
                yield computation, instruction, caller


def _loops(module: dict):
    for instructions in module.values():
        for instruction in instructions.values():
            config, body = instruction.config, _attribute(instruction, "body")
            if instruction.opcode != "while" or body is None or body not in module:
                continue
            induction = config.get("known_induction_variable", {}).get("tuple_index")
            init_step = config.get("known_init_step")
            if induction is not None and init_step:
                yield instruction.name, body, int(induction), init_step


def _offset_bytes(
    module: dict, loop_body: tuple[str, int], value: int, computation: str, slice_, caller
) -> tuple[int, int] | None:
    """The slice's byte offset when the loop's induction variable is `value`."""
    body, induction = loop_body
    evaluator = _Evaluator(module, body, induction, value)

    def bind(parameter: int) -> int | None:  # a parameter of the called computation
        if caller is None or parameter >= len(caller.operands):
            return None
        return evaluator.of(body, caller.operands[parameter], None)

    return _slice_bytes(module, computation, slice_, lambda n: evaluator.of(computation, n, bind))


def misannotated_host_slices(text: str) -> list[Misannotated]:
    """Every annotated slice of host memory in a loop of the compiled HLO `text` whose
    annotation is not the walk the program computes at the loop's first two iterations."""
    if "dynamic_slice_config" not in text or _HOST_MEMORY not in text:
        return []
    module = computations(text)
    found = []
    for loop, body, induction, init_step in _loops(module):
        init, step = int(init_step.get("init", 0)), int(init_step.get("step", 1))
        for computation, slice_, caller in _host_slices(module, body):
            annotated = _annotation(slice_)
            first, second = (
                _offset_bytes(module, (body, induction), value, computation, slice_, caller)
                for value in (init, init + step)
            )
            if annotated is None or first is None or second is None:
                continue  # not evaluated here: no verdict
            marks = (annotated[0], annotated[0] + annotated[1])
            # Either reading (unclamped or clamped to the buffer) may be the annotated one.
            if marks[0] not in first or marks[1] not in second:
                buffer = module[computation][slice_.operands[0]].shape.split("{")[0]
                offsets = (first[0], second[0])
                found.append(Misannotated(slice_.name, loop, offsets, marks, buffer))
    return found
