"""Every Python block of README.md runs as pasted, each in a fresh process.

A block followed by "It prints" and a `text` block must print exactly that text, so the
numbers the README quotes are the ones a run produces. Blocks that compile for a GPU or
TPU target need the `cuda` / `tpu` extras, which only the deviceless session installs.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"
# A fenced block: its language and body.
_FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
_PRINTS = re.compile(r"It prints[^\n]*:\s*$")
_TARGET = re.compile(r"target=\"(h100|tpu-v5p)")


def _blocks() -> list[tuple[str, str | None]]:
    """Each Python block, with the text it must print (None: not stated)."""
    text = README.read_text()
    fences = list(_FENCE.finditer(text))
    found = []
    for i, fence in enumerate(fences):
        if fence.group(1) != "python":
            continue
        expected = None
        after = fences[i + 1] if i + 1 < len(fences) else None
        if after is not None and after.group(1) == "text":
            between = text[fence.end() : after.start()]
            if _PRINTS.search(between.strip() + "\n"):
                expected = after.group(2)
        found.append((fence.group(2), expected))
    return found


def _params() -> list:
    params = []
    for i, (code, expected) in enumerate(_blocks()):
        marks = [pytest.mark.deviceless] if _TARGET.search(code) else []
        params.append(pytest.param(code, expected, id=f"block{i}", marks=marks))
    return params


def test_the_readme_has_python_blocks():
    assert len(_blocks()) >= 2


@pytest.mark.parametrize(("code", "expected"), _params())
def test_readme_block_runs_as_pasted(tmp_path, code, expected):
    script = tmp_path / "block.py"
    script.write_text(code)
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)  # as a newcomer's shell: one CPU device
    done = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    if expected is not None:
        lines = [line.rstrip() for line in done.stdout.strip().splitlines()]
        assert lines == [line.rstrip() for line in expected.strip().splitlines()]
    # Nothing on the terminal a reader is not told about: no XLA log lines, no warnings.
    assert done.stderr.strip() == "", done.stderr[-3000:]
