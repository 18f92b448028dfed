"""Compile targets: this machine's CPU, or a GPU/TPU compiled for without the hardware.

The real XLA:GPU and XLA:TPU compilers run on a machine without the accelerator
("deviceless" compile): `jax.experimental.topologies` gives compile-only devices, and a
program traced on them compiles exactly as it would for the real chip, so its
`memory_analysis()` is the chip's. They come from optional extras:

    pip install 'offload_eqx[cuda]'   # jax-cuda12-plugin, jax-cuda12-pjrt: h100, a100, ...
    pip install 'offload_eqx[tpu]'    # libtpu: tpu-v5p, tpu-v5e, tpu-v6e, ...

No driver is needed, nor `ptxas`: a deviceless compile stops before machine code (measured:
the same memory analysis with and without `nvidia-cuda-nvcc-cu12`). `JAX_PLATFORMS=cpu` must
be set before jax is imported, or the CUDA plugin looks for a driver.

A GPU target is described by an XLA `GpuTargetConfig` text proto shipped in
`offload_eqx/targets/` (public figures of the chip). To add one, add a file there and a
`Target` to `TARGETS`, or call `register_target(Target(...))` from your own code.
"""

import dataclasses
import functools
import importlib
import os
import pathlib
import re
from typing import Literal

import jax
import numpy as np

Platform = Literal["cpu", "cuda", "tpu"]

_TARGET_DIR = pathlib.Path(__file__).parent / "targets"

_EXTRAS: dict[str, tuple[str, str]] = {
    # platform: (module that the extra installs, extra name)
    "cuda": ("jax_plugins.xla_cuda12", "cuda"),
    "tpu": ("libtpu", "tpu"),
}

_MISSING_EXTRA = (
    "Target {target!r} compiles with XLA:{compiler} without the hardware, which needs the "
    "optional extra {extra!r} (module `{module}` could not be imported: {error}). Install "
    "it with `pip install 'offload_eqx[{extra}]'`, or choose a target that needs nothing "
    "extra: 'cpu'."
)
_UNKNOWN_TARGET = (
    "Unknown target {target!r}; expected one of {known}. Targets are described in "
    "`offload_eqx._targets.TARGETS`; add your own with `register_target(Target(...))`."
)
_NO_PLATFORM = (
    "Target {target!r} needs jax's platform {platform!r}, which could not create "
    "compile-only devices: {error}. Set `JAX_PLATFORMS=cpu` before importing jax (the CUDA "
    "plugin otherwise looks for a driver), and check that the extra {extra!r} matches this "
    "jax version (`pip install 'offload_eqx[{extra}]'`)."
)


@dataclasses.dataclass(frozen=True)
class Target:
    """A compile target.

    - `name`: what `ox.memory_report(..., target=name)` takes.
    - `platform`: `"cpu"` (this machine), `"cuda"` (XLA:GPU) or `"tpu"` (XLA:TPU).
    - `topology`: for `"cuda"`, `"<slices>x<hosts>x<gpus per host>"` (`"1x1x8"` is one
        host with 8 GPUs); for `"tpu"`, libtpu's topology name (`"v5p:2x2x1"`).
    - `config`: for `"cuda"`, the file in `offload_eqx/targets/` holding the
        `GpuTargetConfig` text proto, or an absolute path.
    - `chips_per_host`: for `"tpu"`, the chips per host when fewer than the default
        (a single-chip topology).
    - `description`: one line for listings.
    - `capacity`: bytes of memory of one device (HBM), the published figure; memory
        reports say whether a program fits in it. None: unknown (this machine's CPU).
    """

    name: str
    platform: Platform
    topology: str = ""
    config: str | None = None
    chips_per_host: tuple[int, ...] | None = None
    description: str = ""
    capacity: int | None = None

    @property
    def deviceless(self) -> bool:
        return self.platform != "cpu"

    @property
    def extra(self) -> str | None:
        return _EXTRAS[self.platform][1] if self.platform in _EXTRAS else None


