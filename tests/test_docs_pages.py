"""The Python blocks of every documentation page run, so the docs stay true.

Each page's ```python blocks run concatenated, in page order, in one fresh process with
`JAX_PLATFORMS=cpu` (as a reader pasting them one after the other would). A block followed
by a sentence ending in "It prints:" and a ```text block must print exactly that text.
A block right after the line `<!-- docs-test: skip -->` is not run (it needs what no test
machine has: several processes on several hosts, say). Pages that compile for a GPU or TPU
target need the `cuda` / `tpu` extras, which only the deviceless session installs; pages
that build a mesh get 8 CPU devices (`--xla_force_host_platform_device_count=8`).
"""

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parent.parent / "docs"
SKIP = "<!-- docs-test: skip -->"
# A fenced block, possibly indented (inside a list or an admonition): indent, language, body.
_FENCE = re.compile(r"^([ \t]*)```(\w*)[^\n]*\n(.*?)^\1```[ \t]*$", re.S | re.M)
_PRINTS = re.compile(r"It prints[^\n]*:\s*$")
_TARGET = re.compile(r"target=\[?\"(h100|a100|tpu-)")
_MESH = re.compile(r"make_mesh|jax\.devices\(\)\[")
# Printed after each block, so the output of one block can be told from the next's.
_SEPARATOR = "=== end of docs block ==="


def _blocks(page: Path) -> list[tuple[str, str | None]]:
    """Each Python block of `page` to run, with the text it must print (None: not stated)."""
    text = page.read_text(encoding="utf-8")
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


def _pages() -> list:
    params = []
    for page in sorted(DOCS.rglob("*.md")):
        blocks = _blocks(page)
        if not blocks:
            continue
        code = "\n".join(block for block, _ in blocks)
        marks = [pytest.mark.deviceless] if _TARGET.search(code) else []
        params.append(pytest.param(page, id=page.relative_to(DOCS).as_posix(), marks=marks))
    return params


def _lines(text: str) -> list[str]:
    return [line.rstrip() for line in text.strip().splitlines()]


def test_the_pages_have_python_blocks():
    assert len(_pages()) >= 5


@pytest.mark.parametrize("page", _pages())
def test_page_blocks_run(tmp_path, page):
    blocks = _blocks(page)
    script = "\n".join(f"{code}\nprint({_SEPARATOR!r}, flush=True)\n" for code, _ in blocks)
    (tmp_path / "page.py").write_text(script)
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    # As the nox sessions set them: without them libtpu prints warnings at start.
    env.setdefault("TPU_ACCELERATOR_TYPE", "v5p-8")
    env.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    env.pop("XLA_FLAGS", None)
    if _MESH.search(script):
        env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    done = subprocess.run(
        [sys.executable, "page.py"],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    outputs = done.stdout.split(_SEPARATOR + "\n")
    assert len(outputs) == len(blocks) + 1, done.stdout[-3000:]
    for i, ((code, expected), output) in enumerate(zip(blocks, outputs)):
        if expected is not None:
            assert _lines(output) == _lines(expected), f"block {i} of {page.name}:\n{code}"
    # Nothing on the terminal a reader is not told about: no XLA log lines, no warnings.
    assert done.stderr.strip() == "", done.stderr[-3000:]
