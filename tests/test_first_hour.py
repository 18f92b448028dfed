"""A newcomer's first hour: the README's model under `ox.fit`, what `help()` shows, the
README's first screen, and the plots on the results page."""

import importlib
import inspect
import re
import sys
import types
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
import pytest
from snippets import blocks

import offload_eqx as ox

REPOSITORY = Path(__file__).resolve().parent.parent
README = REPOSITORY / "README.md"
DOCS = REPOSITORY / "docs"
EXPERIMENTS = REPOSITORY / "experiments"

# -- The README's first model: an offloaded name under the `save` base ------------------

LAYERS, WIDTH = 2, 16


class Block(eqx.Module):
    w_in: jax.Array = ox.field(memory="pinned_host")
    w_out: jax.Array = ox.field(memory="pinned_host")
    activation: str = eqx.field(static=True, default="gelu")

    def __call__(self, x):
        function = {"gelu": jax.nn.gelu, "tanh": jnp.tanh, "relu": jax.nn.relu}
        h = ox.name(function[self.activation](x @ self.w_in), "h")
        return x + h @ self.w_out


class Model(eqx.Module):
    blocks: Block
    activations: ox.Activations = ox.activations(h="offload")

    def __call__(self, x):
        return ox.scan(self.blocks, x)


def _model(activation="gelu", dtype=jnp.float32):
    k1, k2 = jax.random.split(jax.random.key(0))
    return Model(
        Block(
            jax.random.normal(k1, (LAYERS, WIDTH, 4 * WIDTH), dtype) * WIDTH**-0.5,
            jax.random.normal(k2, (LAYERS, 4 * WIDTH, WIDTH), dtype) * (4 * WIDTH) ** -0.5,
            activation,
        )
    )


def _loss(model, x):
    return jnp.mean(model(x).astype(jnp.float32) ** 2)


# What `ox.fit` tries first under the base that keeps everything: one name offloaded.
SAVE_BUT_OFFLOAD_H = ox.Strategy(
    "save[h=offload]", params="device", optimizer="device", activations="save",
    names={"h": "offload"},
)  # fmt: skip


@pytest.mark.parametrize("activation", ["gelu", "tanh", "relu"])
def test_a_name_offloaded_under_the_save_base_is_offloaded(activation):
    """`h` feeds a matmul, whose backward pass reads it: under `save` with `h` offloaded it
    goes to host memory and back once per layer, and the gradients are unchanged."""
    model = ox.place(_model(activation), SAVE_BUT_OFFLOAD_H)
    x = jnp.ones((8, WIDTH))
    grad = ox.filter_jit(eqx.filter_grad(_loss), strategy=SAVE_BUT_OFFLOAD_H)
    report = ox.audit(grad, model, x)
    (down,) = report.select("device-to-host", "h", kind="activation")
    (up,) = report.select("host-to-device", "h", kind="activation")
    assert down.count == up.count == LAYERS
    ours = grad(model, x)
    theirs = eqx.filter_jit(eqx.filter_grad(_loss))(model, x)
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs), strict=True):
        assert jnp.allclose(a, b, rtol=1e-6, atol=1e-7)


def test_a_name_nothing_reads_is_refused_without_guessing_the_operations():
    """The refusal is true here (a sum's derivative reads nothing), and says so without
    naming operations it did not look at."""

    class Head(eqx.Module):
        w: jax.Array

        def __call__(self, x):
            return ox.name(x @ self.w, "h")

    class Net(eqx.Module):
        head: Head
        activations: ox.Activations = ox.activations(h="offload")

        def __call__(self, x):
            return ox.checkpoint(self.head, x)

    grad = eqx.filter_grad(lambda net, x: jnp.sum(net(x)))
    with pytest.raises(ox.ContractError, match="never reads it") as raised:
        ox.filter_jit(grad)(Net(Head(jnp.ones((4, 4)))), jnp.ones((2, 4)))
    assert not re.search(r"relu|a sum", str(raised.value))


