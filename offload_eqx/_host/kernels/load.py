"""Host kernels of our own, loaded only as they were built with the package.

A kernel is a C++ file beside this one, written against XLA's FFI headers and compiled
when offload_eqx was installed (`compile.py`): its library and `kernels.json`, the record
of what was built, lie in this folder. Nothing is compiled here, and nothing is loaded
from anywhere else: no cache, no environment variable names a library.

`target(name)` loads kernel `name` once per process, registers it with XLA for the CPU
platform and returns its XLA target, only when every check passes:

- the record and the library are regular files (not symbolic links), owned by the
  current user, by root or by the owner of the package's own Python files, and writable
  by no one else: not by others, and by their group only where that group may write the
  package's Python files too; and so is this folder;
- the library's SHA-256 is the one recorded when it was built (a truncated, overwritten
  or foreign file is never loaded), and its source's is the source's beside it (a stale
  build of an older source is not either);
- its bytes are a library this machine can load (`elf`: a shared object of this
  machine's architecture whose segments lie within the file: a library cut short by the
  compiler that wrote it, vouched for by its record, would kill the process as it
  loads), the dynamic loader takes it, and it has the kernel's symbols;
- the library is loaded from the bytes that were checked (a private in-memory copy:
  a file changed on disk after the check changes nothing, and a file cut short while in
  use cannot crash the process);
- `OFFLOAD_EQX_HOST_KERNELS=0` is not set.

Where any fails, it returns None and the caller runs the same computation as XLA
compiles it; `host_kernels()` (`ox.host_kernels()`) says which, and why.
"""

import ctypes
import hashlib
import json
import os
import stat
import sys
import threading
from pathlib import Path
from typing import Any

import jax

from . import elf
from .compile import FORMAT, HERE, KERNELS, MANIFEST, symbols

KERNEL_DIR = HERE  # a test points it elsewhere, in a process of its own
_SWITCH = "OFFLOAD_EQX_HOST_KERNELS"
_LARGEST = 64 << 20  # bytes: no kernel library is larger; a larger file is not read
_REINSTALL = (
    "reinstall offload_eqx with a C++ compiler (`pip install --force-reinstall --no-deps "
    "offload_eqx`, or `pip install -e .` in its source)"
)

_lock = threading.Lock()
_loaded: dict[str, str | None] = {}  # kernel -> its XLA target, None when unavailable
_why: dict[str, str] = {}  # kernel -> how it was loaded, or why not
_handles: list[Any] = []  # the libraries loaded, kept alive with the process
_addresses: dict[str, int] = {}  # kernel -> its FFI handler's address in the library


class Refused(Exception):
    """Why a kernel is not loaded."""


def target_name(name: str) -> str:
    """The XLA custom-call target kernel `name` is registered as."""
    return f"offload_eqx_{name}"


def _owners() -> set[int]:
    """Whom a kernel may belong to: this user, root, and whoever owns the package's own
    Python files (who could change them as well)."""
    owners = {os.getuid(), 0}
    try:
        owners.add(os.stat(HERE.parent / "__init__.py").st_uid)
    except OSError:
        pass
    return owners


def _group_may_write(info: os.stat_result) -> bool:
    """Whether `info`'s group may write it without trusting anyone new: where that
    group may write the package's own Python files too (a umask of 002)."""
    try:
        package = os.stat(HERE.parent / "__init__.py")
    except OSError:
        return False
    return bool(package.st_mode & stat.S_IWGRP) and package.st_gid == info.st_gid


def _check_owned(path: Path, what: str, follow: bool) -> os.stat_result:
    try:
        info = os.stat(path, follow_symlinks=follow)
    except OSError as error:
        raise Refused(f"{what} {path} cannot be read ({error.strerror}); {_REINSTALL}") from None
    if stat.S_ISLNK(info.st_mode):
        raise Refused(f"{what} {path} is a symbolic link: only the file the build wrote is loaded")
    if info.st_uid not in _owners():
        raise Refused(
            f"{what} {path} belongs to user id {info.st_uid}, not to this user, root or the "
            "package's owner: it is not loaded"
        )
    writers = stat.S_IWOTH | (0 if _group_may_write(info) else stat.S_IWGRP)
    if info.st_mode & writers:
        raise Refused(
            f"{what} {path} is writable by others (mode {stat.filemode(info.st_mode)}): it is "
            f"not loaded; `chmod go-w {path}` if you made it so, else {_REINSTALL}"
        )
    return info


def _read(path: Path, what: str) -> bytes:
    """The bytes of a regular file checked by `_check_owned`, at most `_LARGEST`."""
    info = _check_owned(path, what, follow=False)
    if not stat.S_ISREG(info.st_mode):
        raise Refused(f"{what} {path} is not a regular file")
    if info.st_size > _LARGEST:
        raise Refused(f"{what} {path} is {info.st_size} bytes, larger than any kernel")
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0)
    descriptor = os.open(path, flags)
    try:
        with os.fdopen(descriptor, "rb", closefd=False) as file:
            return file.read(_LARGEST + 1)
    finally:
        os.close(descriptor)


