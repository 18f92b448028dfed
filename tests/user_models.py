"""Models written the way authors of published Equinox libraries write them, for
`tests/test_user_models.py`: plain `eqx.nn` layers, nothing shaped for offload_eqx (no
`ox.field`, no `ox.name`, no `ox.scan`), tiny (widths of 8 to 16, two layers, batches of
2). Same `Case` and conventions as `tests/real_models.py`.

- `moe_lm`: a decoder language model whose feed-forward is a mixture of experts: a
    router, `jax.lax.top_k`, the experts stacked with `eqx.filter_vmap`, causal
    `jax.nn.dot_product_attention`.
- `vit_lora`: a DINO-style vision transformer (class and register tokens, layer scale)
    whose attention projections carry their own LoRA adapters; the base is frozen and
    only the adapters train (`eqx.partition` by a filter spec).
- `ssm_batch_norm`: a convolution, `eqx.nn.BatchNorm` (`inference=False`, its
    `eqx.nn.State` threaded through) and a diagonal state-space layer run by `lax.scan`.
- `recurrent`: a `GRUCell` and an `LSTMCell` scanned over time with `lax.scan`, dropout
    on each step's input with a key per step.
- `flow`: a normalising flow of affine coupling steps stacked with `eqx.filter_vmap`
    and scanned, each step a transformer stack scanned inside it (nested scans).
- `while_generate`: a loss that iterates to a fixed point with
    `eqx.internal.while_loop` (checkpointed) and checks its labels with `eqx.error_if`.
"""

import equinox as eqx
import equinox.internal as eqxi
import jax
import jax.numpy as jnp
import optax
from jaxtyping import Array, Float, Int, PRNGKeyArray
from real_models import Case

import offload_eqx as ox

# -- (a) A decoder LM with a mixture of experts ------------------------------------------


class Expert(eqx.Module):
    up: eqx.nn.Linear
    down: eqx.nn.Linear

    def __init__(self, width: int, hidden: int, *, key: PRNGKeyArray):
        up_key, down_key = jax.random.split(key)
        self.up = eqx.nn.Linear(width, hidden, key=up_key)
        self.down = eqx.nn.Linear(hidden, width, key=down_key)

    def __call__(self, x: Float[Array, " width"]) -> Float[Array, " width"]:
        return self.down(jax.nn.gelu(self.up(x)))


class MixtureOfExperts(eqx.Module):
    router: eqx.nn.Linear
    experts: Expert  # stacked: every array has a leading axis of `num_experts`
    top_k: int = eqx.field(static=True)

    def __init__(self, width: int, hidden: int, num_experts: int, top_k: int, *, key):
        router_key, experts_key = jax.random.split(key)
        self.router = eqx.nn.Linear(width, num_experts, use_bias=False, key=router_key)
        keys = jax.random.split(experts_key, num_experts)
        self.experts = eqx.filter_vmap(lambda k: Expert(width, hidden, key=k))(keys)
        self.top_k = top_k

    def __call__(self, x: Float[Array, "seq width"]) -> tuple[Array, Array]:
        logits = jax.vmap(self.router)(x)
        if self.top_k == 1:
            return self.switch(x, logits), jnp.zeros(())
        weights, chosen = jax.lax.top_k(logits, self.top_k)
        weights = jax.nn.softmax(weights, axis=-1)
        # Every expert on every token (dense), then the chosen ones gathered.
        outputs = eqx.filter_vmap(lambda e: jax.vmap(e)(x))(self.experts)
        picked = jnp.take_along_axis(outputs.transpose(1, 0, 2), chosen[..., None], axis=1)
        mixed = jnp.sum(weights[..., None] * picked, axis=1)
        # Switch-style load balancing: fraction routed times mean router probability.
        probabilities = jax.nn.softmax(logits, axis=-1)
        routed = jax.nn.one_hot(chosen, logits.shape[-1]).sum(axis=1).mean(axis=0)
        balance = logits.shape[-1] * jnp.sum(routed * probabilities.mean(axis=0))
        return mixed, balance

    def switch(self, x: Float[Array, "seq width"], logits: Array) -> Float[Array, "seq width"]:
        """Top-1 (Switch Transformer): each token through its expert's weights alone,
        gathered from the stack by index."""

        def one_token(token: Array, expert: Array) -> Array:
            chosen = jax.tree.map(lambda w: w[expert], self.experts)
            return chosen(token)

        gate = jax.nn.softmax(logits, axis=-1).max(axis=-1, keepdims=True)
        return gate * jax.vmap(one_token)(x, jnp.argmax(logits, axis=-1))


