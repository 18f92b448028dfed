"""The fused kernels a step calls, priced by their work: one rule per kind of kernel, read
by the compiled simulation (`kernels.py`: the custom call XLA compiled) and by the jaxpr
count (`flops.py`: the primitive it lowers from).

- **cuDNN attention** (`jax.nn.dot_product_attention(..., implementation="cudnn")`: the
  `dot_product_attention_{fwd,bwd}` primitives, the `__cudnn$fmha*` custom calls): the
  matmuls of attention over the query-key pairs it computes. Forward `2 (D + Dv)` FLOPs a
  pair (`Q K^T` and `P V`), backward `2 (3 D + 2 Dv)` (`Q K^T` again, `dV`, `dP`, `dQ`,
  `dK`): the FlashAttention papers' count, the backward 2.5 times the forward's. Pairs:
  batch x query heads (grouped-query attention computes every query head) x queries x
  keys, of a causal mask only the `ATTENTION_TILE`-square tiles on or below the diagonal
  (a sliding window: those that meet its band). Dropout adds no matmul: its random
  numbers count no FLOPs, as the papers count them. Time at `CUDNN_*_EFFICIENCY` of the
  chip's peak.
- **Splash attention** (`jax.experimental.pallas.ops.tpu.splash_attention`, kernels
  `splash_{mha,mqa}_{fwd,dq,dkv}...`): the blocks its mask keeps (the nonzero entries of
  its block mask, read from the traced program) times the block's pairs; `fwd` `2 (D +
  Dv)` a pair, `dq` `2 (2 D + Dv)`, `dkv` `2 (2 D + 2 Dv)` (and `2 D` more where it also
  computes `dQ`), each recomputing `Q K^T`. It declares no cost estimate and no public
  figure gives its efficiency: the target's.
- **Any other Pallas kernel** (Mosaic TPU, Mosaic GPU, Triton): the FLOPs and bytes of
  the `pl.CostEstimate` it declares, at the target's efficiency. XLA:TPU's custom call
  carries it; on a GPU it travels only in the traced program, found again by kernel name
  and operand shapes.
- **cuDNN convolutions** (`__cudnn$conv*`): as a `convolution` (`kernels.py`).
- **Anything else** (a Pallas kernel without a cost estimate, an FFI call, a custom call
  no rule knows): its bytes alone, and it is named in the notes: never a silent zero.
"""

import dataclasses
import math
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from .._host.kernels.load import target_name
from .hlo import Computation, Instruction, Module, arrays

# cuDNN's fused attention on an H100 SXM5 in BF16, head dimension 128, as the
# FlashAttention-3 paper measures it beside its own (Shah et al., 2024, "FlashAttention-3:
# Fast and Accurate Attention with Asynchrony and Low-precision", the cuDNN bars of its
# forward and backward speed figures): about 600 TFLOP/s forward and 500 TFLOP/s backward
# from 2k to 16k tokens (fewer at 512 tokens: about 500 and 300), of the 989 TFLOP/s
# peak, counted as above. Taken as a fraction of any GPU target's peak: on an A100 the
# FlashAttention-2 paper (Dao, 2023) reports 50-73% of peak, the same range.
CUDNN_FORWARD_EFFICIENCY = 0.6
CUDNN_BACKWARD_EFFICIENCY = 0.5
# The tiles a flash kernel computes a causal mask in: 128 queries by 128 keys, as
# FlashAttention-2 and -3 tile head dimension 128 (cuDNN does not publish its tiles).
ATTENTION_TILE = 128

_SPLASH = re.compile(r"splash_(mha|mqa)_(fwd|dq|dkv)(_segmented)?(_residuals|_no_residuals)?")
_SPLASH_BLOCKS = {"fwd": ("block_q", "block_kv"), "dq": ("block_q_dq", "block_kv_dq")}
_SPLASH_BLOCKS["dkv"] = ("block_q_dkv", "block_kv_dkv")
_CUDNN_PRIMITIVES = {
    "dot_product_attention_fwd": False,
    "dot_product_attention_fwd_wrapper": False,
    "dot_product_attention_bwd": True,
    "dot_product_attention_bwd_wrapper": True,
}
# offload_eqx's own host kernels (`_host.kernels`), by their XLA target.
HOST_KERNELS = {target_name("adamw"): "offload_eqx's AdamW host kernel"}
# Primitives that run a kernel XLA cannot see into.
_OPAQUE = frozenset({"ffi_call", "tpu_custom_call", "triton_kernel_call", "mosaic_gpu_call"})