def _record(name: str) -> dict:
    """Kernel `name`'s entry in the build's record, checked like the library."""
    _check_owned(KERNEL_DIR, "the kernels' folder", follow=True)
    path = KERNEL_DIR / MANIFEST
    if not os.path.lexists(path):
        raise Refused(f"it was not built with the package (no {path}); {_REINSTALL}")
    try:
        manifest = json.loads(_read(path, "the build's record"))
        entry = manifest["kernels"][name]
        if manifest["format"] != FORMAT:
            raise Refused(f"{path} is of another format ({manifest['format']}); {_REINSTALL}")
    except (ValueError, KeyError, TypeError):
        raise Refused(f"{path} is not a record of this build; {_REINSTALL}") from None
    if "error" in entry:
        raise Refused(f"it could not be built when offload_eqx was installed: {entry['error']}")
    return entry


def _verified(name: str, entry: dict) -> tuple[bytes, Path]:
    """The library's bytes, once they are the ones the build recorded."""
    source_file, library_file, _ = KERNELS[name]
    source = HERE / source_file
    if hashlib.sha256(source.read_bytes()).hexdigest() != entry.get("source_sha256"):
        raise Refused(f"its build is of another source than {source}; {_REINSTALL}")
    library = KERNEL_DIR / library_file
    data = _read(library, "the library")
    if hashlib.sha256(data).hexdigest() != entry.get("sha256"):
        raise Refused(
            f"{library} is not the library the build wrote (its SHA-256 differs from the "
            f"one recorded in {MANIFEST}: damaged or replaced); {_REINSTALL}"
        )
    return data, library


def _open(data: bytes, library: Path, name: str) -> ctypes.CDLL:
    """Load `library` from a private in-memory copy of its `data` (Linux's memfd), once
    its bytes are a library this machine can map (`elf.problem`): the loader maps a
    library cut short past its end, and touching that kills the process (SIGBUS)."""
    why = elf.problem(data)
    if why:
        raise Refused(f"{library} cannot be loaded on this machine: {why}; {_REINSTALL}")
    descriptor = os.memfd_create(f"offload_eqx_{name}", os.MFD_CLOEXEC)
    copy = f"/proc/self/fd/{descriptor}"
    try:
        os.write(descriptor, data)
        return ctypes.CDLL(copy)
    except OSError as error:  # its text names the copy, not the library
        detail = str(error).replace(f"{copy}: ", "")
        raise Refused(
            f"{library} cannot be loaded on this machine (the dynamic loader refused it: "
            f"{detail}); {_REINSTALL}"
        ) from None
    finally:
        os.close(descriptor)


def _entry_points(handle: ctypes.CDLL, library: Path, name: str) -> tuple[Any, Any]:
    """Kernel `name`'s FFI handler and the function naming its variant, in `handle`."""
    found = [getattr(handle, symbol, None) for symbol in symbols(name)]
    missing = [symbol for symbol, entry in zip(symbols(name), found) if entry is None]
    if missing:
        raise Refused(
            f"{library} has no symbol {', '.join(missing)} (the kernel's entry points): it "
            f"is not a build of {KERNELS[name][0]}; {_REINSTALL}"
        )
    return found[0], found[1]


def _load(name: str) -> str:
    """Load and register kernel `name`; its XLA target name. Raises `Refused` or another
    exception with the reason where it cannot."""
    if os.environ.get(_SWITCH, "1") == "0":
        raise Refused(f"switched off ({_SWITCH}=0)")
    if not sys.platform.startswith("linux"):
        raise Refused(f"built on Linux only (this is {sys.platform})")
    data, library = _verified(name, _record(name))
    handle = _open(data, library, name)
    handler, variant = _entry_points(handle, library, name)
    variant.restype = ctypes.c_char_p
    target = target_name(name)
    jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(handler), platform="cpu")
    _handles.append(handle)
    _addresses[name] = ctypes.cast(handler, ctypes.c_void_p).value or 0
    _why[name] = f"loaded from {library} ({variant().decode()})"
    return target


def target(name: str) -> str | None:
    """The XLA target of host kernel `name` (checked, loaded and registered on first
    use), or None where it is unavailable (`host_kernels()` says why)."""
    with _lock:
        if name not in _loaded:
            try:
                _loaded[name] = _load(name)
            except Refused as why:
                _loaded[name] = None
                _why[name] = f"unavailable: {why}"
            except Exception as error:  # any failure to load leaves the update to XLA
                _loaded[name] = None
                _why[name] = f"unavailable: {type(error).__name__}: {error}"
        return _loaded[name]


def handler_address(name: str) -> int | None:
    """The address of loaded kernel `name`'s FFI handler (what another XLA's FFI
    registry is given), None where it is not loaded."""
    return _addresses.get(name) if target(name) is not None else None


def library_sha256(name: str) -> str | None:
    """The SHA-256 of kernel `name`'s library as loaded, None where it is not."""
    if target(name) is None:
        return None
    return _record(name).get("sha256")


def host_kernels() -> dict[str, str]:
    """`{kernel: how}` for this CPU: "loaded from <library> (<the processor's variant>)",
    or "unavailable: <why>" (`ox.host_kernels()` adds the GPU's host)."""
    for name in KERNELS:
        target(name)
    return dict(_why)
