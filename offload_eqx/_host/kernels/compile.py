"""Host kernels compiled when offload_eqx is installed, never when it runs.

The package's build (`hatch_build.py`, at the project's root, for a wheel or an editable
install) calls `build_into(directory)`: each kernel's C++ source beside this file is
compiled against XLA's FFI headers (shipped with the jaxlib the build requires, the
oldest supported: a handler built against an FFI version runs on every jaxlib that
supports it) into a library in `directory`, and `kernels.json` records what was built:
the library's SHA-256, its source's, the compiler and its flags, or why nothing was
built (no compiler: the update then runs as XLA compiles it). The loader
(`load.py`) loads nothing that record does not vouch for, and the record vouches only
for a library a child process has loaded here (`elf.py`, as the loader reads it: a
compiler that wrote one cut short, or for another machine, gets its reason recorded
instead). A compiler that runs past `BUILD_SECONDS` is killed with every process it
started.

No `-march=native`: one build serves every processor of its architecture, and the kernel
picks its instructions when it is loaded (`adamw.cc`).

A library appears whole or not at all: the compiler writes into an unnamed file in the
destination's directory (Linux's `O_TMPFILE`), which is given its name only once
complete, so a build that is killed leaves nothing behind. Where the file system has no
unnamed files, a temporary name is renamed into place, and removed on failure.

Standard library only: the build imports this file by its path, before offload_eqx's
dependencies are installed.
"""

import hashlib
import importlib.util
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).parent
MANIFEST = "kernels.json"
FORMAT = 1
# Each kernel's source file, the library it is built into, and its FFI handler's symbol.
KERNELS = {"adamw": ("adamw.cc", "_adamw.so", "OffloadEqxAdamW")}
FLAGS = ("-O3", "-std=c++17", "-shared", "-fPIC", "-fno-math-errno", "-pipe")
# Every float operation rounded as written (adamw.cc writes out each contraction XLA
# makes); warnings of XLA's headers off.
FLAGS += ("-ffp-contract=off", "-w")
BUILD_SECONDS = 300  # for the compiler (a test makes it shorter)
LOAD_SECONDS = 60  # for the child process that loads what it built
_COMPILERS = ("c++", "g++", "clang++")


class BuildError(Exception):
    """Why a kernel was not built; recorded in the manifest."""


def symbols(name: str) -> tuple[str, str]:
    """The symbols kernel `name`'s library must have: its FFI handler, and the function
    naming the processor's variant the handler runs."""
    symbol = KERNELS[name][2]
    return symbol, f"{symbol}Variant"


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def compiler() -> list[str]:
    """The compiler command: `$CXX` as a shell would split it (`ccache g++`, `g++ -m64`),
    else the first of c++, g++, clang++ on the path."""
    given = os.environ.get("CXX", "").strip()
    if given:
        command = shlex.split(given)
        if shutil.which(command[0]) is None:
            raise BuildError(f"CXX={given!r}: {command[0]!r} is not an executable on the PATH")
        return command
    for name in _COMPILERS:
        if shutil.which(name):
            return [name]
    raise BuildError("no C++ compiler found (set CXX, or install g++ or clang++)")


def include_dir() -> tuple[Path, str]:
    """XLA's FFI headers in the installed jaxlib, and that jaxlib's version."""
    spec = importlib.util.find_spec("jaxlib")
    if spec is None or not spec.submodule_search_locations:
        raise BuildError("jaxlib is not installed in the build environment (its FFI headers)")
    root = Path(next(iter(spec.submodule_search_locations)))
    headers = root / "include"
    if not (headers / "xla" / "ffi" / "api" / "ffi.h").is_file():
        raise BuildError(f"jaxlib at {root} has no XLA FFI headers")
    version = "unknown"
    version_file = root / "version.py"
    if version_file.is_file():
        for line in version_file.read_text().splitlines():
            if line.startswith("_version") and "=" in line:
                version = line.split("=", 1)[1].strip().strip("\"'")
                break
    return headers, version


