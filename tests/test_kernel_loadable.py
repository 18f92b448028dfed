"""A kernel library its record vouches for that this machine cannot load is refused with a
reason, never loaded (`offload_eqx/_host/kernels/elf.py`, `load.py`).

The record's hash proves only that the bytes are the ones the build wrote: a compiler that
wrote a library cut short, or one for another machine, is vouched for all the same. Such
a library cut short used to kill the process as it was loaded (SIGBUS, through the
in-memory copy). Each library here is recorded as a compromised or buggy build would
record it, and loaded in a child process (one for all cases), so that a regression shows
as a failed test, not as pytest killed.
"""

import hashlib
import json
import shutil
import signal
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from offload_eqx._host.kernels import elf
from offload_eqx._host.kernels.compile import MANIFEST
from offload_eqx._host.kernels.load import HERE

REINSTALL = "reinstall offload_eqx with a C++ compiler (`pip install --force-reinstall --no-deps"
MACHINE_AT = 18  # e_machine's offset in an ELF header
SECTIONS_AT, SECTION_COUNT_AT = 40, 60  # e_shoff's and e_shnum's (ELF64)


def _library() -> bytes:
    entry = json.loads((HERE / MANIFEST).read_text())["kernels"]["adamw"]
    if "error" in entry:
        pytest.skip(f"the kernel was not built with the package: {entry['error']}")
    return (HERE / "_adamw.so").read_bytes()


def _patched(data: bytes, offset: int, fmt: str, value: int) -> bytes:
    patched = bytearray(data)
    struct.pack_into(fmt, patched, offset, value)
    return bytes(patched)


