"""The workloads of `gpu_check.py`, how one is timed, and how two results are compared.

A `Workload` is a step function compiled per strategy with `ox.filter_jit`, and a function
that builds its arguments (unplaced; `ox.place` puts them where a strategy says). The
tutorial's scan and optimizer models and the decoder are imported from `step_time.py` and
`experiments/`, not copied.
"""

import dataclasses
import math
import time
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import step_time  # also puts experiments/ on sys.path
from step_time import MLP, ScanLayer, ScanModel, scan_grad

import offload_eqx as ox

_decoder = step_time._decoder
_tutorial = step_time._tutorial


@dataclasses.dataclass(frozen=True)
class Workload:
    """A step under any strategy: `fn(*arguments())`, compiled with `ox.filter_jit`.

    `carry`: how many leading outputs are the new values of the leading arguments (a
    training step's model and optimizer state, fed back each call). `optimizer`: a delayed
    `ox.offload_optimizer`, whose pending update `ox.apply_pending` applies at the end."""

    name: str
    fn: Callable[..., Any]
    arguments: Callable[[], tuple]
    carry: int = 0
    donate: str = "none"
    optimizer: Any = None

    def step(self, strategy: Any) -> ox.FilterJit:
        return ox.filter_jit(self.fn, strategy=strategy, donate=self.donate)

    def abstract(self) -> tuple:
        """The arguments as bare `ShapeDtypeStruct`s: nothing allocated, placed by the plan."""
        shapes = eqx.filter_eval_shape(self.arguments)
        return jax.tree_util.tree_map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype) if eqx.is_array(x) else x, shapes
        )


def _normal(key, shape, fan_in, dtype):
    return (jax.random.normal(key, shape, jnp.float32) / math.sqrt(fan_in)).astype(dtype)


def scan_workload(sizes: dict[str, int], dtype: Any) -> Workload:
    """The tutorial's 10-layer `(x @ w1) @ w2` scan (its `x` declared offloadable), the
    gradient of its sum."""

    def arguments():
        (w1, w2), x = _tutorial.scan_arguments(**sizes)
        keys = jax.random.split(jax.random.key(2), 3)
        layers = ScanLayer(
            _normal(keys[0], w1.shape, sizes["width"], dtype),
            _normal(keys[1], w2.shape, sizes["hidden"], dtype),
        )
        return ScanModel(layers), _normal(keys[2], x.shape, 1, dtype)

    return Workload(f"tutorial scan {jnp.dtype(dtype).name}", scan_grad, arguments)


# Adam's epsilon for the equivalence: there an update must be a smooth function of the
# gradient. With optax's 1e-8, Adam's first steps move each weight by about
# `lr * sign(g)`, so a gradient within rounding of zero (a different but equally right
# order of summation under another strategy) flips a whole `2 * lr` step. With 1e-3 the
# update moves by at most `lr / eps` times the gradient's change.
SMOOTH_EPS = 1e-3


def decoder_workload(
    config: Any, batch: int, dtype: Any, grads: bool = False, smooth: bool = False
) -> Workload:
    """The experiments' decoder (`experiments/_decoder.py`: its own attention, RMSNorm,
    SwiGLU, `ox.scan` over the layers) and a full AdamW step, state offloadable; with
    `grads` the step returns the gradients too (the equivalence compares them); with
    `smooth` AdamW's epsilon is `SMOOTH_EPS`."""
    optimizer = _decoder.make_optimizer()
    if smooth:
        optimizer = ox.offload_optimizer(optax.adamw(1e-3, weight_decay=0.01, eps=SMOOTH_EPS))

    def train_step(model, opt_state, tokens):
        loss, gradients = eqx.filter_value_and_grad(_decoder.loss_fn)(model, tokens)
        model, opt_state = ox.update_and_apply(optimizer, gradients, opt_state, model)
        return (model, opt_state, loss, gradients) if grads else (model, opt_state, loss)

    def arguments():
        model = _decoder.make_decoder(config, jax.random.key(0), dtype=dtype)
        tokens = jax.random.randint(jax.random.key(1), (batch, config.seq + 1), 0, config.vocab)
        return model, optimizer.init(model), tokens

    return Workload(f"decoder {config.name}", train_step, arguments, carry=2, donate="all")