def _unnamed(directory: Path) -> int | None:
    """An unnamed file in `directory`, or None where its file system has none."""
    flag = getattr(os, "O_TMPFILE", None)
    if flag is None:
        return None
    try:
        return os.open(directory, flag | os.O_RDWR, 0o644)
    except OSError:
        return None


def _place(path: Path, fill: Callable[[str, tuple[int, ...]], None]) -> None:
    """Make `path` appear whole or not at all: `fill(target, descriptors)` writes the file
    at `target` (passing `descriptors` on to a child process that writes it)."""
    descriptor = _unnamed(path.parent)
    if descriptor is not None:
        target = f"/proc/self/fd/{descriptor}"
        try:
            fill(target, (descriptor,))
            os.chmod(target, 0o644)
            _name(descriptor, path)
        finally:
            os.close(descriptor)
        return
    handle, temporary = tempfile.mkstemp(prefix=f".{path.name}-", dir=path.parent)
    os.close(handle)
    try:
        fill(temporary, ())
        os.chmod(temporary, 0o644)
        os.replace(temporary, path)
    finally:
        if os.path.exists(temporary):
            os.unlink(temporary)


def _name(descriptor: int, path: Path) -> None:
    """Give the unnamed file `descriptor` the name `path`, replacing what is there."""
    # linkat(AT_SYMLINK_FOLLOW) through /proc: `os.link` without a directory descriptor
    # calls link(2), which would link the /proc entry itself.
    proc = os.open("/proc/self/fd", os.O_RDONLY | os.O_DIRECTORY)
    try:
        if not path.exists():
            os.link(str(descriptor), path, src_dir_fd=proc, follow_symlinks=True)
            return
        sibling = path.with_name(f".{path.name}-{os.getpid()}")
        sibling.unlink(missing_ok=True)
        os.link(str(descriptor), sibling, src_dir_fd=proc, follow_symlinks=True)
        os.replace(sibling, path)
    finally:
        os.close(proc)


def _run_bounded(
    command: list[str], seconds: float | int, descriptors: tuple[int, ...]
) -> subprocess.CompletedProcess:
    """Run `command`, its output captured: past `seconds` (or on any interruption) it is
    killed with every process it started, and reaped, so that a compiler that hangs
    leaves no process behind. Raises `TimeoutError` when it was stopped so.

    It stays in the build's process group (not a group of its own, which `killpg`
    would end whole): a signal to the build's group, such as Ctrl-C or a CI job killed,
    reaches it too."""
    with subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        pass_fds=descriptors,
    ) as process:
        try:
            out, err = process.communicate(timeout=seconds)
        except BaseException as error:
            _kill_tree(process.pid)
            process.wait()
            if isinstance(error, subprocess.TimeoutExpired):
                raise TimeoutError(
                    f"did not finish in {seconds:g} s, and was stopped with every process "
                    "it started"
                ) from None
            raise
    return subprocess.CompletedProcess(command, process.returncode, out, err)


def _kill_tree(pid: int) -> None:
    """SIGKILL process `pid` and every process it started (not yet reaped: `pid` is
    ours). Each is stopped as it is found, so that none starts another unseen, and the
    tree is read again until it holds no new one."""
    stopped: set[int] = set()
    while found := ({pid} | _descendants(pid)) - stopped:
        for each in found:
            _signal(each, signal.SIGSTOP)
        stopped |= found
    for each in stopped:
        _signal(each, signal.SIGKILL)


