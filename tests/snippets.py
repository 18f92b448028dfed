"""Running the Python blocks of a Markdown file (README.md, the docs pages) as a reader
would paste them: fresh processes, `JAX_PLATFORMS=cpu`, and the text each block says it
prints ("It prints:" then a ```text block) compared with what it does print."""

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

SKIP = "<!-- docs-test: skip -->"
# A fenced block, possibly indented (inside a list or an admonition): indent, language, body.
_FENCE = re.compile(r"^([ \t]*)```(\w*)[^\n]*\n(.*?)^\1```[ \t]*$", re.S | re.M)
_PRINTS = re.compile(r"It prints[^\n]*:\s*$")
# Code that compiles for a GPU or TPU target: needs the `cuda` / `tpu` extras, which only
# the deviceless session installs.
TARGET = re.compile(r"target=\[?\"(h100|a100|tpu-)")
_MESH = re.compile(r"make_mesh|jax\.devices\(\)\[")


def blocks(path: Path) -> list[tuple[str, str | None]]:
    """Each Python block of `path` to run, with the text it must print (None: not
    stated). A block right after the line `SKIP` is not run."""
    text = path.read_text(encoding="utf-8")
    fences = list(_FENCE.finditer(text))
    found = []
    for i, fence in enumerate(fences):
        if fence.group(2) != "python":
            continue
        before = text[: fence.start()].rstrip().splitlines()
        if before and before[-1].strip() == SKIP:
            continue
        expected = None
        after = fences[i + 1] if i + 1 < len(fences) else None
        if after is not None and after.group(2) == "text":
            between = text[fence.end() : after.start()]
            if _PRINTS.search(between.strip() + "\n"):
                expected = textwrap.dedent(after.group(3))
        found.append((textwrap.dedent(fence.group(3)), expected))
    return found


def lines(text: str) -> list[str]:
    return [line.rstrip() for line in text.strip().splitlines()]


# The JAX the docs' printed outputs were printed with (`docs/limits.md`, "JAX versions").
PRINTED_WITH = "0.10.2"
_NUMBER = re.compile(r"-?\d[\d,]*(\.\d+)?(e[-+]?\d+)?")


def verdicts(text: str) -> list[str]:
    """`text` with every number a `#` and every run of spaces one: what another compiler
    prints alike (which plan fits, which wins, the units, the words)."""
    return [" ".join(_NUMBER.sub("#", line).split()) for line in lines(text)]


def as_printed(output: str, expected: str) -> bool:
    """Whether `output` is what the docs print: exactly, on the JAX they were printed
    with; elsewhere (compiler output moves with XLA) the same verdicts."""
    import jax

    if jax.__version__ == PRINTED_WITH:
        return lines(output) == lines(expected)
    return verdicts(output) == verdicts(expected)


def run_script(script: str, directory: Path, timeout: int) -> subprocess.CompletedProcess:
    """`script` run in a fresh process in `directory`, in the environment the nox sessions
    set (`JAX_PLATFORMS=cpu`; the TPU variables without which libtpu warns at start), one
    CPU device unless the script builds a mesh (then 8), no XLA flag of the caller's but
    the tests' faster compiles."""
    (directory / "script.py").write_text(script)
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env.setdefault("TPU_ACCELERATOR_TYPE", "v5p-8")
    env.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    # The reader's XLA, but for the tests' faster compiles (`conftest.FAST_COMPILE`).
    flags = [
        f for f in os.environ.get("XLA_FLAGS", "").split() if "optimization" in f or "llvm" in f
    ]
    if _MESH.search(script):
        flags.append("--xla_force_host_platform_device_count=8")
    env["XLA_FLAGS"] = " ".join(flags)
    return subprocess.run(
        [sys.executable, "script.py"],
        capture_output=True,
        text=True,
        env=env,
        cwd=directory,
        timeout=timeout,
    )