def _gpu_capacity(config: str) -> int:
    """`device_memory_size` of a shipped `GpuTargetConfig`: one figure for both the
    compiler and the reports."""
    text = (_TARGET_DIR / config).read_text()
    match = re.search(r"^\s*device_memory_size:\s*(\d+)", text, flags=re.MULTILINE)
    if match is None:
        raise ValueError(f"offload_eqx/targets/{config} has no `device_memory_size`.")
    return int(match.group(1))


# HBM per chip as Google Cloud's TPU pages publish it ("95GB", "16 GB", "32 GB"; v5p:
# cloud.google.com/tpu/docs/v5p, v5e: .../v5e, v6e: .../v6e), read as 10^9 bytes: the
# smaller reading, so a program reported to fit does.
_V5P_HBM = 95 * 10**9
_V5E_HBM = 16 * 10**9
_V6E_HBM = 32 * 10**9
# The GPU figures are the `device_memory_size` of their target files: the memory CUDA
# reports for an H100 80GB SXM5 (84,978,434,048 B, 79.1 GiB) and 80 GiB for the A100.
_H100_HBM = _gpu_capacity("h100.txtpb")
_A100_HBM = _gpu_capacity("a100.txtpb")

TARGETS: dict[str, Target] = {
    t.name: t
    for t in (
        Target("cpu", "cpu", description="this machine's CPU (offloading is only a type here)"),
        Target(
            "h100",
            "cuda",
            "1x1x1",
            "h100.txtpb",
            description="one NVIDIA H100 80GB SXM",
            capacity=_H100_HBM,
        ),
        Target(
            "h100-8",
            "cuda",
            "1x1x8",
            "h100.txtpb",
            description="8 NVIDIA H100 80GB, one host",
            capacity=_H100_HBM,
        ),
        Target(
            "a100",
            "cuda",
            "1x1x1",
            "a100.txtpb",
            description="one NVIDIA A100 80GB SXM",
            capacity=_A100_HBM,
        ),
        Target(
            "tpu-v5p",
            "tpu",
            "v5p:1x1x1",
            chips_per_host=(1, 1, 1),
            description="one TPU v5p",
            capacity=_V5P_HBM,
        ),
        Target(
            "tpu-v5p-4",
            "tpu",
            "v5p:2x2x1",
            description="4 TPU v5p chips (one host)",
            capacity=_V5P_HBM,
        ),
        Target(
            "tpu-v5e",
            "tpu",
            "v5e:1x1",
            chips_per_host=(1, 1, 1),
            description="one TPU v5e",
            capacity=_V5E_HBM,
        ),
        Target(
            "tpu-v6e",
            "tpu",
            "v6e:1x1",
            chips_per_host=(1, 1, 1),
            description="one TPU v6e",
            capacity=_V6E_HBM,
        ),
    )
}


def register_target(target: Target) -> Target:
    """Make `target` available by name to `ox.memory_report` and `ox.compare_memory`."""
    if not isinstance(target, Target):
        raise TypeError(
            f"register_target({target!r}): expected an `offload_eqx.Target`, e.g. "
            "`Target('h100-2', 'cuda', '1x1x2', 'h100.txtpb')`."
        )
    TARGETS[target.name] = target
    _devices.cache_clear()
    return target


def get_target(target: "str | Target") -> Target:
    """The `Target` called `target` (a `Target` is returned unchanged)."""
    if isinstance(target, Target):
        return target
    try:
        return TARGETS[target]
    except (KeyError, TypeError):
        known = ", ".join(repr(t) for t in TARGETS)
        raise ValueError(_UNKNOWN_TARGET.format(target=target, known=known)) from None


def require_extra(target: Target) -> None:
    """Raise a clear error when the optional extra that `target` needs is not installed."""
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


def target_devices(target: "str | Target") -> tuple:
    """The (compile-only, for deviceless targets) devices of `target`."""
    target = get_target(target)
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
