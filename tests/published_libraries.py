"""Models from published Equinox libraries, used as their users use them, for
`tests/test_published_libraries.py`: small configurations, random weights, the library's
code unmodified. The only offload_eqx touch is an `ox.annotate(..., memory="pinned_host")`
from outside on the modules that hold most of the parameters.

- `esm2quinox`: ESM2, a protein language model. Its layers are stacked and run by
    `lax.scan`; each applies `eqx.nn.RotaryPositionalEmbedding` inside
    `eqx.nn.MultiheadAttention` (the rotary tables are made while traced, under
    `jax.ensure_compile_time_eval`).
- `megalodon_jax`: Megalodon, a long-context decoder (complex EMA, chunked attention, a
    Python tuple of blocks). Its loss checks its labels with `eqx.error_if`.
- `diffrax`: a neural ODE, its vector field an `eqx.nn.MLP`, solved with `Tsit5` and
    diffrax's default adjoint (`RecursiveCheckpointAdjoint`: `eqx.internal.while_loop`).
"""

from typing import Any

import diffrax
import equinox as eqx
import esm2quinox
import jax
import jax.numpy as jnp
import optax
from jaxtyping import Array, Float, Int, PRNGKeyArray
from real_models import Case

import offload_eqx as ox

# -- ESM2 (esm2quinox) ------------------------------------------------------------------


def esm2(key: PRNGKeyArray) -> esm2quinox.ESM2:
    """Two layers of width 16; the stacked layers (all but the logit head) in pinned_host."""
    model = esm2quinox.ESM2(num_layers=2, embed_size=16, num_heads=2, token_dropout=True, key=key)
    return ox.annotate(model, lambda m: m.layers, memory="pinned_host")


def esm2_loss(model: esm2quinox.ESM2, state: None, tokens: Int[Array, "batch length"], key: None):
    """Masked-language-model style: predict each token from the sequence."""
    logits = jax.vmap(model)(tokens).logits
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens).mean(), state


def esm2_batch(key: PRNGKeyArray) -> Int[Array, "2 8"]:
    return jax.random.randint(key, (2, 8), 4, 24)  # amino acids: tokens 4 to 23


# -- Megalodon (megalodon_jax) ----------------------------------------------------------

try:
    import megalodon_jax
except ImportError:  # megalodon-jax 0.2.2 requires jax < 0.11: not on the newest JAX
    megalodon_jax = None


def megalodon_config() -> Any:
    assert megalodon_jax is not None
    return megalodon_jax.MegalodonConfig(
        vocab_size=32,
        model_dim=16,
        num_layers=1,
        num_heads=1,
        z_dim=8,
        value_dim=16,
        ffn_hidden_dim=32,
        cema_ndim=2,
        chunk_size=8,
        norm_num_groups=2,
    )


def megalodon(key: PRNGKeyArray) -> Any:
    """One block of width 16 (a Python tuple of blocks), in pinned_host."""
    assert megalodon_jax is not None
    model = megalodon_jax.MegalodonForCausalLM(megalodon_config(), key=key)
    return ox.annotate(model, lambda m: m.model.layers, memory="pinned_host")


def megalodon_loss(model: Any, state: None, ids: Int[Array, "batch seq"], key: None):
    loss = model.compute_loss(ids, ids)
    assert isinstance(loss, jax.Array)  # no valid count asked for
    return loss, state


def megalodon_batch(key: PRNGKeyArray) -> Int[Array, "2 8"]:
    return jax.random.randint(key, (2, 8), 0, megalodon_config().vocab_size)


# -- A neural ODE (diffrax) -------------------------------------------------------------


class VectorField(eqx.Module):
    mlp: eqx.nn.MLP

    def __call__(self, t, y, args):
        return self.mlp(y)


def neural_ode(key: PRNGKeyArray) -> VectorField:
    """`dy/dt = mlp(y)`, an MLP 2 -> 16 -> 16 -> 2 in pinned_host."""
    model = VectorField(eqx.nn.MLP(2, 2, 16, 2, activation=jnp.tanh, key=key))
    return ox.annotate(model, lambda m: m.mlp, memory="pinned_host")


def solve(model: VectorField, y0: Float[Array, " 2"], **options) -> Float[Array, " 2"]:
    """y(1) from y(0) = `y0`, with Tsit5 in steps of 0.1 (`options` go to diffeqsolve)."""
    term = diffrax.ODETerm(model)
    ys = diffrax.diffeqsolve(term, diffrax.Tsit5(), 0.0, 1.0, 0.1, y0, **options).ys
    assert ys is not None  # saved at t1, diffrax's default
    return ys[-1]


def neural_ode_loss(model: VectorField, state: None, batch: tuple, key: None):
    y0, y1 = batch
    return jnp.mean((jax.vmap(lambda y: solve(model, y))(y0) - y1) ** 2), state


def neural_ode_batch(key: PRNGKeyArray) -> tuple[Float[Array, "8 2"], Float[Array, "8 2"]]:
    y0 = jax.random.normal(key, (8, 2))
    return y0, jnp.roll(y0, 1, axis=1)  # learn a rotation


PUBLISHED: dict[str, Case] = {
    "esm2quinox": Case(esm2, esm2_loss, esm2_batch),
    # Its blocks are recomputed in the backward pass (each annotated block is a region),
    # and the complex EMA rounds differently there: gradients agree to 1.3e-6 of their
    # largest, parameters after Adam to 1.4e-5 of their scale (this machine, 3 steps).
    "megalodon_jax": Case(megalodon, megalodon_loss, megalodon_batch, rtol=5e-5),
    "diffrax": Case(neural_ode, neural_ode_loss, neural_ode_batch),
}
if megalodon_jax is None:
    del PUBLISHED["megalodon_jax"]
