"""Every Python block of README.md runs as pasted, each in a fresh process.

A block followed by "It prints" and a `text` block must print exactly that text, so the
numbers the README quotes are the ones a run produces. Blocks that compile for a GPU or
TPU target need the `cuda` / `tpu` extras, which only the deviceless session installs.
"""

from pathlib import Path

import pytest
from snippets import TARGET, as_printed, blocks, run_script

README = Path(__file__).resolve().parent.parent / "README.md"


def _params() -> list:
    return [
        pytest.param(
            code,
            expected,
            id=f"block{i}",
            marks=[pytest.mark.deviceless] if TARGET.search(code) else [],
        )
        for i, (code, expected) in enumerate(blocks(README))
    ]


def test_the_readme_has_python_blocks():
    assert len(blocks(README)) >= 2


@pytest.mark.parametrize(("code", "expected"), _params())
def test_readme_block_runs_as_pasted(tmp_path, code, expected):
    done = run_script(code, tmp_path, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    if expected is not None:
        assert as_printed(done.stdout, expected), done.stdout
    # Nothing on the terminal a reader is not told about: no XLA log lines, no warnings.
    assert done.stderr.strip() == "", done.stderr[-3000:]