def _without_section_table(data: bytes) -> bytes:
    """`data` cut short with no section headers to give it away: only its segments do."""
    data = _patched(data, SECTIONS_AT, "<Q", 0)
    return _patched(data, SECTION_COUNT_AT, "<H", 0)[: len(data) // 2]


def test_the_built_library_is_one_this_machine_loads():
    assert elf.problem(_library()) is None


@pytest.mark.parametrize(
    "damage, expected",
    [
        (lambda d: d[: len(d) // 2], "its table of section headers (bytes "),
        (lambda d: d[: len(d) - 1], "lies past its end at"),
        (_without_section_table, "its segment 1 (PT_LOAD) (bytes 16384 to"),
        (lambda d: d[:40], "its ELF header is cut short (40 bytes)"),
        (lambda d: _patched(d, MACHINE_AT, "<H", 183), "it is an AArch64 library, and this"),
        (lambda d: d[:4] + b"\x01" + d[5:], "it is a 32-bit ELF library"),
        (lambda d: d[:5] + b"\x02" + d[6:], "its byte order is not this machine's"),
        (lambda d: _patched(d, 16, "<H", 2), "it is not a shared library (ELF type 2)"),
        (lambda d: b"half a library", "it is not an ELF library (it begins b'half a l', 14 bytes)"),
        (lambda d: b"", "it is not an ELF library (it begins b'', 0 bytes)"),
    ],
    ids=[
        "cut_to_half",
        "one_byte_short",
        "segments_cut_short",
        "header_cut_short",
        "aarch64",
        "32_bit",
        "big_endian",
        "executable",
        "garbage",
        "empty",
    ],
)
def test_a_library_this_machine_cannot_map_is_named_before_loading(damage, expected):
    if "AArch64" in expected and elf.this_machine() != 62:
        pytest.skip("the foreign machine here is AArch64: this case is for x86-64")
    why = elf.problem(damage(_library()))
    assert why is not None and expected in why, why


# Loads each folder given in the loader, one after another in one process, and prints
# what `ox.host_kernels()` says of each as it goes: a crash cuts the list short.
CHILD = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path
    from offload_eqx._host.kernels import load
    for folder in sys.argv[1:]:
        load.KERNEL_DIR = Path(folder)
        load._loaded.clear(), load._why.clear()
        print(json.dumps([folder, load.host_kernels()["adamw"]]), flush=True)
    """
)

NO_SYMBOL = "int offload_eqx_not_the_kernel(void) { return 1; }\n"


def _c_library(folder: Path, name: str, *flags: str) -> Path:
    """`NO_SYMBOL` compiled by `cc` into `lib{name}.so` in `folder`, with `flags`."""
    compiler = shutil.which("cc")
    if compiler is None:
        pytest.skip("no C compiler (`cc`) to build a library without the kernel's symbols")
    (folder / f"{name}.c").write_text(NO_SYMBOL)
    library = folder / f"lib{name}.so"
    command = [compiler, "-shared", "-fPIC", "-o", library, folder / f"{name}.c", *flags]
    subprocess.run(command, check=True)
    return library


def _needing_a_library_gone(folder: Path) -> bytes:
    """A library linked against `libox_gone.so`, which is then removed."""
    gone = _c_library(folder, "ox_gone")
    flags = ("-Wl,--no-as-needed", f"-L{folder}", "-lox_gone")
    data = _c_library(folder, "needs_gone", *flags).read_bytes()
    gone.unlink()
    return data


def _recorded(folder: Path, data: bytes) -> Path:
    """A kernels' folder holding `data` as its library, recorded as the build records
    what its compiler wrote."""
    folder.mkdir(mode=0o755)
    (folder / "_adamw.so").write_bytes(data)
    record = json.loads((HERE / MANIFEST).read_text())
    record["kernels"]["adamw"]["sha256"] = hashlib.sha256(data).hexdigest()
    (folder / MANIFEST).write_text(json.dumps(record))
    return folder


# The library cut short first: the dynamic loader takes a path it loaded before for the
# library loaded then (each copy is `/proc/self/fd/N`), so after the library without the
# kernel's symbols it would never be mapped.
FOREIGN = "AArch64" if elf.this_machine() == 62 else "x86-64"
CASES = {
    "cut_to_half": "cut short",
    "another_machine": f"it is an {FOREIGN} library, and this machine is",
    "garbage": "it is not an ELF library",
    "missing_dependency": "the dynamic loader refused it: libox_gone.so: cannot open shared",
    "no_kernel_symbol": "has no symbol OffloadEqxAdamW, OffloadEqxAdamWVariant (the kernel",
}


@pytest.fixture(scope="module")
def loaded(tmp_path_factory) -> dict[str, str]:
    """What the loader said of each case, loaded one after another in one child."""
    data, base = _library(), tmp_path_factory.mktemp("recorded")
    libraries = {
        "cut_to_half": data[: len(data) // 2],
        "another_machine": _patched(data, MACHINE_AT, "<H", 183 if FOREIGN == "AArch64" else 62),
        "garbage": bytes(range(256)) * 8,
        "missing_dependency": _needing_a_library_gone(base),
        "no_kernel_symbol": _c_library(base, "no_symbol").read_bytes(),
    }
    folders = [str(_recorded(base / case, libraries[case])) for case in CASES]
    done = subprocess.run(
        [sys.executable, "-c", CHILD, *folders], capture_output=True, text=True, timeout=300
    )
    said = dict(json.loads(line) for line in done.stdout.splitlines() if line.startswith("["))
    ended = f"exit status {done.returncode}"
    if done.returncode < 0:
        ended = f"killed by {signal.Signals(-done.returncode).name}"
    unsaid = f"the loading process ended before it ({ended}):\n{done.stderr[-2000:]}"
    return {case: said.get(folder, unsaid) for case, folder in zip(CASES, folders)}


@pytest.mark.parametrize("case", list(CASES))
def test_a_recorded_library_that_cannot_load_is_refused_naming_it(loaded, case):
    why = loaded[case]
    assert why.startswith("unavailable: /"), why
    library = why.removeprefix("unavailable: ").split(" ", 1)[0]
    assert Path(library).name == "_adamw.so" and Path(library).parent.name == case, why
    assert CASES[case] in why and REINSTALL in why, why
    assert "/proc/self/fd" not in why, why
    if case != "missing_dependency":  # there the missing file is the dependency
        assert "No such file or directory" not in why, why
