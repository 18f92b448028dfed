"""A step the installed XLA:GPU is known to miscompile, refused before it runs on a GPU.

jaxlib 0.10.2 and 0.11.0 annotate the slices of host memory in a scan's backward loop
with the forward walk (openxla/xla#46231, fixed by #46308): an offloaded scan's gradients
come out wrong on a GPU, with no error. On such a release, an entry compiled for GPU
devices is compiled ahead at its first call (`jitted.lower(...).compile()`: the call that
follows reuses that executable, nothing is compiled twice), its program checked
(`_base/compiler_faults`), and a miscompiled one refused with a `CompilerFaultError`
before anything runs or any argument is donated. Elsewhere (a fixed release, the CPU, a
TPU) the entry is left as compiled: nothing is added to any call. A step compiled ahead
by the user (`step.lower(...).compile()`, `aot`) is checked when compiled and refused when
called.
"""

from collections.abc import Sequence
from typing import Any

import numpy as np

from .._base.compiler_faults import (
    GPU_PLATFORMS,
    CompilerFaultError,
    has_reversed_offsets,
    installed_release,
    reversed_offsets,
    reversed_offsets_message,
)

_REFUSED = (
    "{caller} was not run (nothing ran, no argument was donated, the arrays passed are "
    "intact). The host buffers it would walk the wrong way: {buffers}. {fault}"
)
# HLO's names of the element types a leaf can have.
_HLO_TYPES = {"float32": "f32", "bfloat16": "bf16", "float16": "f16", "float64": "f64"}
_HLO_TYPES |= {"int32": "s32", "int64": "s64", "int8": "s8", "uint8": "u8", "uint32": "u32"}


def runs_on_gpu(device: Any) -> bool:
    """Whether the entry's devices (`device`, the plan's first) are GPUs."""
    return device.platform in GPU_PLATFORMS


def affected(entry: Any) -> bool:
    """Whether `entry` (a `Compilation`) runs on GPUs with a jaxlib release known to
    miscompile offloaded scans: its program is checked before it runs."""
    return runs_on_gpu(entry.plan.device) and has_reversed_offsets(installed_release())


def refuse_miscompiled(entry: Any, caller: str) -> Any:
    """`entry` with its first call checked where it is `affected`; else untouched."""
    if affected(entry):
        entry.jitted = _CheckedAtFirstCall(entry, caller)
    return entry


def refusal(compiled: Any, entry: Any, caller: str) -> str | None:
    """Why the program `compiled` for `entry` must not run (the fault, the host buffers
    it walks the wrong way, the fix); None when its slices of host memory are right."""
    found = reversed_offsets(compiled.as_text() or "")
    if not found:
        return None
    fault = reversed_offsets_message(found, "this machine's GPU")
    buffers = host_buffers(found, entry.plan.leaves)
    return _REFUSED.format(caller=caller, buffers=buffers, fault=fault)


class _CheckedAtFirstCall:
    """The entry's `jax.jit`, compiled ahead and checked at its first call; once the
    program passes, the entry calls the `jax.jit` itself again."""

    def __init__(self, entry: Any, caller: str):
        self.entry, self.jitted, self.caller = entry, entry.jitted, caller

    def __call__(self, *dynamic: Any) -> Any:
        refused = refusal(self.jitted.lower(*dynamic).compile(), self.entry, self.caller)
        if refused is not None:
            raise CompilerFaultError(refused)
        self.entry.jitted = self.jitted  # checked: later calls go straight to jit
        return self.jitted(*dynamic)

    def __getattr__(self, name: str) -> Any:  # `.lower`, `.trace` as the `jax.jit` has
        return getattr(self.jitted, name)


def _hlo_type(leaf: Any) -> str:
    element = _HLO_TYPES.get(np.dtype(leaf.dtype).name, np.dtype(leaf.dtype).name)
    return f"{element}[{','.join(map(str, leaf.shape))}]"


def host_buffers(found: Sequence[Any], leaves: Sequence[Any]) -> str:
    """Each host buffer the misannotated slices `found` walk, with the host-resident
    argument leaves of its type (the leaf or its gradient); one no argument has is an
    offloaded activation."""
    by_type: dict[str, list[str]] = {}
    for leaf in leaves:
        if leaf.memory == "pinned_host":
            by_type.setdefault(_hlo_type(leaf), []).append(f"`{leaf.path}`")
    described = []
    for buffer in dict.fromkeys(slice_.buffer for slice_ in found):
        paths = by_type.get(buffer)
        what = " or ".join(paths) + " (or its gradient)" if paths else "an offloaded activation"
        described.append(f"`{buffer}` ({what})")
    return "; ".join(described)
