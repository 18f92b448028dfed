"""The text of a compiled XLA module (`compiled.as_text()`), read into computations and
instructions: what `schedule.py` prices.

For a GPU or TPU target the module is scheduled (`is_scheduled=true`): each computation's
instructions are listed in the order they run, fusions are the kernels XLA formed, and
asynchronous work is a `-start`/`-done` pair with the instructions XLA placed between them.
On a CPU the module is the same kind of text, run by XLA:CPU one instruction at a time.

Only what pricing needs is read: each instruction's name, result type (arrays with their
dtype, dimensions and memory space: `S(5)` is host memory), opcode, operands, the
computations it calls, and a few attributes (`kind=`, `custom_call_target=`, the dot
dimensions, the replica groups, the `op_name` metadata and the backend configuration's
`known_trip_count` of a `while`).
"""

import dataclasses
import math
import re
from collections.abc import Iterator

_ITEMSIZE = {
    "pred": 1, "s2": 1, "u2": 1, "s4": 1, "u4": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2,
    "s32": 4, "u32": 4, "s64": 8, "u64": 8, "f16": 2, "bf16": 2, "f32": 4, "f64": 8,
    "c64": 8, "c128": 16, "token": 0, "opaque": 0,
}  # fmt: skip
_ARRAY = re.compile(r"([a-z]+[0-9a-z]*)\[([^\]]*)\](\{[^}]*\})?")
_LINE = re.compile(r"^\s*(ROOT\s+)?%?([^\s=]+)\s*=\s*(.*)$")
_HEADER = re.compile(r"^(ENTRY\s+)?%?([^\s(]+)\s*\(.*\{\s*$")
_NAME = re.compile(r"%([\w.\-]+)(?:#(\d+))?")


@dataclasses.dataclass(frozen=True)
class Array:
    """One array of an instruction's result: dtype, dimensions, and whether it lives in
    host memory (memory space 5 in its layout, `S(5)`)."""

    dtype: str
    dims: tuple[int, ...]
    host: bool = False

    @property
    def elements(self) -> int:
        return math.prod(self.dims)

    @property
    def bytes(self) -> int:
        return self.elements * _ITEMSIZE.get(self.dtype, 4)


Type = Array | tuple["Type", ...]


def arrays(value: Type) -> Iterator[Array]:
    """Every array of a (possibly nested tuple) type, in order."""
    if isinstance(value, Array):
        yield value
    else:
        for item in value:
            yield from arrays(item)


def nbytes(value: Type) -> int:
    return sum(a.bytes for a in arrays(value))


@dataclasses.dataclass
class Instruction:
    """One instruction: `name = type opcode(operands), attributes`."""

    name: str
    opcode: str
    type: Type
    operands: tuple[tuple[str, int | None], ...]  # (name, tuple index of `name#k` or None)
    attributes: str
    calls: tuple[str, ...] = ()
    argument: str = ""  # the text between the parentheses: a parameter's number, a constant

    @property
    def parameter_number(self) -> int | None:
        return (
            int(self.argument) if self.opcode == "parameter" and self.argument.isdigit() else None
        )

    def attribute(self, key: str) -> str | None:
        """The raw text of `key=...` (a quoted string without its quotes)."""
        match = re.search(rf"\b{re.escape(key)}=(\"[^\"]*\"|\{{[^}}]*\}}|[^,\s]+)", self.attributes)
        return None if match is None else match.group(1).strip('"')

    @property
    def op_name(self) -> str:
        match = re.search(r'op_name="([^"]*)"', self.attributes)
        return "" if match is None else match.group(1)

    @property
    def trip_count(self) -> int | None:
        """A `while`'s trip count, where XLA knows it (`known_trip_count`)."""
        match = re.search(r'"known_trip_count":\{"n":"(\d+)"', self.attributes)
        return None if match is None else int(match.group(1))


@dataclasses.dataclass
class Computation:
    """A computation: its instructions in schedule order, and which is its root."""

    name: str
    instructions: list[Instruction]
    entry: bool = False
    root_name: str = ""

    def __post_init__(self) -> None:
        self.by_name = {i.name: i for i in self.instructions}

    @property
    def root(self) -> Instruction:
        return self.by_name.get(self.root_name) or self.instructions[-1]


@dataclasses.dataclass
class Module:
    """A compiled module: its computations by name and the entry's name."""

    name: str
    computations: dict[str, Computation]
    entry: str
    scheduled: bool

    @property
    def entry_computation(self) -> Computation:
        return self.computations[self.entry]

    def trip_count(self, computation: Computation, loop: Instruction) -> int | None:
        """A `while`'s trip count: XLA's `known_trip_count` (XLA:GPU, XLA:CPU), else read
        from a condition `i < N` (or `<=`, `!=`) on a counter that starts at a constant
        (XLA:TPU prints no trip count); None when neither says."""
        if loop.trip_count is not None:
            return loop.trip_count
        condition = self.computations.get(loop.calls[-1]) if loop.calls else None
        if condition is None or condition.root.opcode != "compare" or not loop.operands:
            return None
        compare = condition.root
        if len(compare.operands) != 2:
            return None
        counter = condition.by_name.get(compare.operands[0][0])
        bound = condition.by_name.get(compare.operands[1][0])
        if counter is None or bound is None:
            return None
        direction = compare.attribute("direction")
        if counter.opcode == "constant":  # `N > i` reads as `i < N`
            counter, bound = bound, counter
            direction = {"GT": "LT", "GE": "LE"}.get(direction or "", direction)
        limit = _integer(bound)
        if (
            limit is None
            or counter.opcode != "get-tuple-element"
            or direction not in ("LT", "LE", "NE")
        ):
            return None
        index = int(counter.attribute("index") or 0)
        start = self._initial(computation, loop.operands[0][0], index)
        if start is None:
            return None
        return max(limit - start + (direction == "LE"), 0)

    def _initial(self, computation: Computation, name: str, index: int) -> int | None:
        """The constant a loop's tuple operand holds at `index` (through copies)."""
        value = computation.by_name.get(name)
        if value is None or value.opcode != "tuple" or index >= len(value.operands):
            return None
        element = computation.by_name.get(value.operands[index][0])
        while element is not None and element.opcode == "copy" and element.operands:
            element = computation.by_name.get(element.operands[0][0])
        return _integer(element)

    def operand_type(self, computation: Computation, operand: tuple[str, int | None]) -> Type:
        """The type of one operand of an instruction of `computation`."""
        name, index = operand
        producer = computation.by_name.get(name)
        if producer is None:
            return ()
        value = producer.type
        if index is not None and isinstance(value, tuple) and index < len(value):
            return value[index]
        return value


