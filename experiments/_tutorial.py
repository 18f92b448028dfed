"""The hand-written code of JAX's host-offloading tutorial, and its published numbers.

Copied from the tutorial ("JAX Memories and Host Offloading") with one change so that it
compiles for any target: an in-program move names a memory space
(`jax.device_put(x, jax.memory.Space.Device)`) instead of a `NamedSharding` built on this
machine's CPU device, which means the same thing on the device the program is compiled for.
The shardings the tutorial gives `jax.jit` (host-resident arguments, `out_shardings`,
`donate_argnums`) become the `in_memory`/`out_memory`/`donate_argnums` options of
`ox.memory_report`: each program below is `(fn, args, options)`, ready for
`ox.memory_report(fn, *args, target=..., **options)`. `_report.py` compiles them beside the
offload_eqx versions of the same workloads.
"""

from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax import checkpoint_policies as cp
from jax.ad_checkpoint import checkpoint_name

MiB = 2**20
GiB = 2**30

# Published numbers (the tutorial's printouts: MB = 2**20 bytes, GB = 2**30 bytes).
PUBLISHED = {
    "activation": {
        "baseline": {"temp": 17.25 * MiB, "argument": 20.25 * MiB, "total": 57.50 * MiB},
        "offload x": {"temp": 6.50 * MiB, "argument": 20.25 * MiB, "total": 46.75 * MiB},
    },
    "parameter": {
        "offload x": {"temp": 6.50 * MiB, "argument": 20.25 * MiB, "total": 46.75 * MiB},
        "params on host + offload x": {
            "temp": 4.75 * MiB,
            "argument": 0.25 * MiB,
            "total": 25.00 * MiB,
        },
    },
    "optimizer": {
        "baseline": {"temp": 2.11 * GiB, "argument": 2.49 * GiB, "total": 4.59 * GiB},
        "offload optimizer state": {
            "temp": 1.91 * GiB,
            "argument": 0.96 * GiB,
            "total": 2.87 * GiB,
        },
    },
}


# -- activation and parameter offloading (10 scanned layers of x @ w1 @ w2) -----------------

POLICY = cp.save_and_offload_only_these_names(
    names_which_can_be_saved=[],
    names_which_can_be_offloaded=["x"],
    offload_src="device",
    offload_dst="pinned_host",
)


def two_layers(x, w):
    w1, w2 = w
    y = x @ w1
    return y @ w2, None


def scanned(w, x):
    result = jax.lax.scan(two_layers, x, w)[0]
    return jnp.sum(result)


def layer_name(x, w):
    w1, w2 = w
    x = checkpoint_name(x, "x")
    y = x @ w1
    return y @ w2, None


def offload_scanned(w, x):
    remat_layer = jax.remat(layer_name, policy=POLICY, prevent_cse=False)
    result = jax.lax.scan(remat_layer, x, w)[0]
    return jnp.sum(result)


def hybrid_layer(x, w):
    # The tutorial: `jax.device_put(x, s_dev)` with s_dev a device NamedSharding.
    w1, w2 = jax.tree.map(lambda a: jax.device_put(a, jax.memory.Space.Device), w)
    x = checkpoint_name(x, "x")
    y = x @ w1
    return y @ w2, None


def hybrid_scanned(w, x):
    remat_layer = jax.remat(hybrid_layer, policy=POLICY, prevent_cse=False)
    result = jax.lax.scan(remat_layer, x, w)[0]
    return jnp.sum(result)


def scan_arguments(layers: int = 10, batch: int = 256, width: int = 256, hidden: int = 1024):
    """The tutorial's `(w1, w2), input` as abstract values (nothing allocated)."""
    f32 = jnp.float32
    w = (
        jax.ShapeDtypeStruct((layers, width, hidden), f32),
        jax.ShapeDtypeStruct((layers, hidden, width), f32),
    )
    return w, jax.ShapeDtypeStruct((batch, width), f32)


def scan_programs(**sizes: int) -> dict[str, tuple]:
    """The tutorial's three scan programs, as `ox.compare_memory` entries."""
    w, x = scan_arguments(**sizes)
    return {
        "baseline": (jax.grad(scanned), (w, x), {}),
        "offload x": (jax.grad(offload_scanned), (w, x), {}),
        # wh1, wh2 = jax.device_put(w, s_host); jax.jit(jax.grad(hybrid_scanned))
        "params on host + offload x": (
            jax.grad(hybrid_scanned),
            (w, x),
            {"in_memory": ("pinned_host", "device")},
        ),
    }


# -- optimizer state offloading (4 dense layers of DIM x DIM with GELU, Adam) ---------------

OPTIMIZER = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(learning_rate=0.1))


def gelu(x):
    return 0.5 * x * (1 + jnp.tanh(jnp.sqrt(2 / jnp.pi) * (x + 0.044715 * x**3)))


def forward(params, x):
    for i in range(1, 5):
        x = gelu(x @ params[f"w{i}"])
    return x


def compute_loss(params, inputs):
    outputs = forward(params, inputs)
    loss = jnp.mean((outputs - inputs) ** 2)
    l2_reg = 0.001 * sum(jnp.sum(w**2) for w in jax.tree_util.tree_leaves(params))
    return loss + l2_reg


def step(params, opt_state, inputs):
    grads = jax.grad(lambda p: compute_loss(p, inputs))(params)
    updates, new_opt_state = OPTIMIZER.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), new_opt_state


def offload_step(params, opt_state, inputs):
    grads = jax.grad(lambda p: compute_loss(p, inputs))(params)
    # The tutorial: `jax.device_put(opt_state, s_dev)` with s_dev a SingleDeviceSharding.
    opt_state = jax.device_put(opt_state, jax.memory.Space.Device)
    updates, new_opt_state = OPTIMIZER.update(grads, opt_state, params)
    new_params = optax.apply_updates(params, updates)
    return new_params, new_opt_state


def optimizer_arguments(dim: int) -> tuple[Any, Any, Any]:
    """`params, opt_state, input` of the tutorial as abstract values (nothing allocated)."""
    params = {f"w{i}": jax.ShapeDtypeStruct((dim, dim), jnp.float32) for i in range(1, 5)}
    opt_state = jax.eval_shape(OPTIMIZER.init, params)
    return params, opt_state, jax.ShapeDtypeStruct((dim, dim), jnp.float32)


def optimizer_programs(dim: int) -> dict[str, tuple]:
    params, opt_state, x = optimizer_arguments(dim)
    return {
        # jax.jit(step, donate_argnums=(0, 1))
        "baseline": (step, (params, opt_state, x), {"donate_argnums": (0, 1)}),
        # opt_state = jax.device_put(opt_state, s_host);
        # jax.jit(step, donate_argnums=(0,), out_shardings=(s_dev, s_host))
        "offload optimizer state": (
            offload_step,
            (params, opt_state, x),
            {
                "in_memory": ("device", "pinned_host", "device"),
                "out_memory": ("device", "pinned_host"),
                "donate_argnums": (0,),
            },
        ),
    }