def _descendants(pid: int) -> set[int]:
    """The processes `pid` started and those they started, by their parents in /proc."""
    parents: dict[int, int] = {}
    if not os.path.isdir("/proc"):  # not Linux: the build's kernels are refused anyway
        return set()
    for entry in os.scandir("/proc"):
        try:
            stat = Path(entry.path, "stat").read_text() if entry.name.isdigit() else ""
        except OSError:  # ended meanwhile
            continue
        if stat:
            parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    found: set[int] = set()
    frontier = {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def _signal(pid: int, number: int) -> None:
    try:
        os.kill(pid, number)
    except ProcessLookupError:  # ended meanwhile
        pass


def _compiler_fill(command: list[str], needed: tuple[str, ...]):
    def fill(output: str, descriptors: tuple[int, ...]) -> None:
        # A child writes `/proc/self/fd/N` through its own inherited descriptor N.
        shown = shlex.join(command)
        try:
            done = _run_bounded([*command, "-o", output], BUILD_SECONDS, descriptors)
        except TimeoutError as error:
            raise BuildError(f"`{shown}` {error}") from None
        except (OSError, subprocess.SubprocessError) as error:
            raise BuildError(f"`{shown}` could not run: {error}") from None
        if done.returncode != 0:
            raise BuildError(f"`{shown}` failed:\n{done.stderr[-2000:]}")
        why = _unloadable(output, needed, descriptors)
        if why:
            raise BuildError(f"`{shown}` built a library this machine cannot load: {why}")

    return fill


def _unloadable(library: str, needed: tuple[str, ...], descriptors: tuple[int, ...]) -> str:
    """Why `library` cannot be loaded here with the symbols `needed`, "" where it can: it
    is checked and loaded as the loader will (`elf.py`), in a child process of its own,
    which a library that crashes its loader kills instead of the build."""
    command = [sys.executable, "-I", str(HERE / "elf.py"), library, *needed]
    try:
        done = _run_bounded(command, LOAD_SECONDS, descriptors)
    except (OSError, subprocess.SubprocessError) as error:
        return f"loading it {error}" if isinstance(error, TimeoutError) else f"{error}"
    if done.returncode < 0:
        return f"loading it killed the process (signal {_signal_name(-done.returncode)})"
    if done.returncode != 0:
        lines = done.stdout.strip().splitlines() or done.stderr.strip().splitlines()
        return lines[-1] if lines else f"loading it failed (exit status {done.returncode})"
    return ""


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return str(number)


def build_one(name: str, directory: Path, cxx: list[str], headers: Path) -> dict:
    """Build kernel `name` into `directory`; its manifest entry."""
    source_file, library_file, _ = KERNELS[name]
    source = HERE / source_file
    command = [*cxx, *FLAGS, f"-I{headers}", str(source)]
    _place(directory / library_file, _compiler_fill(command, symbols(name)))
    return {
        "library": library_file,
        "sha256": sha256(directory / library_file),
        "source": source_file,
        "source_sha256": sha256(source),
        "compiler": shlex.join(cxx),
        "flags": list(FLAGS),
    }


def _write_manifest(directory: Path, manifest: dict) -> None:
    text = json.dumps(manifest, indent=1, sort_keys=True)

    def fill(target: str, _: tuple[int, ...]) -> None:
        Path(target).write_text(text)

    _place(directory / MANIFEST, fill)


def build_into(directory: Path) -> dict:
    """Build every kernel into `directory` and record it in its `kernels.json`; a kernel
    that cannot be built is recorded with the reason. Returns the manifest."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    kernels: dict[str, dict] = {}
    manifest = {"format": FORMAT, "kernels": kernels}
    try:
        cxx = compiler()
        headers, jaxlib_version = include_dir()
        manifest["jaxlib_headers"] = jaxlib_version
    except BuildError as error:
        kernels.update({name: {"error": str(error)} for name in KERNELS})
        _write_manifest(directory, manifest)
        return manifest
    for name in KERNELS:
        try:
            kernels[name] = build_one(name, directory, cxx, headers)
        except (BuildError, OSError) as error:
            kernels[name] = {"error": str(error)}
    _write_manifest(directory, manifest)
    return manifest
