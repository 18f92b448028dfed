"""The host kernel against XLA's own update of the same step, byte for byte
(`tests/test_fused_adamw.py`). Run as a script, every case with the process's XLA flags
(the tests' fast compiles turn LLVM's optimisations off; a user's do not), printing
`{"contracts": ..., "cases": {case: [differences, whether the kernel was called]}}` as JSON.
"""

import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax

import offload_eqx as ox
from offload_eqx._optimizer import fused_adamw

LR = 1e-4
KERNEL = "offload_eqx_adamw"
# What the tests add to XLA_FLAGS (tests/conftest.py): no LLVM optimisations.
FAST_COMPILE = ("--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true")


def is_matrix(tree):
    return jax.tree_util.tree_map(lambda x: x.ndim > 1, tree)


TRANSFORMATIONS = {
    "adamw": lambda: optax.adamw(LR),
    "adamw_mask_schedule": lambda: optax.adamw(
        optax.cosine_decay_schedule(LR, 10), weight_decay=0.1, mask=is_matrix
    ),
    "adam": lambda: optax.adam(LR, b1=0.8, eps=1e-6),
    "clipped_adamw": lambda: optax.chain(optax.clip_by_global_norm(1e-3), optax.adamw(LR)),
}
EXACT = {
    **TRANSFORMATIONS,
    "adam_eps_root": lambda: optax.adam(1e-2, b1=0.8, eps=1e-6, eps_root=1e-8),
    "multisteps": lambda: optax.MultiSteps(optax.adamw(LR), every_k_schedule=2),
}
SPECIAL = np.array(
    [np.nan, np.inf, -np.inf, 3e38, -3e38, 1e-40, -1e-40, 1e-45, 0.0, -0.0, 1e-38], np.float32
)
LAYOUTS = {  # one leaf (XLA multiplies by a bias correction's reciprocal) or several
    "one_leaf": {"w": (64, 65)},
    "one_leaf_and_an_empty_one": {"w": (64, 65), "e": (0, 3)},
    "several": {"w": (64, 65), "b": (7,), "s": (), "e": (0, 3), "v": (129,)},
}


def users_flags() -> str:
    """This process's XLA_FLAGS without the tests' own (as a user's process has them)."""
    return " ".join(f for f in os.environ.get("XLA_FLAGS", "").split() if f not in FAST_COMPILE)


def kernel_expected(name: str, dtype: str) -> bool:
    """Whether the kernel takes the update: Adam(W), clipped only with bfloat16 gradients
    (XLA contracts a clipped float32 one otherwise: `fused_adamw`'s docstring)."""
    return name != "multisteps" and not (name == "clipped_adamw" and dtype == "float32")


def _gradients(rng, shapes: dict, dtype, steps: int) -> list[dict]:
    grads = []
    for _ in range(steps):
        step_grads = {}
        for key, shape in shapes.items():
            scale = np.float32(10.0 ** rng.integers(-8, 3))
            g = rng.standard_normal(shape).astype(np.float32) * scale
            flat = g.reshape(-1)
            if flat.size > 40:  # NaN, infinities, huge and subnormal values among them
                flat[rng.choice(flat.size, 40, replace=False)] = rng.choice(SPECIAL, 40)
            step_grads[key] = jnp.asarray(g, dtype)
        grads.append(step_grads)
    return grads


def _train(opt, params, grads):
    p, s = params, opt.init(params)
    step = ox.filter_jit(lambda g, p, s: ox.update_and_apply(opt, g, s, p))
    for g in grads:
        p, s = step(g, p, s)
    text = step.lower(grads[0], params, opt.init(params)).compile().as_text()
    return (p, s), KERNEL in text


def _differences(ours, xla) -> list[str]:
    flat, _ = jax.tree_util.tree_flatten_with_path(ours)
    found = []
    for (path, a), b in zip(flat, jax.tree_util.tree_leaves(xla)):
        a, b = np.atleast_1d(np.asarray(a)), np.atleast_1d(np.asarray(b))
        differ = int(np.sum(a.view(np.uint8) != b.view(np.uint8)))
        if differ:
            found.append(f"{jax.tree_util.keystr(path)}: {differ} bytes differ")
    return found


def compare(name: str, layout: str, dtype: str, delay: int = 0, steps: int = 3):
    """`(differences, whether the kernel was called)` between `steps` updates of
    `EXACT[name]` (float32 masters on the host) by the kernel and by XLA, from the same
    random start and gradients."""
    rng = np.random.default_rng(0)
    shapes = LAYOUTS[layout]
    params = {k: jnp.asarray(rng.standard_normal(s), dtype) for k, s in shapes.items()}
    grads = _gradients(rng, shapes, dtype, steps)
    opt = ox.offload_optimizer(
        EXACT[name](), update_on="host", master_dtype=jnp.float32, delay=delay
    )
    ours, called = _train(opt, params, grads)
    kernel = fused_adamw.target
    fused_adamw.target = lambda name: None
    try:
        xla, _ = _train(opt, params, grads)
    finally:
        fused_adamw.target = kernel
    return _differences(ours, xla), called


def main() -> None:
    # Every transformation the kernel takes, on one leaf and on several (the in-process
    # tests add the empty leaf and `MultiSteps`, which is XLA's on every path).
    cases = {}
    for name in TRANSFORMATIONS | {"adam_eps_root": EXACT["adam_eps_root"]}:
        for layout in ("one_leaf", "several"):
            for dtype in ("bfloat16", "float32"):
                cases[f"{name}:{layout}:{dtype}:0"] = compare(name, layout, dtype)
    for layout in ("one_leaf", "several"):
        cases[f"adamw_mask_schedule:{layout}:bfloat16:1"] = compare(
            "adamw_mask_schedule", layout, "bfloat16", delay=1
        )
    print(json.dumps({"contracts": fused_adamw.xla_contracts(), "cases": cases}))


if __name__ == "__main__":
    sys.exit(main())
