"""The host kernel is loaded only as the package built it (`offload_eqx/_host/kernels/load.py`).

Each case runs in a process of its own, on a copy of the built kernel's folder damaged as
users' machines damage it, or beside libraries planted where the kernel used to be
cached: the loader refuses what it did not build (no planted constructor runs, which a
marker file would show), says why in `ox.host_kernels()`, never crashes, and the update
then runs as XLA compiles it.
"""

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from offload_eqx._host.kernels.compile import MANIFEST
from offload_eqx._host.kernels.load import HERE

# A library that runs code as it is loaded and has the kernel's symbols: what an attacker
# would plant.
PLANTED = r"""
#include <stdio.h>
#include <stdlib.h>
__attribute__((constructor)) static void planted(void) {
  const char* marker = getenv("OX_PLANTED_MARKER");
  FILE* f = marker ? fopen(marker, "w") : NULL;
  if (f) { fputs("the planted constructor ran", f); fclose(f); }
}
void* OffloadEqxAdamW(void* frame) { return 0; }
const char* OffloadEqxAdamWVariant(void) { return "planted"; }
"""

CHILD = textwrap.dedent(
    """
    import json, os, sys
    from pathlib import Path
    from offload_eqx._host.kernels import load
    if sys.argv[1] != "-":
        load.KERNEL_DIR = Path(sys.argv[1])
    import jax.numpy as jnp, optax
    import offload_eqx as ox
    opt = ox.offload_optimizer(optax.adamw(0.1), update_on="host", master_dtype=jnp.float32)
    p = {"w": jnp.ones((64, 64), jnp.bfloat16)}
    s = opt.init(p)
    step = ox.filter_jit(lambda g, p, s: ox.update_and_apply(opt, g, s, p))
    new, s = step(p, p, s)
    if len(sys.argv) > 2:  # cut the library short while it is loaded, then train on
        library = Path(sys.argv[2])
        library.write_bytes(library.read_bytes()[: library.stat().st_size // 50])
        new, s = step(p, new, s)
        q = {"w": jnp.ones((8, 8), jnp.bfloat16)}
        ox.filter_jit(lambda g, p, s: ox.update_and_apply(opt, g, s, p))(q, q, opt.init(q))
    print(json.dumps({"why": ox.host_kernels()["adamw"], "value": float(new["w"][0, 0])}))
    """
)


def _built() -> None:
    manifest = json.loads((HERE / MANIFEST).read_text())
    entry = manifest["kernels"]["adamw"]
    assert "error" not in entry, f"the kernel was not built with the package: {entry}"


