"""The package's layers: each folder imports only from itself and the folders listed before
it (CONTRIBUTING.md's table), and no module hides an import of the package in a function."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "offload_eqx"
# Bottom layer first: a folder may import the folders before it.
LAYERS = (
    "_base",
    "_declare",
    "_sharding",
    "_host",
    "_plan",
    "_trace",
    "_arrays",
    "_checkpoints",
    "_jit",
    "_optimizer",
    "_targets",
    "_inspect",
    "_planning",
    "_fit",
)


def _imports(path: Path, package_root: Path = PACKAGE) -> list[tuple[str, int, bool]]:
    """The package folders `path` imports: (folder, line, inside a function)."""
    parts = path.relative_to(package_root.parent).with_suffix("").parts
    package = parts[:-1]  # an `__init__` module's package is its own folder
    tree = ast.parse(path.read_text(encoding="utf-8"))
    in_function = {
        id(node)
        for fn in ast.walk(tree)
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
        for node in ast.walk(fn)
    }
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                target = (*base, *(node.module.split(".") if node.module else ()))
            else:
                target = tuple((node.module or "").split("."))
        elif isinstance(node, ast.Import):
            target = tuple(node.names[0].name.split("."))
        else:
            continue
        if target[:1] == ("offload_eqx",) and len(target) > 1:
            found.append((target[1], node.lineno, id(node) in in_function))
    return found


def test_every_folder_is_a_layer():
    folders = {p.parent.name for p in PACKAGE.glob("*/__init__.py")}
    assert folders == set(LAYERS)
    for folder in LAYERS:
        doc = ast.get_docstring(ast.parse((PACKAGE / folder / "__init__.py").read_text()))
        assert doc and "import" in doc, f"{folder}/__init__.py says what it may import"


def _upward(root: Path) -> list[str]:
    upward = []
    for path in sorted(root.glob("_*/**/*.py")):
        folder = path.relative_to(root).parts[0]
        for target, line, _ in _imports(path, root):
            if target in LAYERS and LAYERS.index(target) > LAYERS.index(folder):
                upward.append(f"{path.relative_to(root)}:{line} imports {target}")
    return upward


def test_folders_import_only_the_layers_below():
    assert _upward(PACKAGE) == []


def test_no_module_imports_the_package_inside_a_function():
    hidden = [
        f"{path.relative_to(PACKAGE)}:{line}"
        for path in sorted(PACKAGE.glob("**/*.py"))
        if path.name != "_pytest_plugin.py"  # loads before jaxtyping's hook: lazy on purpose
        for _, line, inside in _imports(path)
        if inside
    ]
    assert hidden == []


def test_the_check_sees_an_upward_import(tmp_path):
    """Relative and absolute imports of a later layer are both caught; earlier ones pass."""
    root = tmp_path / "offload_eqx"
    (root / "_plan").mkdir(parents=True)
    (root / "_plan" / "__init__.py").write_text("")
    (root / "_plan" / "a.py").write_text(
        "from .._declare.strategy import Strategy\n"
        "from .._fit.fit import fit\n"
        "import offload_eqx._jit.jit\n"
        "from .leaf import LeafPlan\n"
    )
    assert _upward(root) == ["_plan/a.py:2 imports _fit", "_plan/a.py:3 imports _jit"]