@dataclasses.dataclass(frozen=True)
class KernelCost:
    """What one execution of a fused kernel costs, by its rule.

    - `kind`: what it is, for notes ("cuDNN attention forward", "Pallas kernel `k`").
    - `flops`: its matmul FLOPs (declared ones for a Pallas kernel).
    - `bytes`: what it reads and writes, where the rule knows it (a declared
      `bytes_accessed`); None: its operands and results.
    - `efficiency`: the fraction of the chip's peak its FLOPs run at; None: the target's.
    - `priced`: False when no rule prices its work: its bytes alone (named in the notes).
    - `note`: what its price leaves out, where something does.
    - `host`: one of offload_eqx's host kernels (`HOST_KERNELS`): its bytes move at the
      bandwidth of a host computation (`host_work.host_computation_bandwidth`: on the
      CPU target, an update in place), not the device's.
    """

    kind: str
    flops: float = 0.0
    bytes: float | None = None
    efficiency: float | None = None
    priced: bool = True
    note: str = ""
    host: bool = False  # a host kernel of ours updating state in place (`HOST_KERNELS`)


Key = tuple[str, tuple[tuple[int, ...], ...]]


def kernel_key(name: str, shapes: Sequence[Sequence[int]]) -> Key:
    """How a Pallas kernel is found in the compiled module: its name and operand shapes."""
    return name, tuple(tuple(int(d) for d in s) for s in shapes)


# -- attention --------------------------------------------------------------------------