def _run(tmp_path: Path, folder: str, *more: str, env: dict | None = None) -> dict:
    marker = tmp_path / "planted-ran"
    environ = {**os.environ, "OX_PLANTED_MARKER": str(marker), **(env or {})}
    done = subprocess.run(
        [sys.executable, "-c", CHILD, folder, *more],
        env=environ,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, f"exit {done.returncode}:\n{done.stderr[-3000:]}"
    assert not marker.exists(), "a planted library was loaded: its constructor ran"
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["value"] < 1.0  # the step trained, with or without the kernel
    return result


@pytest.fixture(scope="module")
def planted(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("planted")
    source = folder / "planted.c"
    source.write_text(PLANTED)
    library = folder / "planted.so"
    subprocess.run(["cc", "-shared", "-fPIC", str(source), "-o", str(library)], check=True)
    return library


@pytest.fixture
def copy(tmp_path) -> Path:
    """A copy of the built kernel's folder, as the build left it."""
    _built()
    folder = tmp_path / "kernels"
    folder.mkdir(mode=0o755)
    for name in ("_adamw.so", MANIFEST):
        shutil.copy2(HERE / name, folder / name)
    return folder


def test_the_copy_loads_as_the_package_does(tmp_path, copy):
    why = _run(tmp_path, str(copy))["why"]
    assert why.startswith(f"loaded from {copy / '_adamw.so'} ("), why


def test_a_library_planted_where_kernels_were_cached_is_never_loaded(tmp_path, planted):
    """Nothing is loaded from a cache, the user's or a shared one, whatever it holds."""
    caches = {
        "OFFLOAD_EQX_CACHE": tmp_path / "shared",
        "XDG_CACHE_HOME": tmp_path / "xdg",
        "HOME": tmp_path / "home",
    }
    places = [
        caches["OFFLOAD_EQX_CACHE"],
        caches["XDG_CACHE_HOME"] / "offload_eqx",
        caches["HOME"] / ".cache" / "offload_eqx",
    ]
    for place in places:
        place.mkdir(parents=True)
        place.chmod(0o777)
        for name in ("adamw-0123456789abcdef.so", "_adamw.so", "adamw.so"):
            shutil.copy(planted, place / name)
    env = {key: str(value) for key, value in caches.items()}
    why = _run(tmp_path, "-", env=env)["why"]
    assert why.startswith(f"loaded from {HERE / '_adamw.so'}"), why
    for place in places:  # and nothing is written there either
        assert sorted(p.name for p in place.iterdir()) == [
            "_adamw.so",
            "adamw-0123456789abcdef.so",
            "adamw.so",
        ]


def _plant(folder: Path, planted: Path) -> str:
    shutil.copy(planted, folder / "_adamw.so")
    return "not the library the build wrote"


def _writable_by_others(folder: Path, planted: Path) -> str:
    (folder / "_adamw.so").chmod(0o666)
    return "is writable by others (mode -rw-rw-rw-)"


def _folder_writable_by_others(folder: Path, planted: Path) -> str:
    folder.chmod(0o777)
    return "the kernels' folder"


def _symlink(folder: Path, planted: Path) -> str:
    # Even to the right bytes: a link can be turned to another file at any time.
    real = folder.parent / "elsewhere.so"
    shutil.move(folder / "_adamw.so", real)
    (folder / "_adamw.so").symlink_to(real)
    return "is a symbolic link"


def _another_users(folder: Path, planted: Path) -> str:
    os.chown(folder / "_adamw.so", 65534, 65534)
    return "belongs to user id 65534"


def _cut(fraction: float):
    def cut(folder: Path, planted: Path) -> str:
        library = folder / "_adamw.so"
        data = library.read_bytes()
        library.write_bytes(data[: int(len(data) * fraction)])
        return "not the library the build wrote"

    return cut


def _overwritten(folder: Path, planted: Path) -> str:
    library = folder / "_adamw.so"
    data = bytearray(library.read_bytes())
    data[len(data) // 4 : len(data) // 2] = bytes(len(data) // 2 - len(data) // 4)  # zeros
    library.write_bytes(bytes(data))
    return "not the library the build wrote"


def _record_removed(folder: Path, planted: Path) -> str:
    (folder / MANIFEST).unlink()
    return "it was not built with the package"


def _record_garbled(folder: Path, planted: Path) -> str:
    (folder / MANIFEST).write_text('{"kernels": ')
    return "is not a record of this build"


def _record_linked_to_a_device(folder: Path, planted: Path) -> str:
    (folder / MANIFEST).unlink()
    (folder / MANIFEST).symlink_to("/dev/zero")
    return "is a symbolic link"


def _record_vouching_for_a_planted_library(folder: Path, planted: Path) -> str:
    # Whoever can write the record can write the library: the folder must be theirs alone.
    record = json.loads((folder / MANIFEST).read_text())
    record["kernels"]["adamw"]["sha256"] = "0" * 64
    (folder / MANIFEST).write_text(json.dumps(record))
    shutil.copy(planted, folder / "_adamw.so")
    return "not the library the build wrote"


DAMAGES = {
    "planted": _plant,
    "writable_by_others": _writable_by_others,
    "folder_writable_by_others": _folder_writable_by_others,
    "symlink": _symlink,
    "another_users": _another_users,
    "cut_to_half": _cut(0.5),
    "cut_to_2_percent": _cut(0.02),
    "emptied": _cut(0.0),
    "overwritten_at_the_same_size": _overwritten,
    "record_removed": _record_removed,
    "record_garbled": _record_garbled,
    "record_linked_to_dev_zero": _record_linked_to_a_device,
    "record_vouching_for_a_planted_library": _record_vouching_for_a_planted_library,
}


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_a_damaged_or_foreign_kernel_is_refused_with_the_reason(tmp_path, copy, planted, damage):
    expected = DAMAGES[damage](copy, planted)
    why = _run(tmp_path, str(copy))["why"]
    assert why.startswith("unavailable: ") and expected in why, why


def test_a_library_cut_short_while_in_use_crashes_nothing(tmp_path, copy):
    """The kernel runs from the bytes that were checked (a private copy in memory): the
    file on disk cut to 2% between two steps is a later process's concern only."""
    result = _run(tmp_path, str(copy), str(copy / "_adamw.so"))
    assert result["why"].startswith("loaded from"), result


def test_switched_off_it_runs_as_xla_compiles_it(tmp_path):
    why = _run(tmp_path, "-", env={"OFFLOAD_EQX_HOST_KERNELS": "0"})["why"]
    assert why == "unavailable: switched off (OFFLOAD_EQX_HOST_KERNELS=0)"
