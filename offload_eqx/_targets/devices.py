"""Devices of a compile target: compile-only GPU/TPU devices from the optional extras, and
meshes rebuilt on them.

A deviceless target's devices come from `jax.experimental.topologies`; the CUDA plugin and
libtpu are optional extras (`offload_eqx[cuda]`, `offload_eqx[tpu]`), so a missing one is
a clear error naming the extra to install.
"""

import functools
import importlib
import os
import pathlib
from collections.abc import Iterator
from typing import Any

import jax
import jax.extend as jex
import numpy as np

from .._base.jax_private import cuda_versions
from .targets import _EXTRAS, _TARGET_DIR, TARGETS, Target, get_target

_MISSING_EXTRA = (
    "Target {target!r} compiles with XLA:{compiler} without the hardware, which needs the "
    "optional extra {extra!r} (module `{module}` could not be imported: {error}). Install "
    "it with `pip install 'offload_eqx[{extra}]'`, or choose a target that needs nothing "
    "extra: 'cpu'."
)

_MISSING_LIBRARY = (
    "Target {target!r} compiles with XLA:GPU, which needs cuDNN to compile the kernels JAX "
    "calls through it (`jax.nn.dot_product_attention(..., implementation='cudnn')`, "
    "convolutions), and cuDNN could not be loaded ({error}). The optional extra 'cuda' "
    "installs it (`nvidia-cudnn-cu12`, pinned): `pip install 'offload_eqx[cuda]'`, or "
    "choose a target that needs nothing extra: 'cpu'."
)

_NO_PLATFORM = (
    "Target {target!r} needs jax's platform {platform!r}, which could not create "
    "compile-only devices: {error}. Set `JAX_PLATFORMS=cpu` before importing jax (the CUDA "
    "plugin otherwise looks for a driver), and check that the extra {extra!r} matches this "
    "jax version (`pip install 'offload_eqx[{extra}]'`)."
)


def require_extra(target: Target) -> None:
    """Raise a clear error when the optional extra that `target` needs is not installed,
    or (for a GPU) not whole: before any trace or compile."""
    if target.platform not in _EXTRAS:
        return
    module, extra = _EXTRAS[target.platform]
    try:
        importlib.import_module(module)
    except ImportError as e:
        compiler = "GPU" if target.platform == "cuda" else "TPU"
        raise ImportError(
            _MISSING_EXTRA.format(
                target=target.name, compiler=compiler, extra=extra, module=module, error=e
            )
        ) from None
    if target.platform == "cuda":
        problem = _cudnn_problem()
        if problem is not None:
            raise ImportError(_MISSING_LIBRARY.format(target=target.name, error=problem))


def require_compiler(target: Target) -> None:
    """Raise before any trace when `target`'s compiler cannot run here: its chip is not
    attached and the extra that compiles for it without one is missing or not whole."""
    if attached_devices(target) is None:
        require_extra(target)


def _cudnn_problem() -> str | None:
    """Why cuDNN cannot be loaded (jax says "cuDNN not found." when tracing a cuDNN
    kernel without it), or None when it loads. A JAX without the internal this asks
    through raises `MissingInternal` naming it, not a missing extra."""
    versions = cuda_versions()
    if versions is None:
        return "jax loaded no CUDA plugin"
    try:
        versions.cudnn_get_version()
    except RuntimeError as e:
        return str(e).strip().rstrip(".")
    return None


def _config_text(target: Target) -> str:
    path = pathlib.Path(target.config or f"{target.name}.txtpb")
    if not path.is_absolute():
        path = _TARGET_DIR / path
    try:
        return path.read_text()
    except OSError as e:
        raise FileNotFoundError(
            f"Target {target.name!r} names the GPU description {str(path)!r}, which cannot "
            f"be read ({e.strerror}). Ship a `GpuTargetConfig` text proto there (see "
            "`offload_eqx/targets/h100.txtpb`), or pass an absolute path as `config`."
        ) from None


