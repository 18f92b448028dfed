"""The proof's child process (`gpu_host.target`): run as `__main__` with the arguments
`<kernel> <GPU description>` by a Python started isolated (`-I`) whose path begins with
the parent's own import roots (`gpu_host._proof_command`), it registers kernel
`<kernel>` with the CUDA plugin's host compiler and compiles, for that GPU (no GPU
needed), a host computation that calls it. It prints `{"ok": true, ...}` when the
compiled program calls the kernel; where the plugin's registry misses it, the compile
aborts this process, which the parent reads as the answer. Nothing it compiles is run."""

import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from ..compute import on_host
from . import gpu_host, load


def _program(target: str) -> str:
    """The compiled text of one host computation calling `target` on one tensor."""

    def kernel(x):
        s = jnp.zeros(12, jnp.float32)
        call = jax.ffi.ffi_call(target, [jax.ShapeDtypeStruct(x.shape, x.dtype)] * 4)
        return call(s, x, x, x, x, flags=np.zeros(1, np.int8))[0]

    return on_host(kernel, jnp.ones(256, jnp.float32))


def main(name: str, config: str) -> None:
    from jax.experimental import topologies

    target = load.target(name)
    address = load.handler_address(name)
    if target is None or address is None:
        raise SystemExit(f"kernel {name} is not loaded: {load.host_kernels().get(name)}")
    topology = topologies.get_topology_desc(
        platform="cuda", topology="1x1x1", target_config=Path(config).read_text()
    )
    gpu_host.register(target, address)
    mesh = jax.sharding.Mesh(np.asarray(topology.devices[:1]), ("devices",))
    with jax.set_mesh(mesh):
        text = jax.jit(lambda: _program(target)).trace().lower().compile().as_text() or ""
    print(json.dumps({"ok": target in text, "why": "" if target in text else "not called"}))


if __name__ == "__main__":
    main(*sys.argv[1:3])
