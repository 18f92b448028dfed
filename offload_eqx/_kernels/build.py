"""Host kernels of our own, built on first use and called through `jax.ffi`.

A kernel is a C++ file beside this one, written against XLA's FFI headers (shipped with
jaxlib). `target(name)` compiles it once per machine with the system's C++ compiler
(`$CXX`, else `c++`), for this machine's processor (`-march=native`: the update is as fast
as the host's vector units allow, and a shared cache keys the build by the processor's
features), caches the library, loads it and registers it with XLA for the CPU platform.
Where it cannot (no compiler, a failed build, `OFFLOAD_EQX_HOST_KERNELS=0`), it returns
None and the caller runs the same computation as XLA compiles it; `host_kernels()`
(`ox.host_kernels()`) says which, and why.

The cache: `$OFFLOAD_EQX_CACHE`, else `$XDG_CACHE_HOME/offload_eqx`, else
`~/.cache/offload_eqx`; one library per source, jaxlib, compiler and processor, written
under a temporary name and renamed, so concurrent first uses do not see half a file.
"""

import ctypes
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import jax
import jaxlib

_HERE = Path(__file__).parent
_SWITCH = "OFFLOAD_EQX_HOST_KERNELS"
# Each kernel's source file and the symbol of its FFI handler.
KERNELS = {"adamw": ("adamw.cc", "OffloadEqxAdamW")}
_FLAGS = ["-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-fno-math-errno"]
# Every float operation rounded on its own (see adamw.cc); warnings of XLA's headers off.
_FLAGS += ["-ffp-contract=off", "-w"]
_BUILD_SECONDS = 300

_lock = threading.Lock()
_loaded: dict[str, str | None] = {}  # kernel -> its XLA target, None when unavailable
_why: dict[str, str] = {}  # kernel -> how it was loaded, or why not


def target_name(name: str) -> str:
    """The XLA custom-call target kernel `name` is registered as."""
    return f"offload_eqx_{name}"


def _cache_dir() -> Path:
    if os.environ.get("OFFLOAD_EQX_CACHE"):
        return Path(os.environ["OFFLOAD_EQX_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache")
    return Path(base) / "offload_eqx"


def _processor() -> str:
    """The processor's instruction-set features (Linux), so that a cache shared between
    machines never hands one machine another's `-march=native` build."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CXX", "c++")) or shutil.which("g++")


def _library(name: str, compiler: str) -> Path:
    source_file, _ = KERNELS[name]
    source = (_HERE / source_file).read_bytes()
    version = subprocess.run(
        [compiler, "--version"], capture_output=True, text=True, timeout=60
    ).stdout
    key = hashlib.sha256()
    for part in (source, jaxlib.__version__.encode(), version.encode(), _processor().encode()):
        key.update(part)
        key.update(b"\0")
    key.update(" ".join(_FLAGS).encode())
    return _cache_dir() / f"{name}-{key.hexdigest()[:16]}.so"


def _build(name: str, compiler: str, library: Path) -> None:
    source_file, _ = KERNELS[name]
    library.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(suffix=".so", dir=library.parent)
    os.close(handle)
    command = [compiler, *_FLAGS, f"-I{jax.ffi.include_dir()}", str(_HERE / source_file)]
    try:
        done = subprocess.run(
            [*command, "-o", temporary], capture_output=True, text=True, timeout=_BUILD_SECONDS
        )
        if done.returncode != 0:
            raise RuntimeError(f"`{' '.join(command)}` failed:\n{done.stderr[-2000:]}")
        os.replace(temporary, library)
    finally:
        if os.path.exists(temporary):
            os.unlink(temporary)


def _load(name: str) -> str:
    """Build (once), load and register kernel `name`; its XLA target name. Raises with
    the reason where it cannot."""
    if os.environ.get(_SWITCH, "1") == "0":
        raise RuntimeError(f"switched off ({_SWITCH}=0)")
    if not sys.platform.startswith("linux"):
        raise RuntimeError(f"built on Linux only (this is {sys.platform})")
    compiler = _compiler()
    if compiler is None:
        raise RuntimeError("no C++ compiler found (set CXX, or install g++ or clang++)")
    library = _library(name, compiler)
    if not library.exists():
        _build(name, compiler, library)
    _, symbol = KERNELS[name]
    handler = getattr(ctypes.cdll.LoadLibrary(str(library)), symbol)
    target = target_name(name)
    jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(handler), platform="cpu")
    _why[name] = f"loaded from {library}"
    return target


def target(name: str) -> str | None:
    """The XLA target of host kernel `name` (built and registered on first use), or None
    where it is unavailable (`host_kernels()` says why)."""
    with _lock:
        if name not in _loaded:
            try:
                _loaded[name] = _load(name)
            except (OSError, RuntimeError, subprocess.SubprocessError) as error:
                _loaded[name] = None
                _why[name] = f"unavailable: {error}"
        return _loaded[name]


def host_kernels() -> dict[str, str]:
    """offload_eqx's host kernels and whether this process uses them.

    On the CPU, the optimizer update of `ox.offload_optimizer(optax.adamw(...),
    master_dtype=jnp.float32)` (or `optax.adam`) runs as one fused, in-place pass per
    leaf: a C++ kernel built on first use with the system's compiler (`$CXX`, else
    `c++`) for this processor and cached (`$OFFLOAD_EQX_CACHE`, else
    `~/.cache/offload_eqx`). Where it cannot be built, or with
    `OFFLOAD_EQX_HOST_KERNELS=0`, the update runs as XLA compiles it: the same results,
    slower. Builds what was not built yet.

    Returns:
        `{kernel: how}`: "loaded from <library>", or "unavailable: <why>".

    Example:
        >>> ox.host_kernels()  # doctest: +SKIP
        {'adamw': 'loaded from /home/me/.cache/offload_eqx/adamw-79baae84c91042aa.so'}
    """
    for name in KERNELS:
        target(name)
    return dict(_why)
