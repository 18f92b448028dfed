"""Known XLA:GPU faults, caught in a target's compile before they cost a run.

- **Reversed offsets of offloaded scan residuals** (openxla/xla#46231, fixed by #46308):
  XLA:GPU's `DynamicSliceAnnotator` annotated a slice of host memory that a scan's
  backward loop reads or writes at `n-1-i` (an offloaded residual, a host-resident layer's
  weights or its gradient) with the forward walk (`i`): wrong gradients, no error, right
  memory figures. Measured deviceless for the H100 (the seed model under
  `offload_activations`, `offload_params` and `hybrid`): jaxlib 0.10.2 and 0.11.0 annotate
  them forward; 0.11.1, 0.11.2, 0.12.0 and 0.12.0.1 rightly. Found from the compiled
  program itself (`hlo_slices`): each compile for a GPU target is checked, and a program
  the release miscompiles gets a `CompilerFaultWarning` naming the release, the slices and
  the releases to install (a plan's memory is still right; running it on a GPU with this
  release is not).
- **The annotator fails the compile** (openxla/xla#49299, open): a slice in a loop whose
  offset comes out of a nested loop (`jnp.searchsorted` or `jnp.interp` with one query
  inside a scan) stops the compile with HloEvaluator's "Failed to evaluate instruction
  ... depends on infeed or parameters". Where the same program compiles with the
  annotator switched off, that is this fault, and a `CompilerFaultError` says so with the
  workarounds instead of XLA's text. Every release from 0.10.2 to 0.12.0.1 has it.
"""

import importlib.metadata
import re
import warnings
from typing import Any

from .hlo_slices import misannotated_host_slices
from .targets import Target

# Measured deviceless (the seed model's offloaded scan compiled for the H100).
REVERSED_OFFSET_RELEASES = ("0.10.2", "0.11.0")
REVERSED_OFFSET_FIXED = ("0.11.1", "0.11.2", "0.12.0", "0.12.0.1")
ANNOTATOR = "dynamic-slice-annotator"

_ANNOTATOR_FAILED = re.compile(
    r"Failed to evaluate instruction \(([^)]*)\) since it depends on infeed or parameters "
    r"to its parent computation \(([^)]*)\)"
)

_REVERSED = (
    "XLA:GPU of jaxlib {release} miscompiles this program for target {target!r}: {slices}. "
    "Each is a slice of host memory (an offloaded scan residual, a host-resident layer's "
    "weights or their gradient) in a loop that walks the layers from the last, annotated "
    "with the forward walk: on a GPU it reads or writes the wrong layer, so the gradients "
    "are wrong, with no error and memory figures that look right (openxla/xla#46231, "
    "fixed by openxla/xla#46308). jaxlib 0.10.2 and 0.11.0 have this fault; 0.11.1, "
    "0.11.2, 0.12.0 and 0.12.0.1 do not. The memory figures of this compile are right; "
    "before running it on a GPU, install 0.11.1 or later "
    "(`pip install -U 'jax[cuda12]>=0.11.1'`), or keep the scan's activations and "
    "parameters on the device there (`ox.activations(name='save')` or `'remat'`, "
    "`ox.field(memory='device')`)."
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


class CompilerFaultWarning(UserWarning):
    """The installed XLA:GPU miscompiles the program: a known fault, named with the fix."""


class CompilerFaultError(RuntimeError):
    """The installed XLA:GPU fails to compile the program through a known fault."""


def installed_release() -> str:
    """The jaxlib release whose compilers compile the program (the CUDA plugin is pinned
    to it)."""
    return importlib.metadata.version("jaxlib")


def warn_if_miscompiled(text: str, target: Target) -> None:
    """Warn when the compiled HLO `text` for a GPU `target` carries the reversed-offset
    fault (openxla/xla#46231)."""
    if target.platform != "cuda":
        return
    found = misannotated_host_slices(text)
    if found:
        slices = "; ".join(str(slice_) for slice_ in found)
        message = _REVERSED.format(release=installed_release(), target=target.name, slices=slices)
        warnings.warn(message, CompilerFaultWarning, stacklevel=2)


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


def compile_checked(lowered: Any, target: Target) -> Any:
    """`lowered.compile()`, with the known XLA:GPU faults said in our words: the
    annotator's failed compile raised as a `CompilerFaultError`, a miscompiled program
    warned of (`CompilerFaultWarning`)."""
    try:
        compiled = lowered.compile()
    except Exception as error:
        ours = annotator_fault(error, lowered, target)
        if ours is None:
            raise
        raise ours from None
    warn_if_miscompiled(compiled.as_text() or "", target)
    return compiled
