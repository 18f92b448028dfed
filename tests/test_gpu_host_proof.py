"""The GPU-host proof's child (`_host/kernels/gpu_host.py`, `_proof_command`) imports
this process's offload_eqx and dependencies, never a package of the same name planted on
PYTHONPATH, in its working directory or ahead in site-packages; it is given only the
environment its compile reads."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import pytest

import offload_eqx
from offload_eqx._host.kernels import gpu_host

_ROOT = Path(str(offload_eqx.__file__)).resolve().parents[1]
_JAX_SITE = Path(str(jax.__file__)).resolve().parents[1]  # where jax is installed


def test_the_proofs_child_starts_isolated_with_only_what_its_compile_reads(monkeypatch):
    for name, value in {"PYTHONPATH": "/planted", "PYTHONHOME": "/x", "LD_PRELOAD": "x.so"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/tmp/x")
    command = gpu_host._proof_command("adamw")
    assert command[:2] == [sys.executable, "-I"]
    roots = json.loads(command[4])
    assert roots[0] == str(_ROOT)
    assert str(_JAX_SITE) in roots
    assert command[5:] == [
        "offload_eqx._host.kernels.gpu_host_proof",
        "adamw",
        str(gpu_host.PROOF_CONFIG),
    ]
    env = gpu_host._proof_environment()
    assert env["JAX_PLATFORMS"] == "cpu" and env["XLA_FLAGS"] == "--xla_dump_to=/tmp/x"
    assert not {"PYTHONPATH", "PYTHONHOME", "LD_PRELOAD"} & set(env), env


def _plant(folder: Path, marker: Path) -> None:
    """A package named offload_eqx that leaves `marker` when imported."""
    (folder / "offload_eqx").mkdir(parents=True)
    code = f"open({str(marker)!r}, 'w').write('imported')\n"
    (folder / "offload_eqx" / "__init__.py").write_text(code)


_PARENT = textwrap.dedent(
    """
    import json, sys
    sys.path.insert(0, ROOT)  # this package, as a script beside it would import it
    from offload_eqx._host.kernels import gpu_host
    print(json.dumps({"target": gpu_host.target("adamw"), "kernels": gpu_host.host_kernels()}))
    """
)


@pytest.mark.deviceless
@pytest.mark.parametrize("flag", ["-I", "-E"])
def test_the_proofs_child_never_imports_a_planted_package(tmp_path, flag):
    """The parent runs isolated (`-I`) or without PYTHON* variables (`-E`), from a venv
    whose site-packages holds a planted offload_eqx (its dependencies reached by a
    `.pth` file), with another on PYTHONPATH and a third in its working directory: the
    child (the real proof, an h100 compile) imports none of them, and registers the
    kernel. It imported the PYTHONPATH and site-packages ones (`-P -m` honours both)."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    (site,) = venv.glob("lib/python*/site-packages")
    (site / "dependencies.pth").write_text(f"{_JAX_SITE}\n")
    markers = {where: tmp_path / f"imported from {where}" for where in ("site", "path", "cwd")}
    _plant(site, markers["site"])
    _plant(tmp_path / "pythonpath", markers["path"])
    _plant(tmp_path / "work", markers["cwd"])
    env = {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "PYTHONPATH": str(tmp_path / "pythonpath"),
        "XDG_CACHE_HOME": str(tmp_path / "cache"),
    }
    done = subprocess.run(
        [str(venv / "bin" / "python"), flag, "-c", _PARENT.replace("ROOT", repr(str(_ROOT)))],
        cwd=tmp_path / "work", env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-3000:])
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert [where for where, marker in markers.items() if marker.exists()] == [], found
    assert found["target"] == "offload_eqx_adamw", found
    assert found["kernels"]["adamw on the GPU's host"].startswith("registered"), found
