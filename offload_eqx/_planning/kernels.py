"""What one instruction of a compiled module costs, as XLA formed it: its FLOPs, the bytes it
reads and writes in device and in host memory, and which resource runs it.

- A fusion's FLOPs are those of the dots and convolutions inside it (at any depth), from
  their dimensions; its bytes are its operands read and its results written, where an
  operand only sliced inside the fusion is read as the slices, and a result updated in
  place (`dynamic-update-slice`) is written as the update.
- A `dot` or `convolution` outside a fusion, and the custom calls of cuBLAS and cuDNN's
  convolutions, the same. Each dot's shape (M, N, K, dtype, batch) goes with its FLOPs
  (`Work.matmuls`), for the target's efficiency by shape (`prices.py`).
- Every other custom call is a fused kernel, priced by its rule in `fused.py` (cuDNN
  attention, splash attention, a Pallas kernel's declared cost estimate) at its own
  efficiency where the rule gives one; a kernel no rule prices moves its operands and
  results and is marked `unpriced`, for the simulation's notes.
- Every other instruction that does work moves its operands and results.
- Bytes in host memory (`S(5)` in the layout) cross the host link: host-to-device when
  read, device-to-host when written.
"""

import dataclasses
import math
import re
from collections.abc import Mapping

from .dots import Matmul, dot_flops, dot_matmul, first, gemm_flops, inner_matmuls, is_gemm
from .fused import KernelCost, Key, custom_call_cost
from .hlo import Computation, Instruction, Module, Type, arrays, nbytes

# Instructions that run no kernel: they name, alias or group buffers.
FREE = frozenset(
    """parameter constant get-tuple-element tuple bitcast opt-barrier after-all add-dependency
    partition-id replica-id domain get-dimension-size set-dimension-size""".split()
)
# Collectives, synchronous or as the `-start` of an asynchronous pair.
COLLECTIVES = frozenset(
    "all-reduce all-gather reduce-scatter collective-permute all-to-all "
    "collective-broadcast ragged-all-to-all".split()
)
_SLICING = frozenset({"dynamic-slice", "slice", "gather"})
_IN_PLACE = frozenset({"dynamic-update-slice", "scatter"})
_PASS = frozenset({"bitcast", "reshape", "copy", "convert", "get-tuple-element", "tuple"})


@dataclasses.dataclass(frozen=True)
class Work:
    """The work of one execution of an instruction."""

    flops: float = 0.0
    device_bytes: float = 0.0
    host_read: float = 0.0  # bytes read from host memory: over the link, host-to-device
    host_write: float = 0.0  # bytes written to host memory: device-to-host
    transposes: bool = False  # the kernel transposes: its device bytes move strided
    efficiency: float | None = None  # the fraction of peak its FLOPs run at (None: the target's)
    unpriced: str = ""  # what the kernel is, when no rule prices its FLOPs (its bytes alone)
    caveat: str = ""  # what a priced kernel's price leaves out (a mask not read)
    host: bool = False  # a host kernel of ours: its device bytes at the host's bandwidth
    matmuls: tuple[Matmul, ...] = ()  # the dots among `flops`, with their shapes


def group_size(instruction: Instruction) -> int:
    """The devices in each replica group of a collective: `{{0,1,2,3}}`, the iota form
    `[2,4]<=[8]` (2 groups of 4), or the mesh form `mesh['x'=2,'y'=4] {'y'}`."""
    text = (
        instruction.attributes.split("replica_groups=", 1)[-1]
        if "replica_groups=" in instruction.attributes
        else ""
    )
    if text.startswith("{"):
        first = re.match(r"\{\{([\d,\s]*)\}", text)
        return len(first.group(1).split(",")) if first and first.group(1).strip() else 1
    if text.startswith("["):
        iota = re.match(r"\[(\d+),(\d+)\]", text)
        return int(iota.group(2)) if iota else 1
    if text.startswith("mesh"):
        sizes = dict(re.findall(r"'([^']+)'=(\d+)", text.split("]", 1)[0]))
        named = re.match(r"mesh\[[^\]]*\]\s*\{([^}]*)\}", text)
        axes = re.findall(r"'([^']+)'", named.group(1)) if named else list(sizes)
        return math.prod(int(sizes.get(a, 1)) for a in axes)
    return 1


