"""An FSDP-style model and training step shared by the multi-device tests, and the worker
that `test_multidevice.py` launches twice to run that step across two processes.

    python tests/_multiprocess_worker.py PORT PROCESS_ID OUTPUT.json

Each worker sees 4 CPU devices; together they form one 8-device mesh. The worker prints
nothing on success and writes its losses and final parameters to OUTPUT.json.
"""

import json
import os
import sys

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

import offload_eqx as ox

shard = ox.shard

FSDP = P(None, "fsdp", None)  # (layers, sharded rows, columns)
DATA = P("data", None)
DEPTH, WIDTH, HIDDEN, BATCH = 3, 16, 32, 8


class Layer(eqx.Module):
    w1: jax.Array = ox.field(memory="pinned_host", spec=FSDP)
    w2: jax.Array = ox.field(memory="pinned_host", spec=FSDP)
    bias: jax.Array = ox.field(memory="device")  # replicated: no spec

    def __call__(self, x):
        x = ox.name(x, "x")
        return x + jnp.tanh(x @ self.w1 + self.bias) @ self.w2


class Model(eqx.Module):
    layers: Layer
    head: jax.Array  # not managed: stays wherever it is
    activations: ox.Activations = ox.activations(x="offload")

    def __call__(self, x):
        return ox.scan(self.layers, x) @ self.head


def make_model(key) -> Model:
    k1, k2, k3 = jax.random.split(key, 3)
    return Model(
        layers=Layer(
            w1=jax.random.normal(k1, (DEPTH, WIDTH, HIDDEN)) / np.sqrt(WIDTH),
            w2=jax.random.normal(k2, (DEPTH, HIDDEN, WIDTH)) / np.sqrt(HIDDEN),
            bias=jnp.full((DEPTH, HIDDEN), 0.1),
        ),
        head=jax.random.normal(k3, (WIDTH, 4)) / np.sqrt(WIDTH),
    )


def make_batch() -> np.ndarray:
    return np.asarray(jax.random.normal(jax.random.key(1), (BATCH, WIDTH)))


def loss_fn(model, x):
    return jnp.mean(model(x) ** 2)


def make_optimizer(update_on="device", delay=0):
    """`update_on`: "device" or "host" (the whole-state optimizer, delayed by `delay`
    steps), or "layer": the same chain streamed by layer, its clipping as the global
    transform."""
    if update_on == "layer":
        return ox.offload_optimizer(
            optax.adam(1e-2),
            stream="layer",
            layers=DEPTH,
            global_transform=optax.clip_by_global_norm(1.0),
        )
    return ox.offload_optimizer(
        optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2)),
        update_on=update_on,
        delay=delay,
    )


def make_step(opt, strategy=None, mesh=None, donate="all"):
    @ox.filter_jit(strategy=strategy, mesh=mesh, donate=donate)
    def step(model, opt_state, x):
        loss, grads = eqx.filter_value_and_grad(loss_fn)(model, x)
        updates, opt_state = opt.update(grads, opt_state, model)
        return ox.apply_updates(model, updates), opt_state, loss, updates

    return step


def train(mesh, strategy=None, steps=3, update_on="device", delay=0) -> dict:
    """Place the model over `mesh` (given once), shard the batch, take the gradients, and
    run `steps` training steps. Returns every intermediate result by name."""
    model = ox.place(make_model(jax.random.key(0)), strategy, mesh=mesh)
    x = shard(jnp.asarray(make_batch()), DATA, mesh)
    opt = make_optimizer(update_on, delay)
    opt_state = ox.place(opt.init(model), strategy)  # the mesh is found on the arrays
    placed = shardings((model, opt_state))  # before the step donates the buffers

    @ox.filter_jit(strategy=strategy)  # the mesh is found on the placed arrays
    def gradients(model, x):
        return eqx.filter_value_and_grad(loss_fn)(model, x)

    _, grads = gradients(model, x)
    step = make_step(opt, strategy)
    losses, updates = [], None
    for _ in range(steps):
        model, opt_state, loss, updates = step(model, opt_state, x)
        losses.append(loss)
    return dict(
        placed=placed,
        x=x,
        grads=grads,
        model=model,
        opt_state=opt_state,
        losses=losses,
        updates=updates,
        step=step,
    )


def shardings(tree):
    return jax.tree_util.tree_map(lambda x: x.sharding, eqx.filter(tree, eqx.is_array))


def gather(tree):
    """Every array leaf as a numpy array holding the whole value (across processes too)."""
    from jax.experimental import multihost_utils

    def one(x):
        if x.sharding.memory_kind != "device":
            x = jax.device_put(x, x.sharding.with_memory_kind("device"))
        if not x.is_fully_addressable:
            return np.asarray(multihost_utils.process_allgather(x, tiled=True))
        return np.asarray(x)

    return jax.tree_util.tree_map(one, eqx.filter(tree, eqx.is_array))


def main(port: int, process_id: int, output: str) -> None:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{port}",
        num_processes=2,
        process_id=process_id,
        initialization_timeout=60,
    )
    assert jax.device_count() == 8 and jax.local_device_count() == 4
    mesh = jax.make_mesh((2, 4), ("data", "fsdp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    run = train(mesh)
    model, losses = run["model"], run["losses"]
    memories = {
        "w1": model.layers.w1.sharding.memory_kind,
        "w1_spec": str(model.layers.w1.sharding.spec),
        "addressable": model.layers.w1.is_fully_addressable,
    }
    params = gather(model)
    result = {
        "losses": [float(gather(loss)) for loss in losses],
        "params": [leaf.tolist() for leaf in jax.tree_util.tree_leaves(params)],
        "memories": memories,
    }
    with open(output, "w") as f:
        json.dump(result, f)
    jax.distributed.shutdown()


if __name__ == "__main__":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
