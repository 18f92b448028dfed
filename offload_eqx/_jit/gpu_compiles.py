"""On a GPU, a step compiled as the deviceless compiles that `ox.estimate` and
`ox.memory_report` price it are: two choices need a compile to make.

- A step that holds host memory is compiled with XLA:GPU's slop factor raised
  (`_host/remat_limit`), so that its rematerialization does not charge host bytes to the
  device; where that program needs more device memory than the device has, it is
  compiled again with XLA's own factor and kept where that needs less
  (`within_capacity`).
- A step with a delayed host update is compiled again with the profile that makes the
  update span the step (`_host/overlap_schedule`), kept where it fits.

Both need the first program: at its first call the entry is compiled ahead
(`jitted.lower(...).compile()`), the choices made, and the chosen `jax.jit` called; the
call reuses the executable compiled ahead (JAX keeps it under the jitted function).
Elsewhere (the CPU, a TPU, a step that needs neither) the entry is left as compiled and
nothing is added to any call.
"""

import os
from collections.abc import Callable
from typing import Any

from .._host.overlap_schedule import overlapped, wants_overlap
from .._host.remat_limit import SLOP_OPTION, within_capacity
from .miscompiled import runs_on_gpu


def chosen_at_first_call(
    entry: Any, options: dict[str, Any] | None, rejit: Callable[[dict[str, Any]], Any]
) -> Any:
    """`entry` (a `Compilation`) whose first call on a GPU makes the choices above where
    `options` call for one; `rejit(options)` is the entry's `jax.jit` with other compile
    options. Untouched elsewhere."""
    if not options or not runs_on_gpu(entry.plan.device):
        return entry
    if SLOP_OPTION in options or wants_overlap(options):
        entry.jitted = _ChosenAtFirstCall(entry, options, rejit)
    return entry


def device_capacity(device: Any) -> int | None:
    """The bytes the device's allocator may hand out (None where it does not say)."""
    stats = getattr(device, "memory_stats", lambda: None)() or {}
    limit = stats.get("bytes_limit")
    return int(limit) if limit else None


def host_memory() -> int | None:
    """This machine's physical memory (None where the system does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


class _ChosenAtFirstCall:
    """The entry's `jax.jit`, compiled ahead at its first call and the choices made (the
    module docstring); the entry then calls the chosen `jax.jit` directly."""

    def __init__(self, entry: Any, options: dict[str, Any], rejit: Callable[..., Any]):
        self.entry, self.jitted, self.options, self.rejit = entry, entry.jitted, options, rejit

    def __getattr__(self, name: str) -> Any:  # `trace`, `lower`: the first program's
        return getattr(self.jitted, name)

    def __call__(self, *dynamic: Any) -> Any:
        jits = {}

        def recompile(options: dict[str, Any]) -> Any:
            jitted = self.rejit(options)
            compiled = jitted.lower(*dynamic).compile()
            jits[id(compiled)] = jitted
            return compiled

        first = self.jitted.lower(*dynamic).compile()
        jits[id(first)] = self.jitted
        capacity = device_capacity(self.entry.plan.device)
        kept, options = within_capacity(first, self.options, recompile, capacity)
        kept = overlapped(kept, options, recompile, capacity, host_memory())
        self.entry.jitted = jits[id(kept)]
        return self.entry.jitted(*dynamic)