@functools.cache
def _devices(target: Target) -> tuple:
    if target.platform == "cpu":
        return tuple(jax.devices("cpu"))
    from jax.experimental import topologies

    try:
        if target.platform == "cuda":
            topology = topologies.get_topology_desc(
                platform="cuda", topology=target.topology, target_config=_config_text(target)
            )
        else:
            # libtpu takes a machine-wide lock meant for processes that own the chips; a
            # compile-only topology owns nothing, so several processes may compile at once.
            os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
            options = {}
            if target.chips_per_host is not None:
                options["chips_per_host_bounds"] = list(target.chips_per_host)
            topology = topologies.get_topology_desc(
                platform="tpu", topology_name=target.topology, **options
            )
    except (RuntimeError, ValueError) as e:
        raise RuntimeError(
            _NO_PLATFORM.format(
                target=target.name,
                platform=target.platform,
                error=str(e).split("\n")[0],
                extra=target.extra,
            )
        ) from None
    return tuple(topology.devices)


_BACKEND = {"cuda": "gpu", "tpu": "tpu"}


def attached_devices(target: Target) -> tuple | None:
    """This machine's own accelerators when they are the target's chip, enough of them:
    a program is then compiled for the hardware it runs on (the same compiler, and the
    installed plugin whatever its CUDA version). None otherwise."""
    backend = _BACKEND.get(target.platform)
    try:
        if backend is None or jax.default_backend() != backend:
            return None
        devices = tuple(jax.devices(backend))
    except RuntimeError:
        return None
    chip = target.name.split("-")[0].lower()
    if target.platform == "tpu":
        chip = target.topology.split(":")[0].lower()
    kind = devices[0].device_kind.lower().replace(" ", "")
    if chip not in kind or len(devices) < (_declared_count(target) or 1):
        return None
    return devices[: _declared_count(target) or 1]


def target_devices(target: "str | Target") -> tuple:
    """The devices of `target`: this machine's, when it has the target's chip; else
    compile-only ones (deviceless targets)."""
    target = get_target(target)
    attached = attached_devices(target)
    if attached is not None:
        return attached
    require_extra(target)
    return _devices(target)


def target_mesh(
    target: "str | Target",
    axis_names: tuple[str, ...] = ("devices",),
    shape: tuple[int, ...] | None = None,
) -> jax.sharding.Mesh:
    """A mesh over the devices of `target`: by default one device (`shape=(1,)`), or the
    given shape (its product must not exceed the target's device count)."""
    target = get_target(target)
    devices = target_devices(target)
    shape = shape if shape is not None else (1,) * len(axis_names)
    count = int(np.prod(shape))
    if count > len(devices):
        raise ValueError(
            f"A mesh of shape {shape} needs {count} devices, but target {target.name!r} has "
            f"{len(devices)}. Choose a target with more devices (for example "
            "'h100-8' or 'tpu-v5p-4'), or a smaller mesh."
        )
    return jax.sharding.Mesh(
        np.array(devices[:count], dtype=object).reshape(shape),
        axis_names,
        axis_types=(jax.sharding.AxisType.Auto,) * len(axis_names),
    )


def _describe_axes(mesh: "jax.sharding.Mesh | jax.sharding.AbstractMesh") -> str:
    return "{" + ", ".join(f"{name!r}: {size}" for name, size in mesh.shape.items()) + "}"


def mesh_on_target(
    target: "str | Target", mesh: "jax.sharding.Mesh | jax.sharding.AbstractMesh"
) -> jax.sharding.Mesh:
    """`mesh` rebuilt on the devices of `target`: the same axis names, sizes and types.

    A deviceless target compiles one SPMD program for every one of its devices, so the
    mesh must use all of them: a different device count is an error naming both shapes.
    On the `"cpu"` target a concrete mesh is kept as it is (it is on this machine's devices).
    """
    target = get_target(target)
    if target.platform == "cpu" and isinstance(mesh, jax.sharding.Mesh):
        return mesh
    devices = target_devices(target)
    shape = tuple(mesh.shape.values())
    count = int(np.prod(shape, dtype=np.int64))
    if count != len(devices):
        same = [repr(t.name) for t in TARGETS.values() if _declared_count(t) == count]
        hint = f" (here: {', '.join(same)})" if same else ""
        raise ValueError(
            f"The arguments are on the mesh {_describe_axes(mesh)} (shape {shape}, {count} "
            f"devices), but target {target.name!r} has {len(devices)} devices (topology "
            f"{target.topology or 'this machine'!r}). A memory report compiles the program "
            "once per device of the target, so the mesh must span all of them: choose a "
            f"target with {count} devices{hint}, or build the mesh over {len(devices)} "
            f"devices (for example shape {(1,) * (len(shape) - 1) + (len(devices),)})."
        )
    return jax.sharding.Mesh(
        np.array(devices, dtype=object).reshape(shape),
        tuple(mesh.axis_names),
        axis_types=tuple(mesh.axis_types),
    )