# The forward convolution's (output, input, kernel) among a cuDNN convolution's (result,
# first operand, second operand): its backward kernels carry the forward's dimensions.
_CUDNN_CONVOLUTION_ROLES = {
    "__cudnn$convBackwardInput": (1, 0, 2),
    "__cudnn$convBackwardFilter": (2, 1, 0),
}


def convolution_flops(module: Module, computation: Computation, instruction: Instruction) -> float:
    """2 x (output elements) x (kernel elements per output feature) x the share of the
    window's taps that meet input elements: the kernel's input features are already those
    of one feature group. A cuDNN convolution's backward kernels (`__cudnn$convBackward*`)
    cost what the forward convolution whose dimensions they carry costs."""
    values = [first(instruction.type)] + [
        first(module.operand_type(computation, o)) for o in instruction.operands[:2]
    ]
    if len(values) < 3:
        return 0.0
    roles = _CUDNN_CONVOLUTION_ROLES.get(instruction.attribute("custom_call_target") or "")
    result, lhs, kernel = (values[i] for i in roles or (0, 1, 2))
    if result is None or kernel is None:
        return 0.0
    labels = instruction.attribute("dim_labels") or ""
    kernel_labels = labels.split("_")[1].split("->")[0] if "_" in labels else ""
    out_feature = kernel_labels.find("o")
    per_output = kernel.elements / (
        kernel.dims[out_feature] if 0 <= out_feature < len(kernel.dims) else 1
    )
    lhs_labels = labels.split("_")[0]
    sizes = [
        lhs.dims[lhs_labels.index(str(d))] if lhs is not None and str(d) in lhs_labels else None
        for d in range(10)
    ]
    return 2.0 * result.elements * per_output * _taps_on_input(instruction, sizes)


def _window(instruction: Instruction) -> dict[str, list[str]]:
    """The fields of a convolution's `window={size=1x16 pad=0_0x15_15 ...}`, split by
    spatial dimension."""
    window = re.search(r"window=\{([^}]*)\}", instruction.attributes)
    fields = re.findall(r"(\w+)=([\w-]+)", window.group(1)) if window else []
    return {key: value.split("x") for key, value in fields}


