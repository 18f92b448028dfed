"""Our host kernels on the GPU's host: registered with the CUDA plugin's own XLA:CPU.

XLA:GPU compiles a step's host computation with an XLA:CPU of its own, inside the CUDA
plugin, which finds a custom call in the plugin's FFI registry under the platform
"Host". `jax.ffi.register_ffi_target` registers in jaxlib's registry, another library's,
and no public JAX API reaches the plugin's. The plugin's PJRT C API does: its FFI
extension's `register_handler(target, handler, platform, traits)`, called here through
ctypes on the C API JAX loaded the plugin with (`register`).

A kernel missing from that registry does not raise: the compile aborts the process, and
`register_handler` reports no failure. So nothing here is relied on unproven. Once per
jaxlib, plugin and kernel library, a child process (`gpu_host_proof`) registers the kernel
this way and compiles, for an H100 without one, a host computation that calls it; only
when the child reports the compiled program calling the kernel is the kernel registered
in this process. The child starts isolated (`python -I`: no PYTHONPATH, user site or
working directory), imports from where this process did, this package's own folder first
(`import_roots`), and gets only the environment its compile reads: the proof is of this
process's package, never of one of the same name planted elsewhere. The verdict is kept
for the process and in a file of this user's cache (`gpu_host_verdicts`), keyed by those
versions and the library's SHA-256. Where the proof fails, the GPU's host runs the
update as XLA compiles it (the same results), and `ox.host_kernels()` says why.
"""

import ctypes
import hashlib
import importlib.metadata
import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterable
from pathlib import Path

import jax

from ..._base.jax_private import cuda_plugin_api
from . import gpu_host_verdicts, load

PLATFORM = b"Host"  # the plugin's name for its host compiler's platform
_FFI_EXTENSION = 5  # PJRT_Extension_Type_FFI
_PROOF_SECONDS = 300
_PACKAGE = Path(__file__).resolve().parents[2]
# The GPU the proof compiles for (any does: the lookup is the host compiler's).
PROOF_CONFIG = _PACKAGE / "_targets" / "configs" / "h100.txtpb"
_PLUGINS = ("jax-cuda12-plugin", "jax-cuda12-pjrt", "jax-cuda13-plugin", "jax-cuda13-pjrt")

_lock = threading.Lock()
_verdicts: dict[str, str | None] = {}  # kernel -> None when usable, else why not
_registered: set[str] = set()
_unkept: dict[str, str | None] = {}  # kernel -> why its verdict was not kept, if it was not


class _ExtensionBase(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_size_t), ("type", ctypes.c_int), ("next", ctypes.c_void_p)]


class _FfiExtension(ctypes.Structure):
    """`PJRT_FFI_Extension` (xla/pjrt/c/pjrt_c_api_ffi_extension.h), 48 bytes."""

    _fields_ = [
        ("base", _ExtensionBase),
        ("type_id_register", ctypes.c_void_p),
        ("user_data_add", ctypes.c_void_p),
        ("register_handler", ctypes.c_void_p),
    ]


class _RegisterArgs(ctypes.Structure):
    """`PJRT_FFI_Register_Handler_Args`; its `struct_size` is 52 (the end of `traits`)."""

    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("target_name", ctypes.c_char_p),
        ("target_name_size", ctypes.c_size_t),
        ("handler", ctypes.c_void_p),
        ("platform_name", ctypes.c_char_p),
        ("platform_name_size", ctypes.c_size_t),
        ("traits", ctypes.c_uint32),
    ]


_ARGS_SIZE = _RegisterArgs.traits.offset + ctypes.sizeof(ctypes.c_uint32)


class Unproven(Exception):
    """Why a kernel is not used on the GPU's host."""


def _api_address() -> int:
    jax.default_backend()  # JAX loads its plugins with its first backend
    capsule = cuda_plugin_api()
    if capsule is None:
        raise Unproven("jax has no CUDA plugin loaded")
    get_name = ctypes.pythonapi.PyCapsule_GetName
    get_name.restype, get_name.argtypes = ctypes.c_char_p, [ctypes.py_object]
    get_pointer = ctypes.pythonapi.PyCapsule_GetPointer
    get_pointer.restype = ctypes.c_void_p
    get_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
    address = get_pointer(capsule, get_name(capsule))
    if not address:
        raise Unproven("the CUDA plugin's C API could not be read")
    return address