def optimizer_loss(model: MLP, x):
    """`step_time.mlp_loss`, the tutorial's, with its L2 term fetching the weights
    (`ox.fetch`): under `offload_params` and `hybrid` they are in host memory, where the
    penalty outside the model's own region cannot compute on them."""
    l2 = 0.001 * sum(jnp.sum(ox.fetch(w) ** 2) for w in jax.tree_util.tree_leaves(model))
    return jnp.mean((model(x) - x) ** 2) + l2


def optimizer_workload(dim: int, dtype: Any, update: str, smooth: bool = False) -> Workload:
    """The tutorial's 4-layer GELU MLP with clipped Adam through `ox.offload_optimizer`:
    `update` is "device", "host" (`update_on="host"`) or "delayed" (`update_on="host",
    delay=1`); with `smooth` Adam's epsilon is `SMOOTH_EPS`."""
    options = {"device": {}, "host": {"update_on": "host"}}
    delayed = {"update_on": "host", "delay": 1}
    inner = _tutorial.OPTIMIZER
    if smooth:
        inner = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(0.1, eps=SMOOTH_EPS))
    optimizer = ox.offload_optimizer(inner, **options.get(update, delayed))

    def train_step(model, opt_state, x):
        grads = jax.grad(optimizer_loss)(model, x)
        return ox.update_and_apply(optimizer, grads, opt_state, model)

    def arguments():
        keys = jax.random.split(jax.random.key(3), 5)
        model = MLP(*(_normal(k, (dim, dim), dim, dtype) for k in keys[:4]))
        state = optimizer.init(model)  # pyright: ignore[reportArgumentType] (a Module is a pytree)
        return model, state, _normal(keys[4], (dim, dim), 1, dtype)

    return Workload(
        f"optimizer ({update} update)",
        train_step,
        arguments,
        carry=2,
        donate="all",
        optimizer=optimizer if update == "delayed" else None,
    )


# -- running and timing ---------------------------------------------------------------


def fed_back(workload: Workload, args: tuple, out: Any) -> tuple:
    """The next call's arguments: the outputs that are new values of arguments, the rest
    as before."""
    if not workload.carry:
        return args
    return (*out[: workload.carry], *args[workload.carry :])


def finish(workload: Workload, strategy: Any, model: Any, opt_state: Any) -> tuple:
    """`ox.apply_pending` for a delayed optimizer, compiled under the step's strategy."""
    apply = ox.filter_jit(
        lambda m, s: ox.apply_pending(workload.optimizer, s, m), strategy=strategy
    )
    return apply(model, opt_state)


def time_calls(step: Any, workload: Workload, args: tuple, batches: int, calls: int):
    """Median seconds per call: `batches` batches of `calls` calls each, issued without
    waiting (a training loop's dispatch overlaps the device), blocked at each batch's end.
    Returns (median, per-batch seconds per call, the arguments after the last call)."""
    per_call = []
    for _ in range(batches):
        begin = time.perf_counter()
        out = None
        for _ in range(calls):
            out = step(*args)
            args = fed_back(workload, args, out)
        jax.block_until_ready(out)
        per_call.append((time.perf_counter() - begin) / calls)
    return float(np.median(per_call)), per_call, args


# -- comparing ------------------------------------------------------------------------


def leaves_with_paths(tree: Any) -> list[tuple[str, Any]]:
    flat = jax.tree_util.tree_leaves_with_path(eqx.filter(tree, eqx.is_array))
    return [(jax.tree_util.keystr(path), leaf) for path, leaf in flat]


def relative_difference(a: Any, b: Any) -> float:
    """max |a - b| over max |b| (the leaf's scale): a recomputation in another order
    moves a value near zero by a large fraction of itself, never by much of the leaf's
    scale; a value fetched from the wrong place, stale or missing, does."""
    a64, b64 = np.asarray(a, np.float64), np.asarray(b, np.float64)
    scale = max(float(np.max(np.abs(b64), initial=0.0)), float(np.finfo(np.float32).tiny))
    return float(np.max(np.abs(a64 - b64), initial=0.0)) / scale


def is_host(leaf: jax.Array) -> bool:
    return getattr(leaf.sharding, "memory_kind", None) == "pinned_host"


def typed_host(leaf: jax.Array) -> bool:
    return "<host>" in str(jax.typeof(leaf))
