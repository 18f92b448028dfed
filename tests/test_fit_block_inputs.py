"""`ox.fit` offers a block's input for offload: a name at the top of an `ox.scan` block
is the layer's carry, which recomputing ("remat") keeps on the device as the layer's
residual; only offloading it frees the device. The search must not judge the plan that
offloads it as keeping at least what the plan that recomputes it kept (which is what it
did: "no plan fits", where the README's block stack fits with `x` offloaded)."""

import pathlib
import sys

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
import pytest

import offload_eqx as ox

# The README's block stack, `x` named at the block's top (`largest_models.py --block-stack`).
EXPERIMENTS = pathlib.Path(__file__).resolve().parents[1] / "experiments"
sys.path.insert(0, str(EXPERIMENTS))
try:
    import _block_stack as block_stack  # pyright: ignore[reportMissingImports]
finally:
    sys.path.remove(str(EXPERIMENTS))

pytestmark = pytest.mark.deviceless


def _make(key, layers=16, d=256):
    return block_stack.make_stack(key, layers, d)


def test_fit_offloads_the_block_input_where_only_that_fits():
    """16 layers whose inputs are 2 MiB each (32 MiB kept by any plan that does not
    offload them; 62.5 MiB the least such plan needs), under a 40 MB device budget:
    the plan found offloads `x`, with parameters and the update on the host."""
    opt = ox.offload_optimizer(
        optax.adamw(1e-4), update_on="host", master_dtype=jnp.float32, delay=1
    )

    def train_step(model, opt_state, x):
        loss = lambda m: jnp.mean(jax.vmap(m)(x).astype(jnp.float32) ** 2)  # noqa: E731
        grads = eqx.filter_grad(loss)(model)
        return ox.update_and_apply(opt, grads, opt_state, model)

    model = eqx.filter_eval_shape(_make, jax.random.key(0))
    state = eqx.filter_eval_shape(opt.init, model)
    x = jax.ShapeDtypeStruct((4, 1024, 256), jnp.bfloat16)
    step = ox.filter_jit(train_step, donate="all")
    found = ox.fit(step, model, state, x, target="h100", device_budget=40_000_000)
    assert dict(found.strategy.names).get("x") == "offload", found.table()
    assert (found.estimate.device_bytes or 0) <= 40_000_000, found.table()


def test_a_plan_that_recomputes_the_block_input_is_bounded_by_keeping_it():
    """The least device memory a plan needs (`Search.bound`) counts the layers' inputs a
    plan recomputes, which stay on the device: without them, what the plan recomputing
    `x` needed beyond its floor was learned as its family's extra and charged to the plan
    that offloads `x` as well, which was then never compiled (the 70B block stack on an
    H100: "no plan fits", where offloading `x` needs 12 GiB)."""
    from offload_eqx._fit.price import find_space
    from offload_eqx._fit.search import Search
    from offload_eqx._fit.space import Choice
    from offload_eqx._targets.targets import get_target

    opt = ox.offload_optimizer(optax.adamw(1e-4), update_on="host", delay=1)

    def train_step(model, opt_state, x):
        loss = lambda m: jnp.mean(jax.vmap(m)(x).astype(jnp.float32) ** 2)  # noqa: E731
        return ox.update_and_apply(opt, eqx.filter_grad(loss)(model), opt_state, model)

    model = eqx.filter_eval_shape(_make, jax.random.key(0))
    x = jax.ShapeDtypeStruct((4, 1024, 256), jnp.bfloat16)
    args = (model, eqx.filter_eval_shape(opt.init, model), x)
    step = ox.filter_jit(train_step, donate="all")
    search = Search(step, args, {}, get_target("h100"), 10**12, 10**12, 4, lambda _: None)
    find_space(search)
    names = lambda x_policy: (("h", "remat"), ("x", x_policy))  # noqa: E731
    recomputed = Choice("remat", names("remat"), "pinned_host", "host")
    offloaded = Choice("remat", names("offload"), "pinned_host", "host")
    inputs = 16 * 4 * 1024 * 256 * 2  # 16 layers' inputs, bfloat16
    assert search.bound(recomputed) - search.bound(offloaded) == inputs