def causal_share(q_len: int, kv_len: int, window: int = 0, tile: int = ATTENTION_TILE) -> float:
    """Of the `tile`-square tiles of a causal mask (query `i` sees keys up to `i`, and only
    the last `window` of them where a window is given), the share a flash kernel computes:
    every tile holding one pair it keeps."""
    rows, columns = math.ceil(q_len / tile), math.ceil(kv_len / tile)
    if not rows or not columns:
        return 0.0
    computed = 0
    for i in range(rows):
        last = min(i, columns - 1)
        first = max(0, (i * tile - window + 1) // tile) if window else 0
        computed += max(last - first + 1, 0)
    return computed / (rows * columns)


def attention_flops(pairs: float | int, head_dim: int, value_dim: int, step: str) -> float:
    """The matmul FLOPs of `pairs` query-key pairs in one step of a flash kernel:
    `forward`/`fwd`, `backward` (cuDNN's one kernel), `dq`, `dkv`, `dkv+dq`."""
    per_pair = {
        "forward": head_dim + value_dim,
        "fwd": head_dim + value_dim,
        "backward": 3 * head_dim + 2 * value_dim,
        "dq": 2 * head_dim + value_dim,
        "dkv": 2 * head_dim + 2 * value_dim,
        "dkv+dq": 3 * head_dim + 2 * value_dim,
    }[step]
    return 2.0 * pairs * per_pair


def _cudnn_attention(
    batch_heads: int,
    q_len: int,
    kv_len: int,
    head_dim: int,
    value_dim: int,
    mask: str,
    window: int,
    dropout: float,
    backward: bool,
) -> KernelCost:
    share = causal_share(q_len, kv_len, window) if "CAUSAL" in mask or window else 1.0
    step = "backward" if backward else "forward"
    pairs = batch_heads * q_len * kv_len * share
    return KernelCost(
        f"cuDNN attention {step}"
        + (f" ({mask.lower()} mask)" if mask != "NO_MASK" else "")
        + (f" (dropout {dropout:g})" if dropout else ""),
        attention_flops(pairs, head_dim, value_dim, step),
        efficiency=CUDNN_BACKWARD_EFFICIENCY if backward else CUDNN_FORWARD_EFFICIENCY,
    )


def cudnn_attention_eqn(eqn: Any) -> KernelCost:
    """cuDNN attention from its primitive: `q, k, v` first, laid out `BTNH` (layout 0) or
    `BNTH` (layout 1)."""
    q, k, v = (tuple(x.aval.shape) for x in eqn.invars[:3])
    params = eqn.params
    layout = int(getattr(params.get("layout"), "value", params.get("layout") or 0))
    sequence, heads = (1, 2) if layout == 0 else (2, 1)
    mask = getattr(params.get("mask_type"), "name", str(params.get("mask_type") or "NO_MASK"))
    return _cudnn_attention(
        q[0] * q[heads],
        q[sequence],
        k[sequence],
        q[-1],
        v[-1],
        mask,
        int(params.get("sliding_window_length") or 0),
        float(params.get("dropout_rate") or 0.0),
        _CUDNN_PRIMITIVES[eqn.primitive.name],
    )


def cudnn_attention_call(operands: Sequence[Any], attributes: str, target: str) -> KernelCost:
    """cuDNN attention from its custom call: the score matrix's `[batch, heads, queries,
    keys]` (`intermediate_tensor_shape`), the mask and dropout in its backend config."""
    shape = re.search(
        r'"intermediate_tensor_shape":\s*\{[^}]*?"dimensions":\s*\[([^\]]*)\]', attributes
    )
    dims = [int(d) for d in re.findall(r"\d+", shape.group(1))] if shape else []
    if len(dims) != 4 or len(operands) < 3 or None in operands[:3]:
        return unpriced(f"cuDNN custom call `{target}`", "its shapes could not be read")
    mask = re.search(r'"mask_type":\s*"(\w+)"', attributes)
    window = re.search(r'"sliding_window_length":\s*"?(\d+)', attributes)
    dropout = re.search(r'"dropout_rate":\s*([\d.eE+-]+)', attributes)
    return _cudnn_attention(
        dims[0] * dims[1],
        dims[2],
        dims[3],
        operands[0].dims[-1],
        operands[2].dims[-1],
        mask.group(1) if mask else "NO_MASK",
        int(window.group(1)) if window else 0,
        float(dropout.group(1)) if dropout else 0.0,
        "Backward" in target,
    )


# -- splash attention -------------------------------------------------------------------


def splash_cost(
    name: str,
    operands: Sequence[tuple[str, tuple[int, ...]]],
    block_mask: np.ndarray | None,
    metadata: Mapping[str, Any],
    outputs: int,
) -> KernelCost | None:
    """Splash attention from its operands `(dtype, shape)`: the block-mask tables first
    (integers), then `q, k, v`; `block_mask` the second table's values (None: not read);
    `metadata` its block sizes and layouts (`xprof_metadata`); `outputs` how many results
    it has (its `dkv` kernel also computes `dQ` when it has six). None: not splash."""
    match = _SPLASH.fullmatch(name)
    floating = [shape for dtype, shape in operands if dtype.startswith(("bf", "f"))]
    if match is None or len(floating) < 3 or len(floating[0]) < 3 or len(floating[1]) < 2:
        return None
    phase = match.group(2)
    q, k, v = floating[:3]
    head_minor = {"q": metadata.get("q_layout", 1) == 1, "v": metadata.get("v_layout", 1) == 1}
    head_dim = q[-1] if head_minor["q"] else q[-2]
    value_dim = v[-1] if head_minor["v"] else v[-2]
    heads, batch = q[-3], math.prod(q[:-3])
    rows, columns = _SPLASH_BLOCKS[phase]
    step = "dkv+dq" if phase == "dkv" and outputs >= 6 else phase
    kind = f"splash attention {phase} `{name}`"
    if block_mask is None or rows not in metadata or columns not in metadata:
        q_len = q[-2] if head_minor["q"] else q[-1]
        kv_len = k[-2] if metadata.get("k_layout", 1) == 1 else k[-1]
        pairs = batch * heads * q_len * kv_len
        note = "its block mask was not read: priced as a dense mask (an upper bound)"
        return KernelCost(kind, attention_flops(pairs, head_dim, value_dim, step), note=note)
    mask_heads = block_mask.shape[0] if block_mask.ndim == 3 else 1
    blocks = float(np.count_nonzero(block_mask)) * heads / mask_heads
    pairs = batch * blocks * metadata[rows] * metadata[columns]
    return KernelCost(kind, attention_flops(pairs, head_dim, value_dim, step))


def _splash_metadata(text: str) -> dict[str, int]:
    """The block sizes and layouts in a splash kernel's `xprof_metadata` JSON (escaped
    inside the compiled module's text, plain in the traced program's)."""
    return {k: int(v) for k, v in re.findall(r'\\?"(\w+)\\?":\s*(\d+)', text)}


# -- the traced program -----------------------------------------------------------------


def pallas_name(params: Mapping[str, Any]) -> str:
    name = params.get("name") or getattr(params.get("name_and_src_info"), "name", "")
    return str(name or "pallas_call")


def eqn_cost(eqn: Any, value_of: Callable[[Any], Any]) -> KernelCost | None:
    """The cost of a kernel equation of a traced program (cuDNN attention, a Pallas call,
    an FFI call or another opaque kernel); None for every other equation. `value_of`
    gives an operand's concrete value where the trace holds one (a splash block mask)."""
    prim = eqn.primitive.name
    if prim in _CUDNN_PRIMITIVES:
        return cudnn_attention_eqn(eqn)
    if prim == "pallas_call":
        return _pallas_eqn(eqn, value_of)
    if prim == "tpu_custom_call":
        declared = getattr(eqn.params.get("config"), "cost_estimate", None)
        name = str(eqn.params.get("kernel_name") or "tpu_custom_call")
        if declared:
            return KernelCost(
                f"Mosaic kernel `{name}`",
                float(declared["flops"]),
                float(declared["bytes_accessed"]),
            )
        return unpriced(f"Mosaic kernel `{name}`", "it declares no cost estimate")
    if prim == "ffi_call" and eqn.params.get("target_name") in HOST_KERNELS:
        # One pass: it reads its operands and writes its results (aliased to the state
        # it reads), as the host's other loops are priced, by their bytes.
        return KernelCost(HOST_KERNELS[eqn.params["target_name"]], host=True)
    if prim in _OPAQUE or prim.startswith(("dot_product_attention", "triton")):
        target = eqn.params.get("target_name") or eqn.params.get("name") or prim
        return unpriced(f"`{prim}` kernel `{target}`", "no rule prices it")
    return None


def _pallas_eqn(eqn: Any, value_of: Callable[[Any], Any]) -> KernelCost:
    name = pallas_name(eqn.params)
    declared = eqn.params.get("cost_estimate")
    if declared is not None:
        return KernelCost(
            f"Pallas kernel `{name}`", float(declared.flops), float(declared.bytes_accessed)
        )
    metadata = dict(eqn.params.get("metadata") or {})
    operands = [(str(v.aval.dtype), tuple(v.aval.shape)) for v in eqn.invars]
    mask = value_of(eqn.invars[1]) if len(eqn.invars) > 1 else None
    splash = splash_cost(
        name,
        operands,
        None if mask is None else np.asarray(mask),
        _splash_metadata(str(metadata.get("xprof_metadata", ""))),
        len(eqn.outvars),
    )
    return splash or unpriced(f"Pallas kernel `{name}`", "it declares no cost estimate")


def unpriced(kind: str, why: str) -> KernelCost:
    return KernelCost(kind, priced=False, note=why)


# -- the compiled module ----------------------------------------------------------------


def _operand(module: Module, computation: Computation, operand: tuple[str, int | None]):
    return next(arrays(module.operand_type(computation, operand)), None)


_THROUGH = frozenset({"copy", "copy-done", "copy-start", "bitcast", "get-tuple-element"})


def _constant(computation: Computation, name: str) -> np.ndarray | None:
    """The value of the constant an operand is (through copies and bitcasts), where the
    module's text prints it (XLA prints `{...}` for large ones)."""
    instruction = computation.by_name.get(name)
    while instruction is not None and instruction.opcode in (
        "copy", "copy-done", "copy-start", "bitcast", "get-tuple-element",
    ):  # fmt: skip
        instruction = (
            computation.by_name.get(instruction.operands[0][0]) if instruction.operands else None
        )
    if instruction is None or instruction.opcode != "constant" or "..." in instruction.argument:
        return None
    values = [int(v) for v in re.findall(r"-?\d+", instruction.argument)]
    return np.asarray(values)


def _call_name(instruction: Instruction) -> str:
    """A Pallas kernel's name: the scope its call is traced under (`.../name/pallas_call`),
    or its instruction's name (XLA:TPU names it after the kernel)."""
    parts = instruction.op_name.split("/")
    if len(parts) >= 2 and parts[-1] == "pallas_call":
        return parts[-2]
    return re.sub(r"\.\d+$", "", instruction.name)


def _traced_cost(
    table: Mapping[Key, KernelCost], name: str, shapes: Sequence[Sequence[int]]
) -> KernelCost | None:
    """What the traced program says of this kernel: by its name and operand shapes, or,
    where the compiled call is named after the scope it is called from (a kernel called
    directly in the step: `jit(step)/pallas_call`), by its operand shapes alone when one
    traced kernel has them."""
    key = kernel_key(name, shapes)
    if key in table:
        return table[key]
    same = {cost for (_, traced), cost in table.items() if traced == key[1]}
    return same.pop() if len(same) == 1 else None


def custom_call_cost(
    module: Module,
    computation: Computation,
    instruction: Instruction,
    table: Mapping[Key, KernelCost] | None = None,
) -> KernelCost:
    """The cost of a `custom-call` that runs a kernel: by its target's rule, by what the
    traced program says of it (`table`: Pallas kernels by name and operand shapes), by the
    cost estimate its backend config carries, or unpriced."""
    target = instruction.attribute("custom_call_target") or ""
    if target in HOST_KERNELS:  # its operands and results, at the host's bandwidth
        return KernelCost(HOST_KERNELS[target], host=True)
    operands = [_operand(module, computation, o) for o in instruction.operands]
    if target.startswith("__cudnn$fmha") and "F8" not in target:
        return cudnn_attention_call(operands, instruction.attributes, target)
    name = _call_name(instruction)
    shapes = [a.dims if a is not None else () for a in operands]
    traced = _traced_cost(table or {}, name, shapes)
    if traced is not None:
        return traced
    declared = re.search(
        r'"cost_estimate":\s*\{"flops":\s*"?(\d+)"?,\s*"transcendentals":\s*"?\d+"?,\s*'
        r'"bytes_accessed":\s*"?(\d+)',
        instruction.attributes,
    )
    if declared:
        return KernelCost(
            f"Pallas kernel `{name}`", float(declared.group(1)), float(declared.group(2))
        )
    if target == "tpu_custom_call":
        mask = _constant(computation, instruction.operands[1][0]) if len(operands) > 1 else None
        table_type = operands[1] if len(operands) > 1 else None
        if mask is not None:
            fits = table_type is not None and mask.size == table_type.elements
            mask = mask.reshape(table_type.dims) if fits and table_type else None
        splash = splash_cost(
            name,
            [(a.dtype, a.dims) if a is not None else ("", ()) for a in operands],
            mask,
            _splash_metadata(instruction.attributes),
            len(instruction.type) if isinstance(instruction.type, tuple) else 1,
        )
        if splash is not None:
            return splash
        return unpriced(f"Pallas kernel `{name}`", "it declares no cost estimate")
    if target in ("mosaic_gpu", "mosaic_gpu_v2") or "triton" in target:
        return unpriced(f"Pallas kernel `{name}`", "it declares no cost estimate")
    return unpriced(f"custom call `{target}`", "no rule prices it")