@pytest.mark.deviceless
def test_fit_on_the_readme_model_searches_h_offloaded_under_save():
    """`ox.fit` on the README's first example (smaller) once said that the backward pass
    never reads `h` and left it out of the search."""
    opt = ox.offload_optimizer(optax.adamw(1e-4), stream="layer", layers=LAYERS)

    def train_step(model, opt_state, x):
        loss, grads = eqx.filter_value_and_grad(_loss)(model, x)
        model, opt_state = ox.update_and_apply(opt, grads, opt_state, model)
        return model, opt_state, loss

    model = eqx.filter_eval_shape(_model, "gelu", jnp.bfloat16)
    opt_state = eqx.filter_eval_shape(opt.init, model)
    x = jax.ShapeDtypeStruct((64, WIDTH), jnp.bfloat16)
    result = ox.fit(ox.filter_jit(train_step), model, opt_state, x, target="h100")
    assert not [note for note in result.notes if "never reads" in note], result.notes
    assert any(c.label.startswith("save[h=offload]") for c in result.candidates)


# -- What help() shows ------------------------------------------------------------------

# A private module named in a docstring: `_fit.py`, `offload_eqx._fit`, "the module doc".
_PRIVATE = re.compile(r"\b_[a-z][a-z_]*\.py\b|offload_eqx\._|\bthe module doc\b|`_[a-z]\w*`")


def _public_docstrings():
    names = getattr(ox, "__all__", None) or [
        name
        for name, value in vars(ox).items()
        if not name.startswith("_") and not isinstance(value, types.ModuleType)
    ]
    for name in sorted(names):
        value = getattr(ox, name)
        yield name, inspect.getdoc(value) or ""
        if isinstance(value, type):
            for member, attribute in vars(value).items():
                if not member.startswith("_") and (
                    callable(attribute) or isinstance(attribute, property)
                ):
                    yield f"{name}.{member}", inspect.getdoc(attribute) or ""


def test_public_docstrings_name_no_private_module():
    found = [
        f"{where}: {line.strip()}"
        for where, doc in _public_docstrings()
        for line in doc.splitlines()
        if _PRIVATE.search(line)
    ]
    assert found == []


def test_the_package_docstring_is_for_users():
    doc = ox.__doc__ or ""
    assert not _PRIVATE.search(doc) and not re.search(r"`_[a-z]", doc), doc
    for entry in ("ox.field", "ox.filter_jit", "ox.audit", "ox.memory_report", "ox.fit"):
        assert entry in doc
    assert "nox -s docs" in doc and "README.md" in doc


def test_the_developer_notes_place_every_module():
    """The layering notes left the package docstring for CONTRIBUTING.md, which names
    every private module."""
    notes = (REPOSITORY / "CONTRIBUTING.md").read_text(encoding="utf-8")
    package = REPOSITORY / "offload_eqx"
    folders = sorted(p.parent.name for p in package.glob("_*/__init__.py"))
    modules = sorted(p.stem for p in package.glob("**/*.py") if p.stem != "__init__")
    assert folders, "the layers are folders of the package"
    missing = [f"{f}/" for f in folders if f"`{f}/`" not in notes]
    missing += [m for m in modules if f"`{m}`" not in notes]
    assert missing == []


# -- The README's first screen ----------------------------------------------------------


def _first_screen() -> str:
    text = README.read_text(encoding="utf-8")
    return text[: text.index("```python")]


def test_the_readme_says_why_before_what_and_how_to_install():
    screen = _first_screen()
    why = screen.index("memory")
    assert why < screen.index("offload_eqx declares")
    assert "silently" in screen[: screen.index("offload_eqx declares")]
    assert re.search(r"git clone \S+offload_eqx && cd offload_eqx", screen)
    # The first example compiles for an H100: the install the reader runs includes `cuda`.
    assert 'pip install -e ".[cuda]"' in screen and 'target="h100"' in screen


def test_the_readme_is_short_and_its_first_example_fits_the_first_screen():
    """A reader sees the first example whole before scrolling far: it ends by line 60,
    and the README stays within 250 lines (the guides hold the rest)."""
    lines = README.read_text(encoding="utf-8").splitlines()
    opening = lines.index("```python")
    end = lines.index("```", opening + 1) + 1  # 1-based line of the closing fence
    assert end <= 60, f"the first example ends on line {end}"
    assert len(lines) <= 250, f"README.md has {len(lines)} lines"


