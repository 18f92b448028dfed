"""Known XLA:GPU faults met in a target's compile (the releases, the checker and the
exception types: `_base/compiler_faults`).

- **Reversed offsets of offloaded scan residuals** (openxla/xla#46231, fixed by #46308):
  a deviceless compile's memory figures are right whatever the release, so a report
  stays quiet; `faults_of` gives the verdict on its compiled program
  (`MemoryReport.compiler_faults`). Running it is what goes wrong: `ox.filter_jit`
  refuses to on a GPU with an affected release (`_jit/miscompiled`).
- **The annotator fails the compile** (openxla/xla#49299, open): a slice in a loop whose
  offset comes out of a nested loop (`jnp.searchsorted` or `jnp.interp` with one query
  inside a scan) stops the compile with HloEvaluator's "Failed to evaluate instruction
  ... depends on infeed or parameters". Where the same program compiles with the
  annotator switched off, that is this fault, and a `CompilerFaultError` says so with the
  workarounds instead of XLA's text. Every release from 0.10.2 to 0.12.0.1 has it.
- **Triton finds no tile for a small matmul**: jaxlib 0.10.2's XLA:GPU stops with
  "Couldn't find output tile sizes that satisfy hlo: ... dot" on a dot with a dimension
  of 2, such as a LoRA adapter's rank-2 gradient (`f32[14,2]`), in plain Equinox too;
  0.12.0.1 compiles it. Where the program compiles with Triton's GEMMs switched off,
  a `CompilerFaultError` names the dot and the fixes.
"""

import re
from typing import Any

from .._base.compiler_faults import (
    CompilerFaultError,
    installed_release,
    reversed_offsets,
    reversed_offsets_message,
)
from .targets import Target

ANNOTATOR = "dynamic-slice-annotator"

_ANNOTATOR_FAILED = re.compile(
    r"Failed to evaluate instruction \(([^)]*)\) since it depends on infeed or parameters "
    r"to its parent computation \(([^)]*)\)"
)

_ANNOTATOR_FAULT = (
    "XLA:GPU of jaxlib {release} cannot compile this program for target {target!r}: its "
    "DynamicSliceAnnotator could not evaluate the offset of a slice in a loop "
    "(`{instruction}` in `{computation}`), an offset computed by a nested loop such as "
    "`jnp.searchsorted` or `jnp.interp` with a single query inside a scan "
    "(openxla/xla#49299, not fixed in any release up to 0.12.0.1). The same program "
    "compiles with the annotator switched off. Fixes: look up two queries at a time (a "
    "gather, not a slice: `table[jnp.searchsorted(grid, jnp.stack([t, t]))][0]`), or "
    "switch the pass off: `XLA_FLAGS=--xla_disable_hlo_passes={annotator}` before JAX "
    "starts. XLA said: {said}"
)


TRITON_GEMM = "xla_gpu_enable_triton_gemm"

_NO_TILE = re.compile(r"Couldn't find output tile sizes that satisfy hlo: (%\S+ = \S+) dot\((.*)")
_OP_NAME = re.compile(r'op_name="([^"]*)"')

_NO_TILE_FAULT = (
    "XLA:GPU of jaxlib {release} cannot compile this program for target {target!r}: its "
    "Triton GEMM emitter found no tile sizes for the matrix product `{dot}` (from "
    "`{op_name}`), a product with a small dimension such as a rank-2 LoRA adapter's. "
    "The same program compiles with Triton's GEMMs switched off, and jaxlib 0.12.0.1 "
    'compiles it as it is. Fixes: `pip install -U "jax>=0.12.0.1"`, or switch Triton\'s '
    "GEMMs off: `XLA_FLAGS=--{flag}=false` before JAX starts. XLA said: {said}"
)


def faults_of(compiled: Any, target: Target) -> tuple[str, ...]:
    """The known faults of the program `compiled` for `target`, a sentence each (empty
    when none): a GPU target's slices of host memory annotated against their walk
    (openxla/xla#46231). Nothing is warned: the memory figures are right."""
    if target.platform != "cuda":
        return ()
    found = reversed_offsets(compiled.as_text() or "")
    if not found:
        return ()
    return (reversed_offsets_message(found, f"target {target.name!r}"),)


def annotator_fault(error: BaseException, lowered: Any, target: Target) -> Exception | None:
    """Our error for XLA:GPU's failed compile `error` where it is openxla/xla#49299 (the
    program compiles with the annotator off); None where it is not."""
    match = _ANNOTATOR_FAILED.search(str(error))
    if target.platform != "cuda" or match is None:
        return None
    try:
        lowered.compile(compiler_options={"xla_disable_hlo_passes": ANNOTATOR})
    except Exception:
        return None  # something else fails too: XLA's own error says more
    instruction, computation = match.groups()
    return CompilerFaultError(
        _ANNOTATOR_FAULT.format(
            release=installed_release(),
            target=target.name,
            instruction=instruction,
            computation=computation,
            annotator=ANNOTATOR,
            said=match.group(0),
        )
    )


def no_tile_fault(error: BaseException, lowered: Any, target: Target) -> Exception | None:
    """Our error for XLA:GPU's failed compile `error` where Triton found no tile for a
    small dot and the program compiles without Triton's GEMMs; None where it is not."""
    match = _NO_TILE.search(str(error))
    if target.platform != "cuda" or match is None:
        return None
    try:
        lowered.compile(compiler_options={TRITON_GEMM: False})
    except Exception:
        return None  # something else fails too: XLA's own error says more
    dot, rest = match.groups()
    op_name = _OP_NAME.search(rest)
    return CompilerFaultError(
        _NO_TILE_FAULT.format(
            release=installed_release(),
            target=target.name,
            dot=dot,
            op_name=op_name.group(1) if op_name else "unknown",
            flag=TRITON_GEMM,
            said=str(error).splitlines()[0][:300],
        )
    )


def compile_checked(lowered: Any, target: Target, **options: Any) -> Any:
    """`lowered.compile(**options)`, with XLA:GPU's known failed compiles (the
    annotator's, openxla/xla#49299; Triton's untileable small dot) raised as a
    `CompilerFaultError` in our words."""
    try:
        return lowered.compile(**options)
    except Exception as error:
        ours = annotator_fault(error, lowered, target) or no_tile_fault(error, lowered, target)
        if ours is None:
            raise
        raise ours from None
