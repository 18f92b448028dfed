"""The JAX offload_eqx runs on: every private name it uses found (and a missing one an
error at import naming it), the JAX installed one offload_eqx was checked on, and the
XLA limits its designs rest on, each a test that fails when a JAX release lifts it
(`docs/limits.md`). Run on every JAX pair of the matrix (`noxfile.py`)."""

import ast
import importlib
import itertools
import subprocess
import sys
import textwrap
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest
from helpers import computed_on_host

from offload_eqx._base import equinox_private, jax_private


def test_the_installed_jax_and_equinox_were_checked():
    """A JAX or Equinox release not in the lists is one offload_eqx was not checked on:
    check its private names (`offload_eqx/_base/`) and the limits below, then add it."""
    assert jax.__version__ in jax_private.CHECKED, jax.__version__
    assert eqx.__version__ in equinox_private.CHECKED, eqx.__version__


def test_every_private_name_is_found():
    names = [n for n in vars(jax_private) if not n.startswith("__")]
    for name in names:
        assert getattr(jax_private, name) is not None, name
    assert jax_private.current_trace() is not None
    assert len(jax_private.CALLBACK_PRIMITIVES) == 4
    # Equinox's are optional; on a checked Equinox, every one is there.
    assert equinox_private.equinox_jit is not None
    assert hasattr(equinox_private.equinox_jit, "last_error_info")
    assert equinox_private.SharedNode != ()
    assert isinstance(equinox_private.cache_clears, list)


def test_a_private_name_a_release_removed_fails_naming_it():
    with pytest.raises(jax_private.MissingInternal) as error:
        jax_private._lookup(("jax._src.nowhere:gone", "jax._src.core:gone"), "a test")
    message = str(error.value)
    assert "`jax._src.nowhere.gone` or `jax._src.core.gone` (a test)" in message
    assert f"jax {jax.__version__} does not have" in message
    assert "checked on jax 0.10.2 and 0.12.0.1" in message


def _private_names_table() -> list[str]:
    """The rows of `docs/limits.md`'s table of private names."""
    text = (Path(__file__).parents[1] / "docs" / "limits.md").read_text()
    table = text.split("| private name | what for | module that uses it | checked on |")[1]
    lines = table.strip().splitlines()[1:]  # after the header's rule
    return list(itertools.takewhile(lambda line: line.startswith("|"), lines))


def _looked_up() -> list[str]:
    """Every "module:name" `jax_private` looks up (each `_lookup` call's paths)."""
    tree = ast.parse(Path(jax_private.__file__).read_text())
    calls = [
        call
        for call in ast.walk(tree)
        if isinstance(call, ast.Call) and getattr(call.func, "id", None) == "_lookup"
    ]
    paths = [path for call in calls for path in getattr(call.args[0], "elts", ())]
    # Each path as the module computes it (f"{_PE}:dce_jaxpr" included).
    found = [
        eval(compile(ast.Expression(path), "jax_private", "eval"), dict(vars(jax_private)))
        for path in paths
    ]
    assert len(calls) >= 18 and all(isinstance(path, str) for path in found), found
    return found


def test_every_private_name_looked_up_has_a_row_in_the_limits_table():
    """`docs/limits.md` lists every private name of JAX offload_eqx looks up, each row
    with every JAX version it was checked on: a name added without its row fails here."""
    looked_up = _looked_up()
    rows = [row for row in _private_names_table() if "jax._src" in row]
    missing = []
    for path in looked_up:
        module, _, name = path.partition(":")
        first_cells = [row.split(" | ")[0] for row in rows]
        if not any(
            f"`{module}.{name}`" in cell or (f"`{name}`" in cell and f"`{module}." in cell)
            for cell in first_cells
        ):
            missing.append(f"{module}.{name}")
    assert missing == [], f"private names with no row in docs/limits.md: {missing}"
    for row in rows:
        assert all(version in row.split(" | ")[-1] for version in jax_private.CHECKED), row


