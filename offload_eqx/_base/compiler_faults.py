"""Known XLA:GPU faults: which jaxlib releases have them, how a compiled program shows
one, and the exception types that name them.

- **Reversed offsets of offloaded scan residuals** (openxla/xla#46231, fixed by #46308):
  XLA:GPU's `DynamicSliceAnnotator` annotated a slice of host memory that a scan's
  backward loop reads or writes at `n-1-i` (an offloaded residual, a host-resident layer's
  weights or its gradient) with the forward walk (`i`): wrong gradients, no error, right
  memory figures. Measured deviceless for the H100 (the seed model under
  `offload_activations`, `offload_params` and `hybrid`): jaxlib 0.10.2 and 0.11.0 annotate
  them forward; 0.11.1, 0.11.2, 0.12.0 and 0.12.0.1 rightly. Found from the compiled
  program itself (`hlo_slices`). A memory report is right whatever the release
  (`MemoryReport.compiler_faults` holds the verdict); `ox.filter_jit` refuses to run such
  a program on a GPU (`_jit/miscompiled`).
- **The annotator fails the compile** (openxla/xla#49299, open): said as our
  `CompilerFaultError` by the targets' compiles (`_targets/compiler_faults`).
"""

import importlib.metadata

from .hlo_slices import Misannotated, misannotated_host_slices

# Measured deviceless (the seed model's offloaded scan compiled for the H100).
REVERSED_OFFSET_RELEASES = ("0.10.2", "0.11.0")
REVERSED_OFFSET_FIXED = ("0.11.1", "0.11.2", "0.12.0", "0.12.0.1")
GPU_PLATFORMS = ("gpu", "cuda")
FIX = 'pip install -U "jax[cuda12]>=0.11.1"'

_REVERSED = (
    "XLA:GPU of jaxlib {release} miscompiles this program for {where}: {slices}. "
    "Each is a slice of host memory (an offloaded scan residual, a host-resident layer's "
    "weights or their gradient) in a loop that walks the layers from the last, annotated "
    "with the forward walk: on a GPU it reads or writes the wrong layer, so the gradients "
    "are wrong, with no error (openxla/xla#46231, fixed by openxla/xla#46308). jaxlib "
    "0.10.2 and 0.11.0 have this fault; 0.11.1, 0.11.2, 0.12.0 and 0.12.0.1 do not. "
    "Memory figures are right; to run it on a GPU, install 0.11.1 or later "
    "(`{fix}`), or keep the scan's activations and parameters on the device there "
    "(`ox.activations(name='save')` or `'remat'`, `ox.field(memory='device')`)."
)


class CompilerFaultError(RuntimeError):
    """The installed XLA:GPU miscompiles the program or fails to compile it through a
    known fault, named with the release and the fix.

    Raised by a step of `ox.filter_jit` before it runs on a GPU whose jaxlib (0.10.2,
    0.11.0) would read or write an offloaded scan's slices of host memory in the wrong
    order (openxla/xla#46231: wrong gradients, no error), and by a compile for a GPU
    target that XLA's slice annotator fails (openxla/xla#49299). Nothing has run and no
    donated argument is consumed when it is raised. The known limits page lists each
    fault with its releases."""


def installed_release() -> str:
    """The jaxlib release whose compilers compile the program (the CUDA plugin is pinned
    to it)."""
    return importlib.metadata.version("jaxlib")


def has_reversed_offsets(release: str) -> bool:
    """Whether jaxlib `release` annotates a backward loop's host slices forward."""
    return release in REVERSED_OFFSET_RELEASES


def reversed_offsets(text: str) -> list[Misannotated]:
    """The slices of host memory the compiled HLO `text` annotates against their walk."""
    return misannotated_host_slices(text)


def reversed_offsets_message(found: list[Misannotated], where: str) -> str:
    """The sentence naming the fault of the slices `found` in the program for `where`
    (`"target 'h100'"`, `"this machine's GPU"`), the release and the fix."""
    slices = "; ".join(str(slice_) for slice_ in found)
    return _REVERSED.format(release=installed_release(), where=where, slices=slices, fix=FIX)