def _ffi_extension() -> _FfiExtension:
    """The plugin's FFI extension: the C API's second field starts the extension chain."""
    api = _api_address()
    _, extension = (ctypes.c_size_t * 2).from_address(api)
    while extension:
        base = _ExtensionBase.from_address(extension)
        if base.type == _FFI_EXTENSION:
            if base.struct_size < ctypes.sizeof(_FfiExtension):
                raise Unproven(f"the CUDA plugin's FFI extension is {base.struct_size} bytes")
            return _FfiExtension.from_address(extension)
        extension = base.next
    raise Unproven("the CUDA plugin has no FFI extension")


def register(target: str, handler: int) -> None:
    """Register the FFI handler at address `handler` as `target` for the CUDA plugin's
    host compiler. Unchecked: only the proof's child calls it before the proof."""
    extension = _ffi_extension()
    if not extension.register_handler:
        raise Unproven("the CUDA plugin's FFI extension cannot register handlers")
    name = target.encode()
    args = _RegisterArgs(_ARGS_SIZE, name, len(name), handler, PLATFORM, len(PLATFORM), 0)
    function = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.POINTER(_RegisterArgs))
    error = function(extension.register_handler)(ctypes.byref(args))
    if error:  # a PJRT_Error: not freed (its destroy function is another table's)
        raise Unproven("the CUDA plugin refused the registration")


def _versions(name: str) -> dict[str, str]:
    """What a verdict holds for: jaxlib, the plugin, the kernel's library, this Python."""
    found = {"jaxlib": jax.lib.__version__, "python": sys.version.split()[0]}
    for plugin in _PLUGINS:
        try:
            found[plugin] = importlib.metadata.version(plugin)
        except importlib.metadata.PackageNotFoundError:
            pass
    found["kernel"] = load.library_sha256(name) or ""
    return found


# What the proof's child is given of this process's environment: what the compile it
# makes reads (XLA's flags and logs; where CUDA, its libraries and ptxas are; the home and
# temporary folders). Nothing else: no PYTHON* variable, and it starts isolated (`-I`).
_PROOF_ENVIRONMENT = (
    "PATH", "HOME", "TMPDIR", "LD_LIBRARY_PATH", "CUDA_HOME", "CUDA_PATH", "CUDA_ROOT",
    "XLA_FLAGS", "TF_CPP_MIN_LOG_LEVEL", "TF_CPP_MAX_VLOG_LEVEL", "TF_CPP_VMODULE",
)  # fmt: skip
# The child's first code: the places this process imported from go first on its path
# (`-I` left out PYTHONPATH, the user's site and the working directory), then it runs the
# proof's module as `__main__` with the kernel and the GPU description as arguments.
_BOOTSTRAP = (
    "import json, runpy, sys; sys.path[:0] = json.loads(sys.argv.pop(1)); "
    "runpy.run_module(sys.argv.pop(1), run_name='__main__', alter_sys=True)"
)


def _entries_of(module: object) -> list[str]:
    """The path entries a top-level module was imported from (a namespace package may
    have several)."""
    file = getattr(module, "__file__", None)
    if isinstance(file, str):
        found = Path(file).resolve()
        return [str(found.parents[1] if found.name.startswith("__init__.") else found.parent)]
    parts = getattr(module, "__path__", None)
    parts = list(parts) if isinstance(parts, Iterable) else []
    return [str(Path(part).resolve().parent) for part in parts if isinstance(part, str)]


def import_roots() -> list[str]:
    """Where the proof's child imports from: this package's own folder first, then every
    entry of this process's path that a module it has imported came from (jax, jaxlib,
    the CUDA plugin, NumPy, ...), in this process's order: the child imports what this
    process did, never a package of the same name planted elsewhere."""
    held = set()
    for name, module in list(sys.modules.items()):
        if "." not in name:
            held.update(_entries_of(module))
    roots = [str(_PACKAGE.parent)]
    for entry in sys.path:
        resolved = str(Path(entry or os.getcwd()).resolve())
        if resolved in held and resolved not in roots:
            roots.append(resolved)
    return roots


def _proof_command(name: str) -> list[str]:
    """The proof's child: this Python, isolated (`-I`), importing only from this
    process's places (`import_roots`), running the package's own proof module."""
    module = f"{__package__}.gpu_host_proof"
    roots = json.dumps(import_roots())
    return [sys.executable, "-I", "-c", _BOOTSTRAP, roots, module, name, str(PROOF_CONFIG)]


def _proof_environment() -> dict[str, str]:
    kept = {name: os.environ[name] for name in _PROOF_ENVIRONMENT if name in os.environ}
    return {**kept, "JAX_PLATFORMS": "cpu"}


