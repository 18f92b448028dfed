"""What offloading a block's input saves when the blocks are a Python loop, and when they
are a scan: device and host memory of the compiled step, from the real XLA:GPU and
XLA:TPU compilers (deviceless), for plain JAX programs (no offload_eqx in the step).

Six blocks `x + tanh(x @ w0) @ w1` (width 1024, 2048 rows, float32), each under
`jax.checkpoint` with a policy for the block's input `x`: saved, offloaded to pinned host
memory, or recomputed (`nothing_saveable`); the blocks run either in a `jax.lax.scan`
(stacked weights) or one after another in a Python loop, as a library's list of blocks
does. `ox.annotate(model, lambda m: m.blocks, inputs=...)` gives the second kind.

    python benchmarks/unrolled_offload.py [--targets h100 tpu-v5p]
"""

import argparse

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

import offload_eqx as ox

_POLICIES = jax.checkpoint_policies
_MIB = 2**20


def _policy(kind: str):
    if kind == "offload":
        return _POLICIES.save_and_offload_only_these_names(
            names_which_can_be_saved=[],
            names_which_can_be_offloaded=["x"],
            offload_src="device",
            offload_dst="pinned_host",
        )
    return _POLICIES.save_only_these_names("x") if kind == "save" else _POLICIES.nothing_saveable


def _block(w, x):
    x = checkpoint_name(x, "x")
    return x + jnp.tanh(x @ w[0]) @ w[1]


def _loss(ws, x, kind: str, scanned: bool):
    block = jax.checkpoint(_block, policy=_policy(kind))
    if scanned:
        x = jax.lax.scan(lambda c, w: (block(w, c), None), x, ws)[0]
    else:
        for i in range(ws.shape[0]):
            x = block(ws[i], x)
    return jnp.mean(x**2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--targets", nargs="+", default=["h100", "tpu-v5p"])
    targets = parser.parse_args().targets
    ws = jax.ShapeDtypeStruct((6, 2, 1024, 1024), jnp.float32)
    x = jax.ShapeDtypeStruct((2048, 1024), jnp.float32)
    print("target    blocks    input      device temp MiB  host temp MiB")
    for target in targets:
        for scanned in (True, False):
            for kind in ("save", "offload", "remat"):
                grad = jax.jit(jax.grad(lambda w, x, k=kind, s=scanned: _loss(w, x, k, s)))
                report = ox.memory_report(grad, ws, x, target=target)
                print(
                    f"{target:9} {'scan' if scanned else 'loop':9} {kind:10}"
                    f" {report.device['temp'] / _MIB:15.1f} {report.host['temp'] / _MIB:14.1f}"
                )


if __name__ == "__main__":
    main()
