"""Every private name of JAX that offload_eqx uses, in one place.

JAX's private modules (`jax._src...`) change between releases without notice. Each name
below says what it is, why no public name serves, and, where one does, which public name
is used instead. The module looks each up when offload_eqx is imported: a JAX release
that removes one fails here, with a message naming it, the installed JAX and the
versions offload_eqx was checked on, never as an `AttributeError` inside a compile.

Checked on jax/jaxlib 0.10.2 (Python 3.11) and 0.12.0.1 (Python 3.12, 3.13)
(`CHECKED`; `docs/limits.md`, "JAX versions", lists them with their users). Public
replacements in use: `jax.extend.core.set_current_trace` (not `core.set_current_trace`),
`jax.Array.committed` (not `_committed`).
"""

import contextlib
import importlib
from collections.abc import Iterator
from typing import Any

import jax

CHECKED = ("0.10.2", "0.12.0.1")


class MissingInternal(ImportError):
    """A private name of JAX that offload_eqx needs is gone from the installed JAX."""


def _lookup(paths: tuple[str, ...], what: str) -> Any:
    """The first of `paths` ("module:attribute") that the installed JAX has."""
    for path in paths:
        module_name, _, attribute = path.partition(":")
        try:
            return getattr(importlib.import_module(module_name), attribute)
        except (ImportError, AttributeError):
            continue
    names = " or ".join(f"`{p.replace(':', '.')}`" for p in paths)
    raise MissingInternal(
        f"offload_eqx needs {names} ({what}), which jax {jax.__version__} does not have. "
        f"offload_eqx was checked on jax {' and '.join(CHECKED)}: install one of those "
        f"(`pip install 'jax=={CHECKED[-1]}'`), or report the new JAX release."
    )


_PE = "jax._src.interpreters.partial_eval"
_MLIR = "jax._src.interpreters.mlir"

# The primitive behind `compute_on` (a context manager in 0.10, a function transform from
# 0.11), bound here with a jaxpr of our own and its `compiler_options_json` (0.10.1 on):
# no public API binds a host computation from a jaxpr.
compute_on_p: Any = _lookup(("jax._src.compute_on:compute_on_p",), "the host computation")
# The context that marks the equations traced inside it as host computation.
extend_compute_type: Any = _lookup(
    ("jax._src.compute_on:extend_compute_type",), "the host computation's trace context"
)
# The compute type `extend_compute_type` set for this thread (None outside one): whether
# the code being traced is a host computation's.
_compute_type_state: Any = _lookup(
    ("jax._src.config:compute_on_context_manager",), "the compute type being traced for"
)
# Dead-code elimination of a jaxpr, and the split of a closed jaxpr's constants: what
# `jax.make_jaxpr` does inside, with no public name.
dce_jaxpr: Any = _lookup((f"{_PE}:dce_jaxpr",), "dead-code elimination of a jaxpr")
dce_jaxpr_consts: Any = _lookup((f"{_PE}:dce_jaxpr_consts",), "dead-code elimination")
separate_consts: Any = _lookup((f"{_PE}:separate_consts",), "a jaxpr's constants")
# The trace of `jax.jit` and of loop bodies: whether a trace encloses a call.
DynamicJaxprTrace: Any = _lookup((f"{_PE}:DynamicJaxprTrace",), "the jaxpr trace")
# The current trace (read only; set with the public `jax.extend.core.set_current_trace`).
_trace_context: Any = _lookup(("jax._src.core:trace_ctx",), "the current trace")
# The concrete mesh a `with jax.set_mesh(...)` context holds, thread-locally; in
# `jax._src.config` up to 0.10, `jax._src.mesh` from 0.11.
_device_context: Any = _lookup(
    ("jax._src.mesh:device_context", "jax._src.config:device_context"), "the context's mesh"
)
# The thread-local form of `jax_persistent_cache_min_compile_time_secs` (a context
# manager); `jax.config.update` sets it for every thread.
persistent_cache_min_compile_time_secs: Any = _lookup(
    ("jax._src.config:persistent_cache_min_compile_time_secs",),
    "the persistent cache's threshold, for one compile",
)
# The lowering rules JAX registered, by platform and in common, and the constant they
# build: read to wrap the callbacks' rules for deviceless GPU compiles.
lowerings: Any = _lookup((f"{_MLIR}:_lowerings",), "JAX's lowering rules")
platform_specific_lowerings: Any = _lookup(
    (f"{_MLIR}:_platform_specific_lowerings",), "JAX's lowering rules per platform"
)
full_like_aval: Any = _lookup((f"{_MLIR}:full_like_aval",), "a constant in a lowering")
# The four primitives a host callback binds.
CALLBACK_PRIMITIVES: tuple = (
    _lookup(("jax._src.callback:pure_callback_p",), "`jax.pure_callback`'s primitive"),
    _lookup(("jax._src.callback:io_callback_p",), "`io_callback`'s primitive"),
    _lookup(("jax._src.debugging:debug_callback_p",), "`jax.debug.callback`'s primitive"),
    _lookup(("jax._src.debugging:debug_print_p",), "`jax.debug.print`'s primitive"),
)
# The effects JAX orders by a token threaded through the program (`io_callback(...,
# ordered=True)`, `jax.debug.print(..., ordered=True)`): no public name lists them.
ordered_effects: Any = _lookup(("jax._src.effects:ordered_effects",), "the ordered effects")
# The backends JAX registered, each with the PJRT C API of its plugin (`.c_api`, a
# capsule): the CUDA plugin's FFI extension registers a kernel for its host compiler,
# which no public API reaches (`_host.kernels.gpu_host`).
backend_factories: Any = _lookup(
    ("jax._src.xla_bridge:_backend_factories",), "the backends' plugins"
)
# The concrete class of `jax.Array` (an exact type test on the per-call path).
ArrayImpl: Any = _lookup(("jax._src.array:ArrayImpl",), "the concrete jax.Array")
# The last step of every `jax.jit` compile, `backend_compile_and_load(backend, module,
# executable_devices, options, host_callbacks)`: where JAX hands the XLA client the
# lowered module and its compile options. `ox.fit` takes them there to compile them in
# a child process (`_targets.isolated`); no public API gives a lowering's options.
_lookup(("jax._src.compiler:backend_compile_and_load",), "the compile's call of XLA")
_compiler: Any = importlib.import_module("jax._src.compiler")
# What JAX logs when a callback raises (logger and message), kept off the terminal.
CALLBACK_LOGGER = "jax._src.callback"
CALLBACK_FAILED = "jax.pure_callback failed"


