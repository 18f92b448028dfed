"""Training, checkpointing and resuming in separate processes, for `test_checkpoints.py`
and `test_multidevice.py` (issue 18): what a user does when a job is restarted.

    python tests/_checkpoint_worker.py PHASE FORMAT LAYOUT DIR STEPS OUTPUT.json

PHASE is `straight` (train STEPS steps from the start), `save` (train STEPS steps, then
checkpoint into DIR) or `resume` (restore DIR under `hybrid` before any step, then train
STEPS more); FORMAT is `orbax` or `equinox`; LAYOUT is `one` (one device) or `mesh` (a
2x4 mesh, FSDP-sharded, which needs 8 CPU devices: XLA_FLAGS set by the caller). The
worker writes the losses (as float.hex, to compare bitwise), the final parameters, and
for `resume` where every leaf was right after the restore.
"""

import json
import os
import sys
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

import offload_eqx as ox

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from _multiprocess_worker import DATA, make_batch, make_model  # noqa: E402
from helpers import scanned_model  # noqa: E402

STRATEGY = "hybrid"


def _build(layout: str) -> Any:
    """The model, built: FSDP-sharded on the mesh, the seed workload on one device."""
    return make_model(jax.random.key(0)) if layout == "mesh" else scanned_model(jax.random.key(0))


def _setup(layout: str):
    opt = ox.offload_optimizer(optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2)))
    if layout == "mesh":
        mesh = jax.make_mesh((2, 4), ("data", "fsdp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
        x = ox.shard(jnp.asarray(make_batch()), DATA, mesh)
    else:
        mesh = None
        x = jax.random.normal(jax.random.key(1), (8, 16))
    return opt, mesh, lambda: _build(layout), x


def _step(opt):
    @ox.filter_jit(strategy=STRATEGY, donate="all")
    def step(model, opt_state, x):
        loss, grads = eqx.filter_value_and_grad(lambda m: jnp.mean(m(x) ** 2))(model)
        model, opt_state = ox.update_and_apply(opt, grads, opt_state, model)
        return model, opt_state, loss

    return step


def _placements(tree, abstract: bool = False) -> dict[str, list[str]]:
    """Each array leaf's memory kind, spec (over a mesh) and whether its type says host."""
    if not abstract:
        tree = eqx.filter(tree, eqx.is_array)
    found = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        sharding = leaf.sharding
        mesh = getattr(sharding, "mesh", None)
        spec = str(sharding.spec) if mesh is not None and mesh.axis_names != ("_device",) else ""
        if abstract:  # the type a restored array gets from this sharding
            host = sharding.memory_kind == "pinned_host"
        else:
            host = jax.typeof(leaf).memory_space == jax.memory.Space.Host
        found[jax.tree_util.keystr(path)] = [
            sharding.memory_kind,
            spec,
            "host" if host else "device",
        ]
    return found


def main(phase: str, fmt: str, layout: str, directory: str, steps: int, output: str) -> None:
    opt, mesh, build, x = _setup(layout)
    result: dict = {}
    if phase == "resume":
        like = eqx.filter_eval_shape(lambda: (build(), opt.init(eqx.filter(build(), eqx.is_array))))
        if fmt == "orbax":
            model, opt_state = ox.restore_checkpoint(directory, like, STRATEGY, mesh=mesh)
        else:
            path = os.path.join(directory, "state.eqx")
            model, opt_state = ox.tree_deserialise_leaves(path, like, STRATEGY, mesh=mesh)
        result["restored"] = _placements((model, opt_state))
        planned = ox.abstract(like, STRATEGY, mesh=mesh)
        result["planned"] = _placements(
            eqx.filter(planned, lambda x: isinstance(x, jax.ShapeDtypeStruct)), abstract=True
        )
    else:
        model = ox.place(build(), STRATEGY, mesh=mesh)
        opt_state = ox.place(opt.init(eqx.filter(model, eqx.is_array)), STRATEGY)
    step = _step(opt)
    losses = []
    for _ in range(steps):
        model, opt_state, loss = step(model, opt_state, x)
        losses.append(float(loss).hex())
    if phase == "save":
        if fmt == "orbax":
            ox.save_checkpoint(directory, (model, opt_state))
        else:
            eqx.tree_serialise_leaves(os.path.join(directory, "state.eqx"), (model, opt_state))
    result["losses"] = losses
    params = eqx.filter(model, eqx.is_array)
    result["params"] = [np.asarray(p).tolist() for p in jax.tree.leaves(params)]
    with open(output, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    phase, fmt, layout, directory, steps, output = sys.argv[1:]
    main(phase, fmt, layout, directory, int(steps), output)