def _integer(instruction: Instruction | None) -> int | None:
    """The value of an integer scalar `constant`, or None."""
    if instruction is None or instruction.opcode != "constant":
        return None
    try:
        return int(instruction.argument)
    except ValueError:
        return None


def _balanced(text: str) -> tuple[str, str]:
    """`text` starts with '(': the inside of that parenthesis, and what follows it."""
    depth = 0
    for i, ch in enumerate(text):
        if ch in "({[":
            depth += 1
        elif ch in ")}]":
            depth -= 1
            if depth == 0:
                return text[1:i], text[i + 1 :]
    return text[1:], ""


def parse_type(text: str) -> tuple[Type, str]:
    """The type at the start of `text` and the text after it."""
    text = text.lstrip()
    if text.startswith("("):
        inner, rest = _balanced(text)
        items: list[Type] = []
        while inner:
            inner = re.sub(r"^\s*(/\*[^*]*\*/)?\s*", "", inner)
            if not inner:
                break
            item, inner = parse_type(inner)
            items.append(item)
            inner = inner.lstrip()
            if inner.startswith(","):
                inner = inner[1:]
            elif inner:
                break
        return tuple(items), rest
    match = _ARRAY.match(text)
    if match is None:
        return (), text
    dtype, dims, layout = match.group(1), match.group(2), match.group(3) or ""
    shape = tuple(int(d.lstrip("<=")) for d in dims.split(",") if d.strip())
    return Array(dtype, shape, "S(5)" in layout), text[match.end() :]


def parse_instruction(line: str) -> tuple[Instruction, bool] | None:
    """One instruction line, and whether it is the computation's root; None for others."""
    match = _LINE.match(line)
    if match is None:
        return None
    root, name, rest = bool(match.group(1)), match.group(2).lstrip("%"), match.group(3)
    value, rest = parse_type(rest)
    opcode_match = re.match(r"\s*([\w\-]+)\(", rest)
    if opcode_match is None:
        return None
    opcode = opcode_match.group(1)
    inside, attributes = _balanced(rest[opcode_match.end() - 1 :])
    operands = tuple(
        (m.group(1), None if m.group(2) is None else int(m.group(2)))
        for m in _NAME.finditer(inside)
    )
    calls: list[str] = []
    for key in (
        "calls",
        "to_apply",
        "body",
        "condition",
        "branch_computations",
        "called_computations",
    ):
        found = re.search(rf"\b{key}=(\{{[^}}]*\}}|%[\w.\-]+)", attributes)
        if found:
            calls += [m.group(1) for m in _NAME.finditer(found.group(1))]
    instruction = Instruction(
        name, opcode, value, operands, attributes.strip(", "), tuple(calls), inside.strip()
    )
    return instruction, root


def _depth(line: str) -> int:
    """Brackets a line opens and does not close."""
    return sum(line.count(c) for c in "({[") - sum(line.count(c) for c in ")}]")


def _lines(text: str) -> Iterator[str]:
    """The text's lines, an instruction printed over several lines joined into one: XLA:TPU
    prints a Pallas kernel's `kernel_metadata` attribute with line breaks inside it."""
    pending, depth = "", 0
    for line in text.splitlines():
        if pending:
            pending, depth = f"{pending} {line.strip()}", depth + _depth(line)
            if depth <= 0:
                yield pending
                pending = ""
        elif _LINE.match(line) and _depth(line) > 0:
            pending, depth = line, _depth(line)
        else:
            yield line
    if pending:
        yield pending


def parse_module(text: str) -> Module:
    """Read `compiled.as_text()` (or an HLO dump's text) into a `Module`."""
    first = text.lstrip().split("\n", 1)[0]
    name_match = re.match(r"HloModule\s+([^\s,]+)", first)
    computations: dict[str, Computation] = {}
    entry = ""
    current: tuple[str, bool, list[Instruction], list[str]] | None = None
    for line in _lines(text):
        if current is None:
            header = _HEADER.match(line)
            if header:
                current = (header.group(2), bool(header.group(1)), [], [])
            continue
        if line.startswith("}"):  # `}` or `}, execution_thread="host"`
            name, is_entry, instructions, roots = current
            computations[name] = Computation(
                name, instructions, is_entry, roots[0] if roots else ""
            )
            entry = name if is_entry else entry
            current = None
            continue
        parsed = parse_instruction(line)
        if parsed is not None:
            instruction, root = parsed
            current[2].append(instruction)
            if root:
                current[3].append(instruction.name)
    if not entry:
        raise ValueError(
            "The text has no ENTRY computation: expected the text of a compiled XLA "
            "module, as `jax.jit(f).lower(...).compile().as_text()` returns it."
        )
    return Module(
        name=name_match.group(1) if name_match else "",
        computations=computations,
        entry=entry,
        scheduled="is_scheduled=true" in first,
    )