def test_a_jax_without_cuda_versions_names_the_internal_not_the_extra(monkeypatch):
    """With `jax._src.lib.cuda_versions` gone every h100 compile said "install the `cuda`
    extra" (installed); now it names the internal and the JAX. Without the plugin (the
    name is None) it still names the extra."""
    pytest.importorskip("jax_plugins.xla_cuda12", reason="needs the 'cuda' extra")
    from offload_eqx._targets.devices import require_compiler
    from offload_eqx._targets.targets import get_target

    lib = importlib.import_module("jax._src.lib")
    monkeypatch.delattr(lib, "cuda_versions")
    with pytest.raises(jax_private.MissingInternal) as error:
        require_compiler(get_target("h100"))
    message = str(error.value)
    assert "`jax._src.lib.cuda_versions` (the CUDA plugin's version queries" in message
    assert f"jax {jax.__version__} does not have" in message and "extra" not in message
    monkeypatch.setattr(lib, "cuda_versions", None, raising=False)
    with pytest.raises(ImportError, match=r"\(jax loaded no CUDA plugin\).*extra 'cuda'"):
        require_compiler(get_target("h100"))


def _h100_host():
    from offload_eqx._targets.devices import target_mesh

    mesh = target_mesh("h100")
    spec = jax.sharding.PartitionSpec()
    return mesh, jax.sharding.NamedSharding(mesh.abstract_mesh, spec, memory_kind="pinned_host")


@pytest.mark.deviceless
def test_limit_a_host_computations_results_get_buffers_of_their_own():
    """XLA:GPU writes a host computation's results into buffers of their own, then
    copies them into a donated argument: the state is held twice while it runs
    (`docs/limits.md`). When a release aliases them, the host update can hold it once."""
    mesh, host = _h100_host()
    update = computed_on_host(jax.jit(lambda w, g: w - 0.1 * g), out=jax.memory.Space.Host)
    step = jax.jit(update, donate_argnums=0, out_shardings=host)
    w = jax.ShapeDtypeStruct((1024, 1024), jnp.float32, sharding=host)
    with jax.set_mesh(mesh):
        compiled = step.trace(w, w).lower().compile()
    analysis, text = compiled.memory_analysis(), compiled.as_text()
    assert analysis is not None and text is not None
    assert analysis.host_argument_size_in_bytes == 2 * 4 * 2**20
    assert analysis.host_alias_size_in_bytes == 4 * 2**20  # `w` donated to the output,
    assert analysis.host_temp_size_in_bytes == 4 * 2**20  # but the result is a buffer
    entry = text.split("\nENTRY ")[1]
    (root,) = [line for line in entry.splitlines() if line.lstrip().startswith("ROOT ")]
    assert "copy(" in root and "call-done" in root, root  # copied into `w` after the call


_ABORTS = textwrap.dedent(
    """
    import jax, jax.numpy as jnp, numpy as np
    from offload_eqx._host.kernels.load import target
    from offload_eqx._targets.devices import target_mesh
    import sys
    sys.path.insert(0, "tests")
    from helpers import computed_on_host
    name = target("adamw")
    assert name is not None
    def kernel(x):
        s = jnp.zeros(12, jnp.float32)
        out = jax.ffi.ffi_call(name, [jax.ShapeDtypeStruct(x.shape, x.dtype)] * 4)
        return out(s, x, x, x, x, flags=np.zeros(1, np.int8))[0]
    mesh = target_mesh("h100")
    host = jax.sharding.NamedSharding(
        mesh.abstract_mesh, jax.sharding.PartitionSpec(), memory_kind="pinned_host"
    )
    x = jax.ShapeDtypeStruct((256,), jnp.float32, sharding=host)
    step = jax.jit(computed_on_host(kernel, out=jax.memory.Space.Host), out_shardings=host)
    with jax.set_mesh(mesh):
        step.trace(x).lower().compile()
    print("compiled")
    """
)


@pytest.mark.deviceless
def test_limit_the_gpus_host_code_finds_no_kernel_registered_with_jax():
    """XLA:GPU compiles a host computation with the CUDA plugin's own XLA:CPU, which looks
    custom calls up in the plugin's FFI registry: a kernel registered through
    `jax.ffi.register_ffi_target(..., platform="cpu")` is not there and the compile
    aborts the process. When a release shares the registry, the GPU's host can run it."""
    done = subprocess.run(
        [sys.executable, "-c", _ABORTS], capture_output=True, text=True, timeout=300
    )
    assert done.returncode < 0, (done.returncode, done.stdout, done.stderr[-2000:])
    assert "No FFI handler registered for offload_eqx_adamw" in done.stderr
