"""mkdocs hooks of the documentation site (`hooks:` in mkdocs.yml), and the API check.

- `on_pre_build` fails the build when a public name of `offload_eqx` has no
  `::: offload_eqx.NAME` block in docs/, or a block names something that is not public,
  or a name has two blocks (as optax's docs check their API pages).
- `on_files` and `on_page_markdown` include a file of the repository outside docs/ (the
  line `--8<-- "experiments/README.md"`, pymdownx.snippets' syntax), rewriting its
  relative links so that they resolve on the site: an image that exists is copied into
  the site, any other target is shown as its path in the repository. Without this hook
  pymdownx.snippets would include the file verbatim.

Plain Python, importable without mkdocs: `tests/test_docs_site.py` runs the same check
in the `tests` session, which does not install mkdocs.
"""

import posixpath
import re
import types
from collections import defaultdict
from pathlib import Path
from typing import Any

DOCS = Path(__file__).resolve().parent
REPOSITORY = DOCS.parent
PACKAGE = "offload_eqx"

# `::: offload_eqx.filter_jit`, at the start of a line (mkdocstrings' identifier syntax).
_IDENTIFIER = re.compile(rf"^:::[ \t]+{PACKAGE}\.([A-Za-z_][A-Za-z0-9_]*)[ \t]*$", re.M)
# `--8<-- "experiments/README.md"` alone on a line.
_INCLUDE = re.compile(r'^--8<--[ \t]+"([^"]+)"[ \t]*$', re.M)
# `[text](target)` and `![alt](target)`; the target without spaces or a title.
_LINK = re.compile(r"(!?)\[([^\]]*)\]\(([^)\s]+)\)")
_IMAGE_SUFFIXES = (".png", ".svg", ".jpg", ".jpeg", ".gif")


def public_names() -> set[str]:
    """The public API: `offload_eqx.__all__` when defined, else every name the package
    re-exports (`from ._jit import filter_jit as filter_jit`) that is not private and not
    a module."""
    import offload_eqx

    names = getattr(offload_eqx, "__all__", None)
    if names is None:
        names = [
            name
            for name, value in vars(offload_eqx).items()
            if not name.startswith("_") and not isinstance(value, types.ModuleType)
        ]
    return set(names)


def documented_names(docs: Path = DOCS) -> dict[str, list[str]]:
    """Each name with a `::: offload_eqx.NAME` block in docs/, and the pages that have it."""
    found: dict[str, list[str]] = defaultdict(list)
    for page in sorted(docs.rglob("*.md")):
        for name in _IDENTIFIER.findall(page.read_text(encoding="utf-8")):
            found[name].append(page.relative_to(docs).as_posix())
    return dict(found)


def api_problems(docs: Path = DOCS) -> list[str]:
    """One sentence per problem of the API pages; empty when every public name is
    documented exactly once and nothing else is."""
    public = public_names()
    documented = documented_names(docs)
    problems = []
    missing = sorted(public - documented.keys())
    if missing:
        problems.append(
            f"{len(missing)} public name(s) of {PACKAGE} have no `::: {PACKAGE}.NAME` block "
            f"in {docs}: {', '.join(missing)}. Add each to the API page of its topic "
            "(docs/api/*.md)."
        )
    for name in sorted(documented.keys() - public):
        problems.append(
            f"`::: {PACKAGE}.{name}` in {', '.join(documented[name])} names no public name "
            f"of {PACKAGE}; remove the block or export the name."
        )
    for name, pages in sorted(documented.items()):
        if len(pages) > 1:
            problems.append(
                f"`::: {PACKAGE}.{name}` appears {len(pages)} times ({', '.join(pages)}); "
                "keep one block and link to it."
            )
    return problems


def included_files(markdown: str) -> list[str]:
    """The repository paths a page includes with `--8<-- "PATH"`."""
    return _INCLUDE.findall(markdown)


def rewrite_links(text: str, source: str, images: set[str], page: str = "index.md") -> str:
    """`text` (the file at repository path `source`) with its relative links made to work
    from `page` (a path in docs/): an image in `images` (repository paths that exist) is
    linked where `on_files` puts it; every other relative target becomes its repository
    path."""
    folder = posixpath.dirname(source)
    page_folder = posixpath.dirname(page) or "."

    def replace(match: re.Match) -> str:
        bang, label, target = match.groups()
        if re.match(r"^[a-z][a-z0-9+.-]*:|^#|^/", target):  # a URL, an anchor, absolute
            return match.group(0)
        path = posixpath.normpath(posixpath.join(folder, target.split("#")[0]))
        if bang and path in images:
            return f"![{label}]({posixpath.relpath(_site_path(path), page_folder)})"
        shown = f"{label} (`{path}`)" if label and label != path else f"`{path}`"
        return shown

    return _LINK.sub(replace, text)


def _site_path(repository_path: str) -> str:
    return "_included/" + repository_path


def _images_of(source: str) -> set[str]:
    folder = posixpath.dirname(source)
    text = (REPOSITORY / source).read_text(encoding="utf-8")
    found = set()
    for bang, _, target in _LINK.findall(text):
        path = posixpath.normpath(posixpath.join(folder, target.split("#")[0]))
        if bang and path.endswith(_IMAGE_SUFFIXES) and (REPOSITORY / path).is_file():
            found.add(path)
    return found


# -- mkdocs events ---------------------------------------------------------------------


def on_pre_build(config: Any, **kwargs: Any) -> None:
    problems = api_problems(Path(config["docs_dir"]))
    if problems:
        from mkdocs.exceptions import PluginError

        raise PluginError("The API reference is incomplete:\n- " + "\n- ".join(problems))


_IMAGES: set[str] = set()


def on_files(files: Any, config: Any, **kwargs: Any) -> Any:
    from mkdocs.structure.files import File

    _IMAGES.clear()
    for page in Path(config["docs_dir"]).rglob("*.md"):
        for source in included_files(page.read_text(encoding="utf-8")):
            _IMAGES.update(_images_of(source))
    for path in sorted(_IMAGES):
        files.append(File.generated(config, _site_path(path), abs_src_path=str(REPOSITORY / path)))
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any, **kwargs: Any) -> str:
    def include(match: re.Match) -> str:
        source = match.group(1)
        text = (REPOSITORY / source).read_text(encoding="utf-8")
        return rewrite_links(text, source, _IMAGES, page.file.src_uri)

    return _INCLUDE.sub(include, markdown)
