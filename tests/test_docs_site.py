"""The documentation site's checks, run without building it (mkdocs is not installed here).

`docs/_hooks.py` is the mkdocs hook that fails `nox -s docs` when a public name of
offload_eqx has no `::: offload_eqx.NAME` block; these tests run the same check, so a name
added to the package without a page fails the unit tests too.
"""

import importlib.util
import re
from pathlib import Path

import pytest

REPOSITORY = Path(__file__).resolve().parent.parent
DOCS = REPOSITORY / "docs"


def _hooks():
    spec = importlib.util.spec_from_file_location("docs_hooks", DOCS / "_hooks.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_public_name_is_on_the_api_pages():
    assert _hooks().api_problems() == []


def test_the_public_names_are_the_package_exports():
    import offload_eqx as ox

    names = _hooks().public_names()
    assert {"filter_jit", "Strategy", "compare_memory", "StepEstimate", "ContractError"} <= names
    assert all(not name.startswith("_") for name in names)
    assert all(hasattr(ox, name) for name in names)


def test_a_missing_name_fails_the_check(tmp_path):
    hooks = _hooks()
    names = sorted(hooks.public_names())
    kept = [name for name in names if name != "compare_memory"]
    (tmp_path / "api.md").write_text("".join(f"::: offload_eqx.{n}\n\n" for n in kept))
    (tmp_path / "more.md").write_text("::: offload_eqx.filter_jit\n\n::: offload_eqx.Gone\n")
    problems = hooks.api_problems(tmp_path)
    assert len(problems) == 3, problems
    assert "compare_memory" in problems[0] and "docs/api" in problems[0]
    assert "`::: offload_eqx.Gone` in more.md names no public name" in problems[1]
    assert "`::: offload_eqx.filter_jit` appears 2 times (api.md, more.md)" in problems[2]


def test_block_options_do_not_hide_a_name(tmp_path):
    hooks = _hooks()
    (tmp_path / "a.md").write_text("::: offload_eqx.Plan\n    options:\n      members: []\n")
    assert hooks.documented_names(tmp_path) == {"Plan": ["a.md"]}


def test_every_page_is_in_the_navigation():
    config = (REPOSITORY / "mkdocs.yml").read_text()
    nav = config[config.index("\nnav:") :]
    listed = set(re.findall(r"([\w/.-]+\.md)\s*$", nav, re.M))
    pages = {p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md")}
    assert pages == listed


def test_the_build_is_strict_and_runs_the_hook():
    config = (REPOSITORY / "mkdocs.yml").read_text()
    assert re.search(r"^strict: true$", config, re.M)
    assert re.search(r"^hooks:\n  - docs/_hooks.py$", config, re.M)


def test_the_results_page_includes_the_experiments_readme():
    hooks = _hooks()
    assert hooks.included_files((DOCS / "results.md").read_text()) == ["experiments/README.md"]


@pytest.mark.parametrize(
    ("link", "rewritten"),
    [
        ("[the decoder](_decoder.py)", "the decoder (`experiments/_decoder.py`)"),
        ("[README](../README.md#install)", "README (`README.md`)"),
        ("![plot](results/planner.png)", "plot (`experiments/results/planner.png`)"),
        ("[JAX](https://jax.readthedocs.io)", "[JAX](https://jax.readthedocs.io)"),
        ("[above](#planner)", "[above](#planner)"),
    ],
)
def test_included_links_resolve_or_become_paths(link, rewritten):
    assert _hooks().rewrite_links(link, "experiments/README.md", set()) == rewritten


def test_an_included_image_that_exists_is_linked_into_the_site():
    hooks = _hooks()
    images = {"experiments/results/planner.png"}
    text = hooks.rewrite_links("![plot](results/planner.png)", "experiments/README.md", images)
    assert text == "![plot](_included/experiments/results/planner.png)"
    nested = hooks.rewrite_links(
        "![plot](results/planner.png)", "experiments/README.md", images, "guides/x.md"
    )
    assert nested == "![plot](../_included/experiments/results/planner.png)"
