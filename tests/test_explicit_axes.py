"""Activation offload on meshes with Explicit axes (issue 10, item 13).

`jax.make_mesh` gives Explicit axes by default. On such a mesh, a scan of remat regions
whose policy offloads a value to host makes XLA:GPU and XLA:TPU fail with an internal
error about mismatched memory spaces, as soon as the backward pass needs the offloaded
value in another sharding than its type's (here: the weights are sharded on their
contracting dimension, so the weight gradient wants the saved input split the same way).
Under Explicit axes JAX pins every intermediate's sharding, the saved input stays
replicated, and the partitioner reshards it next to the host transfer: XLA:GPU then
builds a bitcast between host and device memory (`Bitcast cannot have different memory
spaces`), XLA:TPU an async copy whose operand is in the other memory (`The async-start
expects the shape of operand 0 ...`). Under Auto axes the compiler propagates the
sharding itself, saves the input already split, and compiles.

The program is valid JAX; the failure is the compiler's. The rewrite that avoids it is
to trace the scan under `jax.sharding.auto_axes`, with the carry's own sharding as the
output sharding: XLA then gets the Auto program (same host memory, to the byte), and the
rest of the step keeps its Explicit types. The strict xfail below is the compiler bug
itself: when it flips, a jax upgrade fixed XLA and the workaround can go.

The public-API tests compile on `AbstractMesh`es with `ox.filter_jit(mesh=...)`, so they
need neither 8 CPU devices nor a child process.
"""

import os
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import seed_model
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import AbstractMesh, AxisType, NamedSharding, PartitionSpec as P

import offload_eqx as ox
from offload_eqx._targets.devices import target_devices

pytestmark = pytest.mark.deviceless

EXTRAS = {"h100-8": "jax_plugins.xla_cuda12", "tpu-v5p-4": "libtpu"}
# What each compiler says (the first line of the `JaxRuntimeError`).
XLA_ERRORS = {
    "h100-8": "Bitcast cannot have different memory spaces",
    "tpu-v5p-4": "async-start expects the shape of operand",
}
LAYERS, WIDTH, BATCH = 4, 128, 8  # the TPU compiles a scan of 2 or 3 layers


def _devices(target: str) -> tuple:
    pytest.importorskip(EXTRAS[target], reason=f"needs the extra for {target}")
    assert os.environ.get("JAX_PLATFORMS") == "cpu", "deviceless compiles need JAX_PLATFORMS=cpu"
    return target_devices(target)


# -- the smallest plain-JAX program -------------------------------------------------------

POLICY = jax.checkpoint_policies.save_and_offload_only_these_names(
    names_which_can_be_saved=[],
    names_which_can_be_offloaded=["x"],
    offload_src="device",
    offload_dst="pinned_host",
)


def _layer(x, w):
    return checkpoint_name(x, "x") @ w


def _loss(ws, x, *, auto_scan: bool):
    def body(x, w):
        return jax.checkpoint(_layer, policy=POLICY)(x, w), None

    def run(ws, x):
        return jax.lax.scan(body, x, ws)[0]

    scan: Any = run
    if auto_scan:  # the workaround: the scan traced under Auto axes
        scan = jax.sharding.auto_axes(run, out_sharding=jax.typeof(x).sharding)
    return jnp.sum(scan(ws, x))


def _compile_plain(target: str, axis_type: AxisType, *, auto_scan: bool = False):
    """`jax.grad` of a 4-layer scan offloading each layer's input, the weights sharded on
    their contracting dimension over a 1-D mesh of every device of `target`."""
    mesh = jax.sharding.Mesh(np.array(_devices(target)), ("fsdp",), axis_types=(axis_type,))
    abstract = mesh.abstract_mesh
    ws = jax.ShapeDtypeStruct(
        (LAYERS, WIDTH, WIDTH), jnp.float32, sharding=NamedSharding(abstract, P(None, "fsdp"))
    )
    x = jax.ShapeDtypeStruct((BATCH, WIDTH), jnp.float32, sharding=NamedSharding(abstract, P()))

    def grad(ws, x):
        return jax.grad(_loss)(ws, x, auto_scan=auto_scan)

    with jax.set_mesh(mesh):
        return jax.jit(grad).trace(ws, x).lower().compile()


@pytest.mark.parametrize("target", list(EXTRAS))
@pytest.mark.xfail(
    strict=True,
    raises=jax.errors.JaxRuntimeError,
    reason="XLA (jax 0.10.2) cannot compile an offloaded scan residual resharded under "
    "Explicit axes; flips when the compiler is fixed",
)
def test_xla_compiles_offload_in_a_scan_under_explicit_axes(target):
    try:
        _compile_plain(target, AxisType.Explicit)
    except jax.errors.JaxRuntimeError as e:
        # The known bug, not another failure that would also satisfy `raises=`.
        assert XLA_ERRORS[target] in str(e), str(e)
        raise


@pytest.mark.parametrize("target", list(EXTRAS))
def test_the_scan_under_auto_axes_compiles_as_auto_does(target):
    auto = _compile_plain(target, AxisType.Auto).memory_analysis()
    rewritten = _compile_plain(target, AxisType.Explicit, auto_scan=True).memory_analysis()
    assert auto is not None and rewritten is not None
    # The input of every layer is on the host, exactly as much as under Auto axes.
    assert rewritten.host_temp_size_in_bytes == auto.host_temp_size_in_bytes > 0
    assert rewritten.argument_size_in_bytes == auto.argument_size_in_bytes


# -- the public API: what `ox.scan` must emit --------------------------------------------

# (mesh shape, batch spec) per target: h100-8 over (2, 4), tpu-v5p-4 over (1, 4).
MESHES = {"h100-8": (2, 4), "tpu-v5p-4": (1, 4)}
FSDP = P(None, "fsdp", None)


def _grad_step(model, x):
    return eqx.filter_grad(lambda m: jnp.sum(m(x)))(model)


def _report(target: str, strategy: str, axis_type: AxisType) -> dict:
    _devices(target)
    mesh = AbstractMesh(MESHES[target], ("data", "fsdp"), axis_types=(axis_type,) * 2)
    model = seed_model(
        LAYERS, 256, 1024, memory="device", spec=FSDP, sharding=NamedSharding(mesh, FSDP)
    )
    x = jax.ShapeDtypeStruct((64, 256), jnp.float32, sharding=NamedSharding(mesh, P("data")))
    step = ox.filter_jit(_grad_step, strategy=strategy, mesh=mesh)
    report = ox.memory_report(step, model, x, target=target).as_dict()
    return {"device": report["device"], "host": report["host"]}


@pytest.mark.parametrize("strategy", ["offload_activations", "hybrid"])
@pytest.mark.parametrize("target", list(MESHES))
def test_activation_offload_on_explicit_axes_compiles_like_auto(target, strategy):
    explicit = _report(target, strategy, AxisType.Explicit)
    auto = _report(target, strategy, AxisType.Auto)
    assert explicit["host"]["temp"] > 0  # the activations really are offloaded
    assert explicit == auto
