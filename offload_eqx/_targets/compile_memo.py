"""Each distinct program is compiled for a target once per process.

`ox.fit` compiles the plans it ranks, and a user then asks `ox.estimate` or
`ox.memory_report` about the plan it chose, or fits the same step under another budget:
the same program, compiled again (XLA:GPU spends seconds on each, most of them in its
fusion pass, whatever the shapes). A compile depends only on the lowered module (its text
holds the shapes, memories, shardings and donation), the options it is compiled with and
the target's compiler, so the compiled program is kept under those, with the compiler's
log lines, and handed out again. The memory reports and the simulation only read it.

JAX's persistent compilation cache (`JAX_COMPILATION_CACHE_DIR`, which many users set)
cannot hold a program compiled without its device: JAX writes it, and a later process
that reads it back warns "Error reading persistent compilation cache entry ...
PjRtCompiler must be constructed with a Client" and compiles again. A compile for a
target other than the CPU therefore writes nothing there (and says nothing of an entry
written by an older version); the CPU's compiles use the cache as any JAX program does.
"""

import collections
import contextlib
import hashlib
import warnings
from collections.abc import Iterator
from typing import Any

from .._base.jax_private import persistent_cache_min_compile_time_secs
from .._host.overlap_schedule import overlapped
from .._host.remat_limit import within_capacity
from .compiler_faults import compile_checked
from .devices import attached_devices
from .targets import Target

# The most recent compiled programs are kept (each holds its optimised HLO: 0.3 MB of text
# for a scanned decoder's training step), enough for two `ox.fit` searches of 12 compiles.
KEEP = 32

_compiled: collections.OrderedDict[tuple, tuple[Any, tuple[str, ...]]] = collections.OrderedDict()


def _key(lowered: Any, target: Target, options: dict[str, Any] | None) -> tuple:
    text = lowered.as_text()
    digest = hashlib.sha256(text.encode()).hexdigest()
    # The capacity too: a delayed host update's schedule is chosen within it (`overlapped`).
    compiler = (
        target.platform,
        target.topology,
        target.config,
        target.chips_per_host,
        target.capacity,
        target.speeds.host_memory if target.speeds is not None else None,
    )
    return (digest, compiler, tuple(sorted((options or {}).items())))


def compile_once(
    lowered: Any,
    target: Target,
    options: dict[str, Any] | None,
    capture: Any,
    log: list[str],
) -> Any:
    """`lowered.compile()`, or the program compiled before from the same module, options
    and compiler. The compiler's log lines (caught by `capture(lines)`, a context
    manager) go into `log` on every call."""
    key = _key(lowered, target, options)
    if key in _compiled:
        _compiled.move_to_end(key)
    else:
        caught: list[str] = []
        with capture(caught), _kept_out_of_the_persistent_cache_if_deviceless(target):
            compiled = compile_checked(lowered, target)  # openxla/xla#49299 in our words
            again = lambda o: compile_checked(lowered, target, compiler_options=o)  # noqa: E731
            # Over the capacity, XLA's own slop factor where it needs less.
            compiled, kept = within_capacity(compiled, options, again, target.capacity)
            # A delayed host update spans the step on XLA:GPU.
            host = target.speeds.host_memory if target.speeds is not None else None
            compiled = overlapped(compiled, kept, again, target.capacity, host)
        _compiled[key] = (compiled, tuple(caught))
        while len(_compiled) > KEEP:
            _compiled.popitem(last=False)
    compiled, lines = _compiled[key]
    log.extend(lines)
    return compiled


@contextlib.contextmanager
def _kept_out_of_the_persistent_cache_if_deviceless(target: Target) -> Iterator[None]:
    """For a target compiled without its device: nothing written to JAX's persistent
    compilation cache (the least compile time it writes is set to infinity), and the
    warning about reading an entry an earlier deviceless compile wrote kept off the user's
    terminal. A program compiled for this machine's own accelerator (the target's chip is
    attached) is an ordinary compile and is cached as any other."""
    if not target.deviceless or attached_devices(target) is not None:
        yield
        return
    with (
        warnings.catch_warnings(),
        persistent_cache_min_compile_time_secs(float("inf")),
    ):
        warnings.filterwarnings(
            "ignore", message="Error reading persistent compilation cache entry"
        )
        yield