class MoEBlock(eqx.Module):
    norm1: eqx.nn.RMSNorm
    qkv: eqx.nn.Linear
    out: eqx.nn.Linear
    norm2: eqx.nn.RMSNorm
    moe: MixtureOfExperts
    heads: int = eqx.field(static=True)

    def __init__(self, width: int, heads: int, top_k: int, *, key: PRNGKeyArray):
        qkv_key, out_key, moe_key = jax.random.split(key, 3)
        self.norm1 = eqx.nn.RMSNorm(width)
        self.qkv = eqx.nn.Linear(width, 3 * width, use_bias=False, key=qkv_key)
        self.out = eqx.nn.Linear(width, width, use_bias=False, key=out_key)
        self.norm2 = eqx.nn.RMSNorm(width)
        self.moe = MixtureOfExperts(width, 2 * width, num_experts=4, top_k=top_k, key=moe_key)
        self.heads = heads

    def __call__(self, x: Float[Array, "seq width"]) -> tuple[Array, Array]:
        seq, width = x.shape
        q, k, v = jnp.split(jax.vmap(self.qkv)(jax.vmap(self.norm1)(x)), 3, axis=-1)
        q, k, v = (t.reshape(seq, self.heads, width // self.heads) for t in (q, k, v))
        attended = jax.nn.dot_product_attention(q, k, v, is_causal=True)
        x = x + jax.vmap(self.out)(attended.reshape(seq, width))
        mixed, balance = self.moe(jax.vmap(self.norm2)(x))
        return x + mixed, balance


class MoELM(eqx.Module):
    embedding: eqx.nn.Embedding
    blocks: list[MoEBlock]
    norm: eqx.nn.RMSNorm
    head: eqx.nn.Linear

    def __init__(self, vocab=32, width=16, heads=2, depth=2, top_k=2, *, key: PRNGKeyArray):
        embed_key, head_key, *block_keys = jax.random.split(key, depth + 2)
        self.embedding = eqx.nn.Embedding(vocab, width, key=embed_key)
        self.blocks = [MoEBlock(width, heads, top_k, key=k) for k in block_keys]
        self.norm = eqx.nn.RMSNorm(width)
        self.head = eqx.nn.Linear(width, vocab, use_bias=False, key=head_key)

    def __call__(self, tokens: Int[Array, " seq"]) -> tuple[Array, Array]:
        x = jax.vmap(self.embedding)(tokens)
        balance = jnp.zeros(())
        for block in self.blocks:
            x, block_balance = block(x)
            balance = balance + block_balance
        return jax.vmap(self.head)(jax.vmap(self.norm)(x)), balance


def moe_lm(key: PRNGKeyArray) -> MoELM:
    return ox.annotate(MoELM(key=key), lambda m: m.blocks, memory="pinned_host")


def moe_lm_loss(model: MoELM, state: None, tokens: Int[Array, "batch seq"], key: None):
    logits, balance = jax.vmap(model)(tokens[:, :-1])
    nll = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()
    return nll + 0.01 * balance.mean(), state


def tokens_batch(key: PRNGKeyArray) -> Int[Array, "2 9"]:
    return jax.random.randint(key, (2, 9), 0, 32)


# -- (b) A DINO-style ViT with its own LoRA ------------------------------------------------


class LoRALinear(eqx.Module):
    """`linear(x) + (alpha / rank) * b(a(x))`, `b` zero at first, as LoRA's authors do."""

    linear: eqx.nn.Linear
    lora_a: Float[Array, "rank in_features"]
    lora_b: Float[Array, "out_features rank"]
    alpha: float = eqx.field(static=True)

    def __init__(self, linear: eqx.nn.Linear, rank: int, alpha: float, *, key: PRNGKeyArray):
        in_features, out_features = linear.weight.shape[1], linear.weight.shape[0]
        self.linear = linear
        self.lora_a = jax.random.normal(key, (rank, in_features)) / rank
        self.lora_b = jnp.zeros((out_features, rank))
        self.alpha = alpha

    def __call__(self, x: Float[Array, " in_features"]) -> Float[Array, " out_features"]:
        rank = self.lora_a.shape[0]
        return self.linear(x) + (self.alpha / rank) * (self.lora_b @ (self.lora_a @ x))


class DinoBlock(eqx.Module):
    norm1: eqx.nn.LayerNorm
    qkv: LoRALinear
    proj: LoRALinear
    scale1: Float[Array, " width"]
    norm2: eqx.nn.LayerNorm
    mlp: eqx.nn.MLP
    scale2: Float[Array, " width"]
    heads: int = eqx.field(static=True)

    def __init__(self, width: int, heads: int, *, key: PRNGKeyArray):
        keys = jax.random.split(key, 5)
        self.norm1 = eqx.nn.LayerNorm(width)
        self.qkv = LoRALinear(eqx.nn.Linear(width, 3 * width, key=keys[0]), 2, 4.0, key=keys[1])
        self.proj = LoRALinear(eqx.nn.Linear(width, width, key=keys[2]), 2, 4.0, key=keys[3])
        self.scale1 = jnp.full((width,), 1e-1)
        self.norm2 = eqx.nn.LayerNorm(width)
        self.mlp = eqx.nn.MLP(width, width, 2 * width, 1, activation=jax.nn.gelu, key=keys[4])
        self.scale2 = jnp.full((width,), 1e-1)
        self.heads = heads

    def __call__(self, x: Float[Array, "tokens width"]) -> Float[Array, "tokens width"]:
        tokens, width = x.shape
        q, k, v = jnp.split(jax.vmap(self.qkv)(jax.vmap(self.norm1)(x)), 3, axis=-1)
        q, k, v = (t.reshape(tokens, self.heads, width // self.heads) for t in (q, k, v))
        attended = jax.nn.dot_product_attention(q, k, v).reshape(tokens, width)
        x = x + self.scale1 * jax.vmap(self.proj)(attended)
        return x + self.scale2 * jax.vmap(self.mlp)(jax.vmap(self.norm2)(x))


class DinoViT(eqx.Module):
    patch: eqx.nn.Conv2d
    cls_token: Float[Array, "1 width"]
    registers: Float[Array, "registers width"]
    position: Float[Array, "patches width"]
    blocks: list[DinoBlock]
    norm: eqx.nn.LayerNorm
    head: eqx.nn.Linear

    def __init__(self, size=8, patch=4, width=16, heads=2, depth=2, classes=3, *, key):
        keys = jax.random.split(key, depth + 5)
        patches = (size // patch) ** 2
        self.patch = eqx.nn.Conv2d(3, width, patch, stride=patch, key=keys[0])
        self.cls_token = 0.02 * jax.random.normal(keys[1], (1, width))
        self.registers = 0.02 * jax.random.normal(keys[2], (2, width))
        self.position = 0.02 * jax.random.normal(keys[3], (patches, width))
        self.blocks = [DinoBlock(width, heads, key=k) for k in keys[5:]]
        self.norm = eqx.nn.LayerNorm(width)
        self.head = eqx.nn.Linear(width, classes, key=keys[4])

    def __call__(self, image: Float[Array, "3 height width"]) -> Float[Array, " classes"]:
        x = self.patch(image)
        x = x.reshape(x.shape[0], -1).T + self.position
        x = jnp.concatenate([self.cls_token, self.registers, x])
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x[0]))


def vit_lora(key: PRNGKeyArray) -> DinoViT:
    return ox.annotate(DinoViT(key=key), lambda m: m.blocks, memory="pinned_host")


def lora_filter_spec(model: DinoViT):
    """Only the adapters (and the classifier head) train; the base is frozen."""
    spec = jax.tree.map(lambda _: False, model)
    return eqx.tree_at(
        lambda m: (
            [
                leaf
                for b in m.blocks
                for leaf in (b.qkv.lora_a, b.qkv.lora_b, b.proj.lora_a, b.proj.lora_b)
            ]
            + [m.head.weight, m.head.bias]
        ),
        spec,
        replace_fn=lambda _: True,
    )


def vit_lora_loss(model: DinoViT, state: None, batch: tuple, key: None):
    images, labels = batch
    logits = jax.vmap(model)(images)
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean(), state


def images_batch(key: PRNGKeyArray) -> tuple[Float[Array, "2 3 8 8"], Int[Array, " 2"]]:
    image_key, label_key = jax.random.split(key)
    return jax.random.normal(image_key, (2, 3, 8, 8)), jax.random.randint(label_key, (2,), 0, 3)


# -- (c) A convolution, BatchNorm and a diagonal state-space layer ----------------------


class DiagonalSSM(eqx.Module):
    """`h[t] = a * h[t-1] + b * x[t]`, `y[t] = c . h[t] + d * x[t]`, per channel, with
    `a = exp(-exp(log_rate) * dt)` (real, as in S4D's real variant)."""

    log_rate: Float[Array, "channels state"]
    b: Float[Array, "channels state"]
    c: Float[Array, "channels state"]
    d: Float[Array, " channels"]

    def __init__(self, channels: int, state: int, *, key: PRNGKeyArray):
        b_key, c_key = jax.random.split(key)
        self.log_rate = jnp.log(jnp.tile(jnp.arange(1.0, state + 1), (channels, 1)))
        self.b = jax.random.normal(b_key, (channels, state)) / state
        self.c = jax.random.normal(c_key, (channels, state)) / state
        self.d = jnp.ones(channels)

    def __call__(self, x: Float[Array, "channels time"]) -> Float[Array, "channels time"]:
        decay = jnp.exp(-jnp.exp(self.log_rate) * 0.1)

        def step(h, x_t):
            h = decay * h + self.b * x_t[:, None]
            return h, jnp.sum(self.c * h, axis=-1) + self.d * x_t

        _, ys = jax.lax.scan(step, jnp.zeros_like(self.b), x.T)
        return ys.T


class SSMNet(eqx.Module):
    conv: eqx.nn.Conv1d
    norm: eqx.nn.BatchNorm
    ssm: DiagonalSSM
    head: eqx.nn.Linear

    def __init__(self, *, key: PRNGKeyArray):
        conv_key, ssm_key, head_key = jax.random.split(key, 3)
        self.conv = eqx.nn.Conv1d(2, 8, 3, padding=1, key=conv_key)
        self.norm = eqx.nn.BatchNorm(8, axis_name="batch", inference=False)
        self.ssm = DiagonalSSM(8, 4, key=ssm_key)
        self.head = eqx.nn.Linear(8, 1, key=head_key)

    def __call__(self, x: Float[Array, "2 time"], state: eqx.nn.State):
        h = self.conv(x)
        h, state = self.norm(h, state)  # BatchNorm normalises the channel axis, axis 0
        h = jax.nn.gelu(self.ssm(h))
        return self.head(h.mean(axis=-1))[0], state


def ssm_batch_norm(key: PRNGKeyArray) -> tuple[SSMNet, eqx.nn.State]:
    model, state = eqx.nn.make_with_state(SSMNet)(key=key)
    return ox.annotate(model, lambda m: m.ssm, memory="pinned_host"), state


def ssm_loss(model: SSMNet, state: eqx.nn.State, batch: tuple, key: None):
    x, y = batch
    out, state = jax.vmap(model, axis_name="batch", in_axes=(0, None), out_axes=(0, None))(x, state)
    return jnp.mean((out - y) ** 2), state


def series_batch(key: PRNGKeyArray) -> tuple[Float[Array, "2 2 8"], Float[Array, " 2"]]:
    x = jax.random.normal(key, (2, 2, 8))
    return x, x[:, 0].sum(axis=-1)


# -- (d) GRU and LSTM cells scanned over time, dropout keys ----------------------------


class Recurrent(eqx.Module):
    gru: eqx.nn.GRUCell
    lstm: eqx.nn.LSTMCell
    dropout: eqx.nn.Dropout
    head: eqx.nn.Linear

    def __init__(self, *, key: PRNGKeyArray):
        gru_key, lstm_key, head_key = jax.random.split(key, 3)
        self.gru = eqx.nn.GRUCell(2, 8, key=gru_key)
        self.lstm = eqx.nn.LSTMCell(8, 8, key=lstm_key)
        self.dropout = eqx.nn.Dropout(0.1, inference=False)
        self.head = eqx.nn.Linear(8, 1, key=head_key)

    def __call__(self, xs: Float[Array, "time 2"], key: PRNGKeyArray) -> Float[Array, ""]:
        def step(carry, inputs):
            (g, (h, c)), (x, step_key) = carry, inputs
            g = self.gru(self.dropout(x, key=step_key), g)
            h, c = self.lstm(g, (h, c))
            return (g, (h, c)), h

        keys = jax.random.split(key, xs.shape[0])
        zeros = jnp.zeros(8)
        (_, (h, _)), _ = jax.lax.scan(step, (zeros, (zeros, zeros)), (xs, keys))
        return self.head(h)[0]


def recurrent(key: PRNGKeyArray) -> Recurrent:
    return ox.annotate(Recurrent(key=key), lambda m: (m.gru, m.lstm), memory="pinned_host")


def recurrent_loss(model: Recurrent, state: None, batch: tuple, key: PRNGKeyArray):
    xs, y = batch
    keys = jax.random.split(key, xs.shape[0])
    return jnp.mean((jax.vmap(model)(xs, keys) - y) ** 2), state


def sequence_batch(key: PRNGKeyArray) -> tuple[Float[Array, "2 6 2"], Float[Array, " 2"]]:
    xs = jax.random.normal(key, (2, 6, 2))
    return xs, xs[:, :, 0].sum(axis=-1)


# -- (e) A normalising-flow transformer: flow steps scanned, each a scanned stack -------


class FlowLayer(eqx.Module):
    norm: eqx.nn.LayerNorm
    attention: eqx.nn.MultiheadAttention
    mlp: eqx.nn.MLP

    def __init__(self, width: int, *, key: PRNGKeyArray):
        attention_key, mlp_key = jax.random.split(key)
        self.norm = eqx.nn.LayerNorm(width)
        self.attention = eqx.nn.MultiheadAttention(2, width, key=attention_key)
        self.mlp = eqx.nn.MLP(width, width, 2 * width, 1, activation=jax.nn.gelu, key=mlp_key)

    def __call__(self, x: Float[Array, "seq width"]) -> Float[Array, "seq width"]:
        y = jax.vmap(self.norm)(x)
        x = x + self.attention(y, y, y)
        return x + jax.vmap(self.mlp)(x)


class FlowStep(eqx.Module):
    """An affine coupling: the second half of each token's features is shifted and
    scaled by a transformer stack of the first half, then the halves swap."""

    embed: eqx.nn.Linear
    layers: FlowLayer  # stacked
    out: eqx.nn.Linear

    def __init__(self, features: int, width: int, depth: int, *, key: PRNGKeyArray):
        embed_key, layers_key, out_key = jax.random.split(key, 3)
        self.embed = eqx.nn.Linear(features // 2, width, key=embed_key)
        keys = jax.random.split(layers_key, depth)
        self.layers = eqx.filter_vmap(lambda k: FlowLayer(width, key=k))(keys)
        out = eqx.nn.Linear(width, features, key=out_key)
        self.out = eqx.tree_at(lambda o: o.weight, out, 0.1 * out.weight)

    def __call__(self, z: Float[Array, "seq features"]) -> tuple[Array, Array]:
        half = z.shape[-1] // 2
        z1, z2 = z[:, :half], z[:, half:]
        params, static = eqx.partition(self.layers, eqx.is_array)

        def layer(h, layer_params):
            return eqx.combine(layer_params, static)(h), None

        h, _ = jax.lax.scan(layer, jax.vmap(self.embed)(z1), params)
        log_scale, shift = jnp.split(jax.vmap(self.out)(h), 2, axis=-1)
        log_scale = jnp.tanh(log_scale)
        z2 = z2 * jnp.exp(log_scale) + shift
        return jnp.concatenate([z2, z1], axis=-1), jnp.sum(log_scale)


class Flow(eqx.Module):
    steps: FlowStep  # stacked

    def __init__(self, features=4, width=8, depth=2, num_steps=2, *, key: PRNGKeyArray):
        keys = jax.random.split(key, num_steps)
        self.steps = eqx.filter_vmap(lambda k: FlowStep(features, width, depth, key=k))(keys)

    def __call__(self, x: Float[Array, "seq features"]) -> Float[Array, ""]:
        """The negative log-likelihood of `x` under a standard normal base."""
        params, static = eqx.partition(self.steps, eqx.is_array)

        def flow_step(z, step_params):
            z, log_det = eqx.combine(step_params, static)(z)
            return z, log_det

        z, log_dets = jax.lax.scan(flow_step, x, params)
        return 0.5 * jnp.sum(z**2) - jnp.sum(log_dets)


def flow(key: PRNGKeyArray) -> Flow:
    return ox.annotate(Flow(key=key), lambda m: m.steps, memory="pinned_host")


def flow_loss(model: Flow, state: None, x: Float[Array, "batch seq features"], key: None):
    return jnp.mean(jax.vmap(model)(x)), state


def flow_batch(key: PRNGKeyArray) -> Float[Array, "2 4 4"]:
    return jax.random.normal(key, (2, 4, 4))


# -- (f) eqx.internal.while_loop and eqx.error_if ---------------------------------------


class FixedPoint(eqx.Module):
    """A deep-equilibrium-style cell iterated a fixed number of times with
    `eqx.internal.while_loop` (checkpointed, so differentiable), then a classifier."""

    embedding: eqx.nn.Embedding
    cell: eqx.nn.MLP
    head: eqx.nn.Linear
    vocab: int = eqx.field(static=True)

    def __init__(self, vocab=16, width=8, *, key: PRNGKeyArray):
        embed_key, cell_key, head_key = jax.random.split(key, 3)
        self.embedding = eqx.nn.Embedding(vocab, width, key=embed_key)
        self.cell = eqx.nn.MLP(2 * width, width, width, 1, activation=jnp.tanh, key=cell_key)
        self.head = eqx.nn.Linear(width, vocab, key=head_key)
        self.vocab = vocab

    def __call__(self, token: Int[Array, ""]) -> Float[Array, " vocab"]:
        token = eqx.error_if(token, (token < 0) | (token >= self.vocab), "token out of range")
        x = self.embedding(token)

        def cond(carry):
            step, _ = carry
            return step < 4

        def body(carry):
            step, h = carry
            return step + 1, self.cell(jnp.concatenate([h, x]))

        _, h = eqxi.while_loop(
            cond, body, (jnp.array(0), jnp.zeros_like(x)), max_steps=4, kind="checkpointed"
        )
        return self.head(h)

    def generate(self, token: Int[Array, ""], length: int) -> Int[Array, " length"]:
        """Greedy: each output is the argmax after the previous one."""

        def body(token, _):
            token = jnp.argmax(self(token))
            return token, token

        return jax.lax.scan(body, token, length=length)[1]


def fixed_point(key: PRNGKeyArray) -> FixedPoint:
    return ox.annotate(FixedPoint(key=key), lambda m: m.cell, memory="pinned_host")


def fixed_point_loss(model: FixedPoint, state: None, batch: tuple, key: None):
    tokens, labels = batch
    labels = eqx.error_if(labels, labels >= model.vocab, "label out of range")
    logits = jax.vmap(model)(tokens)
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean(), state


def fixed_point_batch(key: PRNGKeyArray) -> tuple[Int[Array, " 2"], Int[Array, " 2"]]:
    tokens = jax.random.randint(key, (2,), 0, 16)
    return tokens, (tokens + 1) % 16


USER_MODELS: dict[str, Case] = {
    "moe_lm": Case(moe_lm, moe_lm_loss, tokens_batch),
    "vit_lora": Case(vit_lora, vit_lora_loss, images_batch, filter_spec=lora_filter_spec),
    "ssm_batch_norm": Case(ssm_batch_norm, ssm_loss, series_batch),
    "recurrent": Case(recurrent, recurrent_loss, sequence_batch, dropout=True),
    "flow": Case(flow, flow_loss, flow_batch),
    "while_generate": Case(fixed_point, fixed_point_loss, fixed_point_batch),
}