def _declared_count(target: Target) -> int | None:
    """The device count a target's topology names, without creating its devices."""
    if target.platform == "cpu":
        return None
    if target.chips_per_host is not None:
        return int(np.prod(target.chips_per_host))
    dims = target.topology.rsplit(":", 1)[-1].split("x")
    try:
        return int(np.prod([int(d) for d in dims]))
    except ValueError:
        return None


def uses_abstract_mesh(target: "str | Target") -> bool:
    """Whether host-resident shardings must be built on the abstract mesh for `target`.

    Compile-only GPU devices expose no memory spaces, so a `NamedSharding(...,
    memory_kind="pinned_host")` on their concrete mesh silently becomes device memory;
    built on `mesh.abstract_mesh` and compiled under `jax.set_mesh(mesh)` it stays host.
    """
    return get_target(target).platform == "cuda"


_KERNEL_MESH = (
    "The step calls `jax.shard_map` on {mesh}, so it cannot be compiled for target "
    "{target!r}, {why}. {fix}"
)
# What works on each platform's deviceless compile. A GPU step is compiled under the
# target's own mesh (`uses_abstract_mesh`), and JAX requires a `shard_map`'s mesh to be
# the context mesh, which no mesh of this machine is.
_KERNEL_MESH_FIX = {
    "cuda": "A step that calls `jax.shard_map` cannot yet be compiled for a GPU target "
    "without the hardware: estimate the step without the `shard_map`, or compile it for "
    "a TPU target.",
    "tpu": "Give `shard_map` the mesh's shape rather than its devices: `mesh=mesh.abstract_mesh`.",
}


def trace_on_target(jitted: Any, args: list, target: Target) -> Any:
    """`jitted.trace(*args)` for a compile for `target`, a `shard_map` in the step on
    another target's devices refused in words (JAX refuses it in argument indices, or in
    the middle of tracing for a GPU target, which is traced on its own mesh)."""
    try:
        traced = jitted.trace(*args)
    except ValueError as error:
        if "passed to shard_map" not in str(error):
            raise
        context = jax.sharding.get_abstract_mesh()
        mesh = f"a mesh other than the one it is compiled on ({context})"
        raise ValueError(_kernel_mesh(mesh, "which JAX refuses", target)) from error
    for mesh in _shard_map_meshes(traced.jaxpr):
        if not isinstance(mesh, jax.sharding.Mesh):
            continue  # an abstract mesh: compiled on the target's devices
        platform = mesh.devices.flat[0].platform
        if platform != target.platform:
            described = f"a mesh of this machine's {platform} devices ({mesh})"
            raise ValueError(_kernel_mesh(described, "whose devices are others", target))
    return traced


def _kernel_mesh(mesh: str, why: str, target: Target) -> str:
    fix = _KERNEL_MESH_FIX.get(target.platform, "")
    return _KERNEL_MESH.format(mesh=mesh, target=target.name, why=why, fix=fix)


def _shard_map_meshes(jaxpr: Any) -> Iterator[Any]:
    for eqn in getattr(jaxpr, "jaxpr", jaxpr).eqns:
        if eqn.primitive.name == "shard_map":
            yield eqn.params["mesh"]
        for sub in jex.core.jaxprs_in_params(eqn.params):
            yield from _shard_map_meshes(sub)