def _real_taps(n: int, size: int, stride: int, low: int, high: int, dilate: int, rhs: int):
    """(taps meeting an input element, all taps) summed over the outputs of one spatial
    dimension: the input has `n` elements `dilate` apart, `low`/`high` padding around them,
    and a window of `size` taps `rhs` apart moves by `stride`."""
    span = (n - 1) * dilate + 1 + low + high
    outputs = max(0, (span - (size - 1) * rhs - 1) // stride + 1)
    last = (n - 1) * dilate  # the last input element's position, padding excluded
    real = 0
    for tap in range(size):
        offset = tap * rhs - low  # position of the tap at output 0, relative to input 0
        first = max(0, -(offset // stride))  # ceil(-offset / stride)
        final = min(outputs - 1, (last - offset) // stride)
        if final < first:
            continue
        if dilate == 1:
            real += final - first + 1
            continue
        # outputs o with (o * stride + offset) a multiple of `dilate`
        g = math.gcd(stride, dilate)
        if offset % g:
            continue
        period = dilate // g
        start = (-offset // g) * pow(stride // g, -1, period) % period if period > 1 else 0
        real += (final - start) // period - (first - 1 - start) // period
    return real, outputs * size


def _taps_on_input(instruction: Instruction, sizes: list[int | None]) -> float:
    """Of a window's taps, the share that meet input elements rather than padding or the
    holes of input dilation. XLA:TPU writes a batched dot as a convolution whose batch
    dimensions are windows as large as their dilation (one tap of each is real), and a
    head-split projection as a window of 16 over a padded input of 1 (one tap is real)."""
    window = _window(instruction)
    taps = window.get("size")
    if not taps:
        return 1.0
    share = 1.0
    for d, size in enumerate(int(t) for t in taps):
        n = sizes[d] if d < len(sizes) else None
        if n is None:
            continue

        def field(key: str, default: str, d: int = d) -> str:
            values = window.get(key)
            return values[d] if values and d < len(values) else default

        low, high = (int(v) for v in field("pad", "0_0").split("_"))
        stride, dilate, rhs = (int(field(k, "1")) for k in ("stride", "lhs_dilate", "rhs_dilate"))
        real, total = _real_taps(n, size, stride, low, high, dilate, rhs)
        share *= real / total if total else 1.0
    return share


def inner_flops(module: Module, name: str, seen: frozenset = frozenset()) -> float:
    """The FLOPs of the dots and convolutions of computation `name`, at any depth."""
    computation = module.computations.get(name)
    if computation is None or name in seen:
        return 0.0
    total = 0.0
    for instruction in computation.instructions:
        total += own_flops(module, computation, instruction)
        for called in instruction.calls:
            total += inner_flops(module, called, seen | {name})
    return total


def transposes(module: Module, name: str) -> bool:
    """Whether computation `name` (a fusion's) holds a `transpose` at any depth."""
    computation = module.computations.get(name)
    if computation is None:
        return False
    return any(
        i.opcode == "transpose" or any(transposes(module, c) for c in i.calls)
        for i in computation.instructions
    )


def own_flops(module: Module, computation: Computation, instruction: Instruction) -> float:
    if instruction.opcode == "dot":
        return dot_flops(module, computation, instruction)
    if instruction.opcode == "convolution":
        return convolution_flops(module, computation, instruction)
    if instruction.opcode == "custom-call":
        target = instruction.attribute("custom_call_target") or ""
        if is_gemm(instruction):
            return gemm_flops(module, computation, instruction)
        if target.startswith("__cudnn$conv"):
            return convolution_flops(module, computation, instruction)
    return 0.0


def _users(computation: Computation) -> dict[str, list[tuple[Instruction, int]]]:
    users: dict[str, list[tuple[Instruction, int]]] = {}
    for instruction in computation.instructions:
        for position, (name, _) in enumerate(instruction.operands):
            users.setdefault(name, []).append((instruction, position))
    return users


def _read_bytes(computation: Computation, parameter: Instruction, users: dict) -> float | None:
    """The bytes a fused parameter is read as when every use slices it or updates it in
    place (None: read whole)."""
    total = 0.0
    for user, position in users.get(parameter.name, []):
        if user.opcode in _SLICING and position == 0:
            total += nbytes(user.type)
        elif user.opcode in _IN_PLACE and position == 0:
            continue
        elif user.opcode == "bitcast":
            inner = _read_bytes(computation, user, users)
            if inner is None:
                return None
            total += inner
        else:
            return None
    return total


def parameter_read_bytes(computation: Computation, parameter: Instruction) -> float:
    """What `computation` reads of one of its parameters: the pieces it slices out when
    slicing (or updating in place) is all it does with it, else the whole parameter."""
    sliced = _read_bytes(computation, parameter, _users(computation))
    whole = float(nbytes(parameter.type))
    return whole if sliced is None else min(sliced, whole)


def _written(computation: Computation, instruction: Instruction) -> list[tuple[float, bool]]:
    """(bytes written, in host memory) for each array a fused root writes."""
    if instruction.opcode == "tuple":
        return [
            w
            for name, _ in instruction.operands
            for w in _written(computation, computation.by_name[name])
        ]
    if instruction.opcode in _IN_PLACE and len(instruction.operands) > 1:
        update = computation.by_name.get(
            instruction.operands[1 if instruction.opcode == "dynamic-update-slice" else 2][0]
        )
        host = any(a.host for a in arrays(instruction.type))
        return [(float(nbytes(update.type)) if update else 0.0, host)]
    if instruction.opcode == "bitcast" and instruction.operands:
        source = computation.by_name.get(instruction.operands[0][0])
        if source is not None and source.opcode in _IN_PLACE:
            return _written(computation, source)
    return [(float(a.bytes), a.host) for a in arrays(instruction.type)]


def fusion_work(module: Module, computation: Computation, instruction: Instruction) -> Work:
    """The work of one fusion (or any instruction calling one computation as a kernel)."""
    fused = module.computations.get(instruction.calls[0]) if instruction.calls else None
    flops = inner_flops(module, fused.name) if fused is not None else 0.0
    users = _users(fused) if fused is not None else {}
    parameters = {
        inner.parameter_number: inner
        for inner in (fused.instructions if fused is not None else ())
        if inner.parameter_number is not None
    }
    device = host_read = host_write = 0.0
    for index, operand in enumerate(instruction.operands):
        value = module.operand_type(computation, operand)
        whole = float(nbytes(value))
        parameter = parameters.get(index)
        sliced = _read_bytes(fused, parameter, users) if parameter is not None and fused else None
        read = whole if sliced is None else min(sliced, whole)
        if any(a.host for a in arrays(value)):
            host_read += read
        else:
            device += read
    root_writes = (
        _written(fused, fused.root)
        if fused is not None
        else [(float(a.bytes), a.host) for a in arrays(instruction.type)]
    )
    for written, host in root_writes:
        if host:
            host_write += written
        else:
            device += written
    strided = fused is not None and transposes(module, fused.name)
    matmuls = inner_matmuls(module, fused.name) if fused is not None else ()
    return Work(flops, device, host_read, host_write, strided, matmuls=matmuls)


def _moved(
    module: Module, computation: Computation, instruction: Instruction, flops: float
) -> Work:
    """Work that reads every operand whole and writes every result."""
    device = host_read = host_write = 0.0
    for operand in instruction.operands:
        for a in arrays(module.operand_type(computation, operand)):
            if a.host:
                host_read += a.bytes
            else:
                device += a.bytes
    for a in arrays(instruction.type):
        if a.host:
            host_write += a.bytes
        else:
            device += a.bytes
    return Work(flops, device, host_read, host_write)


# Custom calls that only reserve or name memory.
FREE_CALLS = frozenset(
    {"AllocateBuffer", "annotate_device_placement", "MoveToHost", "MoveToDevice"}
)


def is_free(instruction: Instruction) -> bool:
    """Whether an instruction runs no kernel."""
    if instruction.opcode in FREE:
        return True
    return (
        instruction.opcode == "custom-call"
        and instruction.attribute("custom_call_target") in FREE_CALLS
    )


def piece_work(source: Type, destination: Type, piece: Type) -> Work:
    """A slice or an in-place update moves one piece (`piece`'s bytes) from `source`'s
    memory to `destination`'s, not the whole buffer: read from host memory over the link
    (or from HBM), written likewise."""
    size = float(nbytes(piece))
    src_host = any(a.host for a in arrays(source))
    dst_host = any(a.host for a in arrays(destination))
    device = size * ((not src_host) + (not dst_host))
    return Work(0.0, device, size if src_host else 0.0, size if dst_host else 0.0)


def custom_call_work(
    module: Module,
    computation: Computation,
    instruction: Instruction,
    table: Mapping[Key, KernelCost] | None = None,
) -> Work:
    """A custom call's work: cuBLAS and cuDNN convolutions by their dimensions, any other
    kernel by its rule in `fused.py` (`table`: what the traced program says of its Pallas
    kernels)."""
    flops = own_flops(module, computation, instruction)
    if flops:
        return _with_matmul(module, computation, instruction, flops)
    cost = custom_call_cost(module, computation, instruction, table)
    work = _moved(module, computation, instruction, cost.flops)
    return dataclasses.replace(
        work,
        device_bytes=work.device_bytes if cost.bytes is None else cost.bytes,
        efficiency=cost.efficiency,
        unpriced="" if cost.priced else f"{cost.kind} ({cost.note})",
        caveat=f"{cost.kind}: {cost.note}" if cost.priced and cost.note else "",
        host=cost.host,
    )


def instruction_work(
    module: Module,
    computation: Computation,
    instruction: Instruction,
    table: Mapping[Key, KernelCost] | None = None,
) -> Work:
    """The work of one synchronous instruction run as a kernel (`is_free` ones do none);
    `table`: what the traced program says of its Pallas kernels (`flops.kernel_table`)."""
    opcode = instruction.opcode
    if is_free(instruction):
        return Work()
    if opcode == "custom-call":
        return custom_call_work(module, computation, instruction, table)
    if opcode in ("fusion", "fusion-start"):  # an asynchronous fusion: the same kernel
        return fusion_work(module, computation, instruction)
    if opcode in _SLICING:  # reads what it returns
        buffer = module.operand_type(computation, instruction.operands[0])
        return piece_work(buffer, instruction.type, instruction.type)
    if opcode in _IN_PLACE:  # reads the update, writes it into the buffer
        index = 1 if opcode == "dynamic-update-slice" else -1
        update = module.operand_type(computation, instruction.operands[index])
        return piece_work(update, instruction.type, update)
    work = _with_matmul(
        module, computation, instruction, own_flops(module, computation, instruction)
    )
    return dataclasses.replace(work, transposes=opcode == "transpose")


def _with_matmul(
    module: Module, computation: Computation, instruction: Instruction, flops: float
) -> Work:
    """`_moved`, with the instruction's own dot shape where it is a dot or a gemm."""
    work = _moved(module, computation, instruction, flops)
    matmul = dot_matmul(module, computation, instruction) if flops else None
    return work if matmul is None else dataclasses.replace(work, matmuls=(matmul,))
