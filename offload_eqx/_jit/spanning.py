"""On a GPU, a step with a delayed host update compiled so that the update spans the step
(`_host/overlap_schedule`), as the deviceless compiles that `ox.estimate` and
`ox.memory_report` price are.

XLA:GPU needs the names of the delayed host calls, which only a compile gives: at its
first call the entry is compiled ahead (`jitted.lower(...).compile()`), the names read,
and the step compiled again with the profile naming them; the call that follows reuses
that executable (JAX keeps it under the jitted function), nothing is compiled a third
time. The spanning program is kept only where it fits the device's memory (its
allocator's limit) or needs no more than the first (`overlapped`). Elsewhere (the CPU, a
TPU, a step without a delayed host update) the entry is left as compiled.
"""

from collections.abc import Callable
from typing import Any

from .._host.overlap_schedule import overlapped, wants_overlap
from .miscompiled import runs_on_gpu


def span_delayed_update(
    entry: Any, options: dict[str, Any] | None, rejit: Callable[[dict[str, Any]], Any]
) -> Any:
    """`entry` (a `Compilation`) whose first call on a GPU compiles the spanning program
    where `options` ask for the overlap; `rejit(options)` is the entry's `jax.jit` with
    other compile options. Untouched elsewhere."""
    if options and wants_overlap(options) and runs_on_gpu(entry.plan.device):
        entry.jitted = _SpanningAtFirstCall(entry, options, rejit)
    return entry


def device_capacity(device: Any) -> int | None:
    """The bytes the device's allocator may hand out (None where it does not say)."""
    stats = getattr(device, "memory_stats", lambda: None)() or {}
    limit = stats.get("bytes_limit")
    return int(limit) if limit else None


class _SpanningAtFirstCall:
    """The entry's `jax.jit`, compiled twice at its first call (the module docstring);
    the entry then calls the chosen `jax.jit` directly."""

    def __init__(self, entry: Any, options: dict[str, Any], rejit: Callable[..., Any]):
        self.entry, self.jitted, self.options, self.rejit = entry, entry.jitted, options, rejit

    def __getattr__(self, name: str) -> Any:  # `trace`, `lower`: the first program's
        return getattr(self.jitted, name)

    def __call__(self, *dynamic: Any) -> Any:
        chosen = {}

        def recompile(options: dict[str, Any]) -> Any:
            chosen["jitted"] = self.rejit(options)
            return chosen["jitted"].lower(*dynamic).compile()

        first = self.jitted.lower(*dynamic).compile()
        capacity = device_capacity(self.entry.plan.device)
        kept = overlapped(first, self.options, recompile, capacity)
        self.entry.jitted = chosen["jitted"] if kept is not first else self.jitted
        return self.entry.jitted(*dynamic)