def test_every_readme_python_block_shows_what_it_prints():
    assert [expected is not None for _, expected in blocks(README)] == [True] * len(blocks(README))


# -- The plots on the results page ------------------------------------------------------

# Each experiment that draws a plot, and the file its `--smoke` run writes.
PLOTS = (  # (the experiment that draws it, the plot)
    ("activation_offloading.py", "activation_offloading.png"),
    ("parameter_offloading.py", "parameter_offloading.png"),
    ("optimizer_offloading.py", "optimizer_offloading.png"),
    ("transformer_offload.py", "transformer_offload.png"),
    ("planner.py", "planner_smoke.png"),
    ("planner.py", "planner_13b_timeline.png"),  # planner.py --timeline
    ("host_update.py", "host_update_13b_timeline.png"),  # host_update.py --headline
)
_IMAGE = re.compile(r"!\[[^\]]*\]\((plots/[\w.-]+\.png)\)\n\n([^\n]+)")


def test_the_results_page_shows_every_experiments_plot_with_a_takeaway():
    page = (DOCS / "results.md").read_text(encoding="utf-8")
    images = dict(_IMAGE.findall(page))
    assert sorted(Path(path).name for path in images) == sorted(plot for _, plot in PLOTS)
    for path, takeaway in images.items():
        assert (DOCS / path).is_file(), path  # in the repository: no experiment run needed
        assert takeaway.startswith("**Takeaway:**"), takeaway
    for script, _ in PLOTS:
        assert (EXPERIMENTS / script).is_file()


def _experiment_module(name: str):
    sys.path.insert(0, str(EXPERIMENTS))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(EXPERIMENTS))


def _legend_of(monkeypatch, draw) -> list[str]:
    """The legend labels of the figure `draw()` saves."""
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure  # pyright: ignore[reportMissingImports]

    labels: list[str] = []

    def savefig(figure, *args, **kwargs):
        labels.extend(t.get_text() for legend in figure.legends for t in legend.get_texts())

    monkeypatch.setattr(Figure, "savefig", savefig)
    draw()
    return labels


def test_the_tutorial_plots_list_only_what_they_draw(monkeypatch, tmp_path):
    """A CPU-only run (no `cuda` extra) has no published figure and, here, no tutorial
    program: neither is in the legend."""
    report = _experiment_module("_report")
    total = {"total": 40 * 2**20}
    rows = [
        {
            "target": "cpu", "program": "offload x", "tutorial": None, "offload_eqx": total,
            "bound": 30 * 2**20, "published_total": None, "refused": None,
        }
    ]  # fmt: skip
    labels = _legend_of(
        monkeypatch,
        lambda: report._plot("activation", rows, 2**20, "MiB", str(tmp_path / "a.png")),
    )
    assert labels == ["offload_eqx", "analytic lower bound"]


def test_the_planner_plot_lists_only_what_it_draws(monkeypatch, tmp_path):
    """A smoke search compiles one plan, which fits: no 'does not fit' or 'over a budget'
    entries; the candidates priced by the count alone are not drawn, nor listed."""
    planner = _experiment_module("_planner_report")
    gb = 1e9

    def candidate(memory, seconds, compiled, status=""):
        return {
            "seconds": seconds, "compiled_by": "ox.fit" if compiled else None,
            "device_bytes": memory * gb if compiled else None, "predicted_device": memory * gb,
            "bound_only": False, "fits": True if compiled else None, "status": status,
            "simulated_seconds": seconds if compiled else None,
        }  # fmt: skip

    results = [
        {
            "config": "1B", "target": "h100", "chosen": "save[-]", "capacity": 85 * gb,
            "search": {"error": None},
            "presets": [{"plan": "full_remat", "device": 12 * gb, "seconds": 0.32,
                         "fits": True, "error": None}],
            "candidates": [candidate(60, 0.25, True, "best"), candidate(10, 0.3, False)],
        }
    ]  # fmt: skip
    labels = _legend_of(monkeypatch, lambda: planner.plot(results, tmp_path / "p.png", 4))
    assert "compiled, does not fit" not in labels
    assert not any("over a budget" in label or "not compiled" in label for label in labels)
    assert {"compiled, fits", "ox.fit's plan", "Pareto front"} <= set(labels)
