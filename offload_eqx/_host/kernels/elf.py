"""Whether a kernel's library is one this machine can load, read from its bytes.

The dynamic loader maps a library's segments from the file; one that ends before its
segments do is mapped past its end, and the first touch of the missing pages kills the
process (SIGBUS), with no error to catch. A library built for another machine is refused
with a misleading "No such file or directory". So a library is read first: ELF's
header and program headers (`problem`), every segment and header table within the
file, for this machine's architecture, byte order and word size, and a shared object.

Run as a script (`python -I elf.py LIBRARY SYMBOL...`), it checks LIBRARY so, loads it
and looks up each SYMBOL, and says why not on its last line (exit status 1): the build
(`compile.py`) runs it in a child process before its record vouches for a library.

Standard library only: the build runs this file by its path, before offload_eqx's
dependencies are installed.
"""

import ctypes
import os
import platform
import struct
import sys

_MAGIC = b"\x7fELF"
_CLASS_32, _CLASS_64, _LITTLE, _BIG = 1, 2, 1, 2
_SHARED_OBJECT = 3  # e_type ET_DYN
_LOAD, _DYNAMIC = 1, 2  # p_type PT_LOAD, PT_DYNAMIC
_SEGMENTS = {_LOAD: "PT_LOAD", _DYNAMIC: "PT_DYNAMIC", 3: "PT_INTERP", 4: "PT_NOTE"}
# e_machine of each architecture by the names `platform.machine()` gives it.
_MACHINES = {
    "x86_64": 62,
    "amd64": 62,
    "aarch64": 183,
    "arm64": 183,
    "ppc64le": 21,
    "ppc64": 21,
    "s390x": 22,
    "riscv64": 243,
}
_ARCHITECTURES = {3: "x86 (32-bit)", 40: "ARM (32-bit)", 62: "x86-64", 183: "AArch64"}
_ARCHITECTURES |= {21: "PowerPC 64", 22: "IBM Z", 243: "RISC-V"}
# ELF64's file header after e_ident, and one program header, in this machine's byte
# order (a library of the other order is refused before either is read).
_HEADER = struct.Struct("=HHIQQQIHHHHHH")
_PROGRAM_HEADER = struct.Struct("=IIQQQQQQ")


def this_machine() -> int | None:
    """This machine's ELF architecture number (e_machine), None where it is not known."""
    return _MACHINES.get(platform.machine().lower())


def _architecture(number: int) -> str:
    return _ARCHITECTURES.get(number, f"architecture number {number}")


def _identity(data: bytes) -> str | None:
    """Why `data` is not a 64-bit ELF file of this machine's byte order, if it is not."""
    if len(data) < 16 or data[:4] != _MAGIC:
        return f"it is not an ELF library (it begins {data[:8]!r}, {len(data)} bytes)"
    if data[4] != _CLASS_64:
        if data[4] == _CLASS_32:
            return "it is a 32-bit ELF library, and this Python is 64-bit"
        return f"its ELF class ({data[4]}) is not 64-bit"
    if data[5] != {"little": _LITTLE, "big": _BIG}[sys.byteorder]:
        return f"its byte order is not this machine's ({sys.byteorder}-endian)"
    return None


def _within(size: int, offset: int, length: int, what: str) -> str | None:
    if offset + length > size:
        return (
            f"its {what} (bytes {offset} to {offset + length}) lies past its end at {size} "
            "bytes: the file is cut short"
        )
    return None


def problem(data: bytes) -> str | None:
    """Why `data` is not a shared library this machine can load, None where it is one.

    Checks what the dynamic loader trusts before it maps anything: the ELF magic, a
    64-bit file of this machine's byte order and architecture, a shared object, its
    header tables and every segment's bytes inside the file."""
    why = _identity(data)
    if why:
        return why
    size = len(data)
    if size < 16 + _HEADER.size:
        return f"its ELF header is cut short ({size} bytes)"
    fields = _HEADER.unpack_from(data, 16)
    kind, machine, _, _, program_at, section_at, _, _, program_size, programs = fields[:10]
    section_size, sections = fields[10], fields[11]
    here = this_machine()
    if here is not None and machine != here:
        return (
            f"it is an {_architecture(machine)} library, and this machine is "
            f"{platform.machine()} ({_architecture(here)}): built on or for another machine"
        )
    if kind != _SHARED_OBJECT:
        return f"it is not a shared library (ELF type {kind})"
    if programs == 0 or program_size != _PROGRAM_HEADER.size:
        return "it has no program headers a loader can read"
    why = _within(size, program_at, programs * program_size, "table of program headers")
    why = why or _within(size, section_at, sections * section_size, "table of section headers")
    if why:
        return why
    return _segments_problem(data, program_at, programs)


def _segments_problem(data: bytes, table: int, count: int) -> str | None:
    """Why the segments the program headers at `table` describe cannot be mapped."""
    kinds = set()
    for index in range(count):
        header = _PROGRAM_HEADER.unpack_from(data, table + index * _PROGRAM_HEADER.size)
        kind, _, offset, _, _, file_size = header[:6]
        kinds.add(kind)
        named = _SEGMENTS.get(kind, f"type {kind:#x}")
        why = _within(len(data), offset, file_size, f"segment {index} ({named})")
        if why:
            return why
    if _LOAD not in kinds or _DYNAMIC not in kinds:
        return "it has no loadable segment or no dynamic section: not a shared library"
    return None


def _load(path: str, symbols: list[str]) -> str | None:
    """Why the library at `path` cannot be loaded with each of `symbols`, None where it
    can (the loader then runs its constructors: the caller is a child process)."""
    path = os.path.abspath(path)  # a bare name would be looked for on the loader's path
    with open(path, "rb") as file:
        why = problem(file.read())
    if why:
        return why
    try:
        library = ctypes.CDLL(path)
    except OSError as error:
        return f"the dynamic loader refused it ({str(error).replace(path + ': ', '')})"
    missing = [symbol for symbol in symbols if not hasattr(library, symbol)]
    if missing:
        return f"it has no symbol {', '.join(missing)} (the kernel's entry points)"
    return None


if __name__ == "__main__":
    reason = _load(sys.argv[1], sys.argv[2:])
    if reason:
        print(reason)
        sys.exit(1)