def without_dead_code(jaxpr: Any) -> Any:
    """`jaxpr` without the equations no output depends on (every output kept)."""
    return dce_jaxpr(jaxpr, [True] * len(jaxpr.outvars), instantiate=True)[0]


def current_compute_type() -> str | None:
    """The compute type being traced for ("device_host" inside a host computation)."""
    return _compute_type_state.value


def current_trace() -> Any:
    """The trace JAX is tracing with now."""
    return _trace_context.trace


def trace_of(tracer: Any) -> Any:
    """The trace `tracer` belongs to (None for anything else)."""
    return getattr(tracer, "_trace", None)


def context_mesh() -> Any:
    """The concrete mesh of the innermost `with jax.set_mesh(...)` of this thread."""
    return _device_context.get_local()


@contextlib.contextmanager
def context_mesh_set(mesh: Any) -> Iterator[None]:
    """`mesh` as this thread's context mesh inside, as `jax.set_mesh` sets it, without
    its checks (a compile-only target's mesh is restored afterwards as it was)."""
    previous = _device_context.swap_local(mesh)
    try:
        yield
    finally:
        _device_context.set_local(previous)


@contextlib.contextmanager
def compile_calls_replaced(replace: Any) -> Iterator[None]:
    """Inside, JAX's compiles call `replace(original)` (a function with the signature of
    `backend_compile_and_load`) instead of `backend_compile_and_load` itself."""
    original = _compiler.backend_compile_and_load
    _compiler.backend_compile_and_load = replace(original)
    try:
        yield
    finally:
        _compiler.backend_compile_and_load = original


def cuda_plugin_api() -> Any:
    """The CUDA plugin's PJRT C API as JAX loaded it (a capsule), None where no CUDA
    plugin is registered."""
    for name in ("cuda", "cuda12", "cuda13"):
        registration = backend_factories.get(name)
        if registration is not None and getattr(registration, "c_api", None) is not None:
            return registration.c_api
    return None


def cuda_versions() -> Any:
    """The CUDA plugin's version queries (`cudnn_get_version`), None where JAX found no
    CUDA plugin (it is optional); a `MissingInternal` naming `jax._src.lib.cuda_versions`
    where this JAX has no such name (so a GPU target does not say "install the extra"
    when the extra is there). Looked up when asked, not at import: a CPU-only user of a
    JAX without it is not stopped."""
    return _lookup(
        ("jax._src.lib:cuda_versions",),
        "the CUDA plugin's version queries, to check that cuDNN loads",
    )