def _prove(name: str) -> dict:
    """Run the proof's child: `{"ok": bool, "why": str, "cache": bool}`."""
    command, env = _proof_command(name), _proof_environment()
    try:
        done = subprocess.run(
            command, env=env, capture_output=True, text=True, timeout=_PROOF_SECONDS
        )
    except subprocess.TimeoutExpired:
        return {"ok": False, "why": f"its proof took over {_PROOF_SECONDS} s", "cache": False}
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode == 0 and lines:
        return {**json.loads(lines[-1]), "cache": True}
    if done.returncode < 0:
        last = (done.stderr.strip().splitlines() or [""])[-1][-300:]
        why = f"a compile calling it killed the proof's process (signal {-done.returncode}: {last})"
        return {"ok": False, "why": why, "cache": True}
    last = (done.stderr.strip().splitlines() or ["no output"])[-1][-300:]
    return {"ok": False, "why": f"its proof failed: {last}", "cache": False}


def _verdict(name: str) -> str | None:
    """None where kernel `name` is proven on this plugin's host compiler, else why not."""
    if load.target(name) is None:
        return "it is not loaded on this CPU (see its entry)"
    versions = _versions(name)
    if not any(plugin in versions for plugin in _PLUGINS):
        return "no CUDA plugin is installed"
    key = hashlib.sha256(json.dumps(versions, sort_keys=True).encode()).hexdigest()
    verdict = gpu_host_verdicts.read().get(key)
    if not isinstance(verdict, dict) or not isinstance(verdict.get("ok"), bool):
        verdict = _prove(name)
        if verdict.pop("cache"):
            _unkept[name] = gpu_host_verdicts.write(key, {**verdict, "versions": versions})
    return None if verdict["ok"] else str(verdict.get("why"))


def target(name: str) -> str | None:
    """Kernel `name`'s XLA target where the CUDA plugin's host compiler may call it
    (proven, then registered there), None otherwise (`host_kernels()` says why)."""
    with _lock:
        if name not in _verdicts:
            try:
                why = _verdict(name)
                if why is None:
                    address = load.handler_address(name)
                    assert address is not None
                    register(load.target_name(name), address)
                    _registered.add(name)
            except Exception as error:  # never fatal: the update runs as XLA compiles it
                why = f"{type(error).__name__}: {error}"
            _verdicts[name] = why
        return load.target_name(name) if name in _registered else None


def host_kernels() -> dict[str, str]:
    """offload_eqx's host kernels and whether this process uses them.

    On the CPU, the optimizer update of `ox.offload_optimizer(optax.adamw(...),
    master_dtype=jnp.float32)` (or `optax.adam`) runs as one fused, in-place pass over
    every leaf: a C++ kernel compiled when offload_eqx was installed (with the system's
    C++ compiler: `$CXX`, else `c++`), whose results equal XLA's own update bit for bit.
    It is loaded only from the installed package, only if its SHA-256 is the one recorded
    when it was built and only if no one but you (root, the package's owner) can write
    it. Where it was not built (no compiler at install time), fails a check, or with
    `OFFLOAD_EQX_HOST_KERNELS=0`, the update runs as XLA compiles it: the same results,
    slower.

    On a GPU's host (the host computation of an XLA:GPU program), the same kernel runs
    once the CUDA plugin's host compiler is proven to find it: a child process compiles
    a host computation calling it, once per jaxlib, plugin and kernel (the verdict is
    cached in `$XDG_CACHE_HOME/offload_eqx/`, else `~/.cache/offload_eqx/`), at the first
    XLA:GPU program that would call it.

    Returns:
        `{kernel: how}`: "loaded from <library> (<the processor's variant>)", or
        "unavailable: <why>"; and `{"<kernel> on the GPU's host": how}`: "registered with
        the CUDA plugin", "not yet asked for", or "unavailable: <why>", followed by why
        the proof's verdict could not be kept in your cache where it could not (each
        process then proves the kernel again).

    Example:
        >>> ox.host_kernels()  # doctest: +SKIP
        {'adamw': 'loaded from .../offload_eqx/_host/kernels/_adamw.so (x86-64 AVX-512 with FMA)',
         "adamw on the GPU's host": 'not yet asked for'}
    """
    found = load.host_kernels()
    for name in list(found):
        if name in _registered:
            how = "registered with the CUDA plugin's host compiler"
        elif _verdicts.get(name) is not None:
            how = f"unavailable: {_verdicts[name]}"
        else:
            how = "not yet asked for (proven at the first XLA:GPU program that calls it)"
        if _unkept.get(name):
            how += f"; its verdict is not kept for other processes: {_unkept[name]}"
        found[f"{name} on the GPU's host"] = how
    return found
