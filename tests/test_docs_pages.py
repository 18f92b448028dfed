"""The Python blocks of every documentation page run, so the docs stay true.

Each page's ```python blocks run concatenated, in page order, in one fresh process with
`JAX_PLATFORMS=cpu` (as a reader pasting them one after the other would). A block followed
by a sentence ending in "It prints:" and a ```text block must print exactly that text.
A block right after the line `<!-- docs-test: skip -->` is not run (it needs what no test
machine has: several processes on several hosts, say). Pages that compile for a GPU or TPU
target need the `cuda` / `tpu` extras, which only the deviceless session installs; pages
that build a mesh get 8 CPU devices (`--xla_force_host_platform_device_count=8`).
"""

from pathlib import Path

import pytest
from snippets import TARGET, as_printed, blocks, run_script

DOCS = Path(__file__).resolve().parent.parent / "docs"
# Printed after each block, so the output of one block can be told from the next's.
_SEPARATOR = "=== end of docs block ==="


def _pages() -> list:
    params = []
    for page in sorted(DOCS.rglob("*.md")):
        found = blocks(page)
        if not found:
            continue
        code = "\n".join(block for block, _ in found)
        marks = [pytest.mark.deviceless] if TARGET.search(code) else []
        params.append(pytest.param(page, id=page.relative_to(DOCS).as_posix(), marks=marks))
    return params


def test_the_pages_have_python_blocks():
    assert len(_pages()) >= 5


@pytest.mark.parametrize("page", _pages())
def test_page_blocks_run(tmp_path, page):
    found = blocks(page)
    script = "\n".join(f"{code}\nprint({_SEPARATOR!r}, flush=True)\n" for code, _ in found)
    done = run_script(script, tmp_path, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    outputs = done.stdout.split(_SEPARATOR + "\n")
    assert len(outputs) == len(found) + 1, done.stdout[-3000:]
    for i, ((code, expected), output) in enumerate(zip(found, outputs)):
        if expected is not None:
            assert as_printed(output, expected), f"block {i} of {page.name}:\n{code}\n{output}"
    # Nothing on the terminal a reader is not told about: no XLA log lines, no warnings.
    assert done.stderr.strip() == "", done.stderr[-3000:]
