"""The work counter against counts derived by hand, on models written the ordinary way.

Notation: a batch of B rows through `eqx.nn.Linear(i, o)` is one dot costing 2*B*i*o flops
(B*o outputs, each an i-long dot product of multiply-adds), reading B*i + i*o and writing
B*o float32 numbers. Its backward pass is a weight gradient (2*B*i*o, the same
three sizes) and, unless its input is not differentiated, an input gradient (2*B*i*o).
Models and inputs are `jax.ShapeDtypeStruct`s (`eqx.filter_eval_shape`): everything traces
and nothing compiles or runs, except where noted.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
import pytest
from helpers import computed_on_host
from jaxtyping import Array, Float, PyTree

from offload_eqx._planning.flops import PhaseWork, count_work

B, IN, WIDTH, OUT, DEPTH = 4, 8, 16, 3, 2
LAYERS = [(IN, WIDTH), (WIDTH, WIDTH), (WIDTH, OUT)]  # (in, out) of each eqx.nn.MLP layer
F32 = 4
S = jax.ShapeDtypeStruct


def dot_flops(layers) -> int:
    return sum(2 * B * i * o for i, o in layers)


def dot_bytes(layers) -> int:
    return sum(F32 * (B * i + i * o + B * o) for i, o in layers)


# Forward: one dot per layer. Backward: a weight gradient for every layer and an input
# gradient for every layer but the first (x is not differentiated). Each backward dot
# touches the same three sizes as its forward dot.
FORWARD = dot_flops(LAYERS)
BACKWARD = dot_flops(LAYERS) + dot_flops(LAYERS[1:])


def mlp() -> eqx.nn.MLP:
    return eqx.filter_eval_shape(eqx.nn.MLP, IN, OUT, WIDTH, DEPTH, key=jax.random.key(0))


def is_leaf(x) -> bool:
    """A parameter of a model built by `eqx.filter_eval_shape` (what `eqx.is_array` is)."""
    return isinstance(x, (jax.Array, S))


def mse(model, x: Float[Array, "batch in"]) -> Float[Array, ""]:
    return jnp.sum(jax.vmap(model)(x) ** 2)


def x_batch() -> jax.ShapeDtypeStruct:
    return S((B, IN), jnp.float32)


def work_of(fn, *args, **rates) -> dict[str, PhaseWork]:
    closed, *_ = eqx.filter_make_jaxpr(fn)(*args)
    return count_work(closed, **rates)


def test_mlp_gradient():
    work = work_of(eqx.filter_grad(mse), mlp(), x_batch())
    assert work["forward"].flops == FORWARD
    assert work["backward"].flops == BACKWARD
    assert work["forward"].matmul_bytes == dot_bytes(LAYERS)
    assert work["backward"].matmul_bytes == dot_bytes(LAYERS) + dot_bytes(LAYERS[1:])
    assert work["forward"].recompute_flops == work["backward"].recompute_flops == 0
    assert work["update"] == PhaseWork()  # present, and empty
    assert work["forward"].other_bytes > 0  # biases, relus, the loss


def test_accepts_an_open_jaxpr():
    closed = jax.make_jaxpr(jnp.matmul)(S((2, 3), jnp.float32), S((3, 5), jnp.float32))
    assert count_work(closed.jaxpr)["forward"].flops == 2 * 2 * 3 * 5


def whole_loss_checkpointed(params, static, x):
    return jax.checkpoint(lambda p: mse(eqx.combine(p, static), x))(params)


def test_checkpointed_loss_recomputes_the_forward_pass():
    # The backward pass of a remat region re-runs its forward: every forward dot again.
    params, static = eqx.partition(mlp(), is_leaf)
    value_and_grad = jax.value_and_grad(whole_loss_checkpointed)
    work = count_work(jax.make_jaxpr(value_and_grad, static_argnums=1)(params, static, x_batch()))
    assert work["forward"].flops == FORWARD
    assert work["backward"].recompute_flops == FORWARD
    assert work["backward"].flops == FORWARD + BACKWARD
    total = sum(w.flops for w in work.values())
    assert total == FORWARD + work["backward"].recompute_flops + BACKWARD

    # Under jax.grad the loss value is dropped, and with it the whole first forward pass
    # (nothing is saved for the backward pass): only the recomputation remains, as in XLA.
    grad = jax.grad(whole_loss_checkpointed)
    work = count_work(jax.make_jaxpr(grad, static_argnums=1)(params, static, x_batch()))
    assert work["forward"].flops == 0
    assert work["backward"].recompute_flops == FORWARD
    assert work["backward"].flops == FORWARD + BACKWARD


def layerwise_loss(activation):
    def loss(model, x):
        def one(v):
            for layer in model.layers[:-1]:
                v = eqx.filter_checkpoint(lambda layer, v: activation(layer(v)))(layer, v)
            return model.layers[-1](v)

        return jnp.sum(jax.vmap(one)(x) ** 2)

    return loss


@pytest.mark.parametrize("activation", [jax.nn.relu, jnp.tanh])
def test_checkpointed_layers_recompute_their_dots(activation):
    # Each hidden layer is `activation(linear(v))` under a checkpoint: the activation's
    # derivative needs the dot's output, so both hidden dots run again; the last layer is
    # not checkpointed.
    work = work_of(eqx.filter_grad(layerwise_loss(activation)), mlp(), x_batch())
    recompute = dot_flops(LAYERS[:-1])
    assert work["forward"].flops == FORWARD
    assert work["backward"].recompute_flops == recompute
    assert work["backward"].flops == recompute + BACKWARD


def test_checkpointing_a_bare_linear_recomputes_nothing():
    # A linear layer's backward needs its input and weight, never its output: the
    # recomputation of a checkpointed `eqx.nn.Linear` alone is dead and dropped.
    def loss(model, x):
        def one(v):
            for layer in model.layers[:-1]:
                v = jax.nn.relu(eqx.filter_checkpoint(layer)(v))
            return model.layers[-1](v)

        return jnp.sum(jax.vmap(one)(x) ** 2)

    work = work_of(eqx.filter_grad(loss), mlp(), x_batch())
    assert work["backward"].recompute_flops == 0
    assert work["backward"].flops == BACKWARD


# -- scan over stacked layers ----------------------------------------------------------

L = 5


def stacked_linears() -> eqx.nn.Linear:
    def build():
        keys = jax.random.split(jax.random.key(1), L)
        return eqx.filter_vmap(lambda k: eqx.nn.Linear(WIDTH, WIDTH, key=k))(keys)

    return eqx.filter_eval_shape(build)


def scanned_loss(stack: eqx.nn.Linear, x: Float[Array, "batch width"]) -> Float[Array, ""]:
    params, static = eqx.partition(stack, eqx.is_array)

    def body(h, layer_params):
        layer = eqx.combine(layer_params, static)
        return jnp.tanh(jax.vmap(layer)(h)), None

    h, _ = jax.lax.scan(body, x, params)
    return jnp.sum(h**2)


def unrolled_loss(stack: eqx.nn.Linear, x: Float[Array, "batch width"]) -> Float[Array, ""]:
    params, static = eqx.partition(stack, eqx.is_array)
    for index in range(L):
        layer = eqx.combine(jax.tree.map(lambda leaf: leaf[index], params), static)
        x = jnp.tanh(jax.vmap(layer)(x))
    return jnp.sum(x**2)


def test_scan_multiplies_by_its_length():
    # Forward: L dots of 2*B*W*W, in a body counted L times. Backward: the transposed
    # body holds a weight and an input gradient and runs L times, so the scan computes
    # the first layer's input gradient that the unrolled program skips.
    stack, x = stacked_linears(), S((B, WIDTH), jnp.float32)
    layer = 2 * B * WIDTH * WIDTH
    scanned = work_of(eqx.filter_grad(scanned_loss), stack, x)
    unrolled = work_of(eqx.filter_grad(unrolled_loss), stack, x)
    assert scanned["forward"].flops == unrolled["forward"].flops == L * layer
    assert unrolled["backward"].flops == L * layer + (L - 1) * layer
    assert scanned["backward"].flops == 2 * L * layer
    layer_bytes = F32 * (B * WIDTH + WIDTH * WIDTH + B * WIDTH)
    assert scanned["forward"].matmul_bytes == unrolled["forward"].matmul_bytes == L * layer_bytes


def test_scan_of_checkpointed_body_counts_recompute_per_step():
    # `nothing_saveable`: the backward body re-runs the forward dot on every step.
    w, x = S((L, WIDTH, WIDTH), jnp.float32), S((B, WIDTH), jnp.float32)
    policy = jax.checkpoint_policies.nothing_saveable

    def loss(w, x):
        def body(h, wl):
            return jnp.tanh(h @ wl), None

        body = jax.checkpoint(body, policy=policy)
        h, _ = jax.lax.scan(body, x, w)
        return jnp.sum(h)

    work = count_work(jax.make_jaxpr(jax.grad(loss))(w, x))
    layer = 2 * B * WIDTH * WIDTH
    assert work["forward"].flops == L * layer
    assert work["backward"].recompute_flops == L * layer
    assert work["backward"].flops == L * layer + 2 * L * layer


# -- a training step ----------------------------------------------------------------------


def test_adam_step_updates_without_dots():
    optimizer = optax.adam(1e-3)
    model = mlp()
    opt_state = eqx.filter_eval_shape(optimizer.init, eqx.filter(model, is_leaf))

    def step(model, opt_state: PyTree, x: Float[Array, "batch in"]):
        loss, grads = eqx.filter_value_and_grad(mse)(model, x)
        updates, opt_state = optimizer.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        return eqx.apply_updates(model, updates), opt_state, loss

    work = work_of(step, model, opt_state, x_batch())
    assert work["forward"].flops == FORWARD
    assert work["backward"].flops == BACKWARD
    assert work["update"].flops == 0
    assert work["update"].matmul_bytes == 0
    # Adam writes at least its two moments and the new parameters, each the model's size.
    parameters = sum(i * o + o for i, o in LAYERS)
    assert work["update"].other_bytes >= 3 * F32 * parameters


def test_optax_apply_updates_is_update_work():
    optimizer = optax.sgd(1e-2)
    params, static = eqx.partition(mlp(), is_leaf)

    def step(params, x):
        grads = jax.grad(lambda p: mse(eqx.combine(p, static), x))(params)
        updates, _ = optimizer.update(grads, optimizer.init(params))
        return optax.apply_updates(params, updates)

    work = count_work(jax.make_jaxpr(step)(params, x_batch()))
    parameters = sum(i * o + o for i, o in LAYERS)
    assert work["update"].flops == 0
    assert work["update"].other_bytes >= F32 * parameters  # at least the new parameters


# -- control flow -------------------------------------------------------------------------

N = 32
SQUARE = S((N, N), jnp.float32)


def test_cond_counts_the_bigger_branch():
    def f(pred, x, w):
        one = lambda x: x @ w  # noqa: E731
        three = lambda x: ((x @ w) @ w) @ w  # noqa: E731
        return jax.lax.cond(pred, one, three, x)

    work = count_work(jax.make_jaxpr(f)(True, SQUARE, SQUARE))
    assert work["forward"].flops == 3 * 2 * N**3
    assert work["forward"].while_loops == 0 and work["forward"].note == ""


def test_while_counts_once_and_says_so():
    def f(x, w):
        return jax.lax.while_loop(lambda c: c[0] < 10, lambda c: (c[0] + 1, c[1] @ w), (0, x))[1]

    work = count_work(jax.make_jaxpr(f)(SQUARE, SQUARE))["forward"]
    assert work.flops == 2 * N**3  # ten trips run; the count cannot know it
    assert work.while_loops == 1
    assert "while loop counted once" in work.note


def test_fori_loop_with_static_bounds_is_a_scan():
    def f(x, w):
        return jax.lax.fori_loop(0, 10, lambda i, x: x @ w, x)

    work = count_work(jax.make_jaxpr(f)(SQUARE, SQUARE))["forward"]
    assert work.flops == 10 * 2 * N**3
    assert work.while_loops == 0


# -- convolution ---------------------------------------------------------------------------


@pytest.mark.parametrize("groups", [1, 2])
def test_conv2d_forward(groups):
    # Each of the 8*16*16 outputs sums a 3x3 window over 4/groups input channels.
    conv = eqx.filter_eval_shape(
        eqx.nn.Conv2d, 4, 8, kernel_size=3, padding=1, groups=groups, key=jax.random.key(2)
    )
    work = work_of(lambda conv, x: conv(x), conv, S((4, 16, 16), jnp.float32))
    assert work["forward"].flops == 2 * (8 * 16 * 16) * (3 * 3) * (4 // groups)
    image, kernel, output = 4 * 16 * 16, 8 * (4 // groups) * 3 * 3, 8 * 16 * 16
    assert work["forward"].matmul_bytes == F32 * (image + kernel + output)


# -- roofline --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "flop_rate, byte_rate",
    [(1e12, 1e12), (1e15, 1e9)],  # compute-bound, memory-bound
    ids=["compute-bound", "memory-bound"],
)
def test_seconds_of_one_matmul(flop_rate, byte_rate):
    n = 512
    closed = jax.make_jaxpr(jnp.matmul)(S((n, n), jnp.float32), S((n, n), jnp.float32))
    work = count_work(closed, flop_rate=flop_rate, byte_rate=byte_rate)["forward"]
    flops, nbytes = 2 * n**3, 3 * F32 * n * n
    assert work.flops == flops and work.matmul_bytes == nbytes
    assert work.seconds == max(flops / flop_rate, nbytes / byte_rate)
    assert count_work(closed)["forward"].seconds == 0.0
    as_integers = count_work(closed, flop_rate=int(flop_rate), byte_rate=int(byte_rate))
    assert as_integers["forward"].seconds == work.seconds


def test_seconds_add_memory_bound_work():
    n = 64
    closed = jax.make_jaxpr(lambda a, b: jnp.tanh(a @ b))(
        S((n, n), jnp.float32), S((n, n), jnp.float32)
    )
    work = count_work(closed, flop_rate=1e12, byte_rate=1e9)["forward"]
    assert work.other_bytes == F32 * n * n
    assert work.seconds == max(2 * n**3 / 1e12, 3 * F32 * n * n / 1e9) + F32 * n * n / 1e9


@pytest.mark.parametrize("rate", [0.0, -1.0])
def test_rates_must_be_positive(rate):
    closed = jax.make_jaxpr(jnp.sin)(1.0)
    with pytest.raises(ValueError, match="flop_rate=.*must be a positive number"):
        count_work(closed, flop_rate=rate)


# -- compute on the host -----------------------------------------------------------------


def test_compute_on_host_is_counted_apart():
    on_host = computed_on_host(jax.jit(lambda a: a @ a))

    def f(a):
        b = a @ a  # device
        c = computed_on_host(jnp.sin)(b)  # host
        return on_host(c) * 2  # host dot, then a device multiply

    a = jnp.ones((N, N))
    work = count_work(jax.make_jaxpr(f)(a), flop_rate=1e12, byte_rate=1e9, host_byte_rate=1e8)
    forward = work["forward"]
    assert forward.flops == 2 * N**3
    assert forward.host_flops == 2 * N**3
    assert forward.other_bytes == F32 * N * N  # the multiply
    assert forward.host_bytes == F32 * N * N + 3 * F32 * N * N  # sin, then the dot
    assert forward.host_seconds == pytest.approx((F32 * N * N + 3 * F32 * N * N) / 1e8)
    assert jnp.allclose(jax.jit(f)(a), 2 * (jnp.sin(a @ a) @ jnp.sin(a @ a)))  # runs on CPU


def test_in_place_updates_cost_their_update_not_the_buffer():
    # A (16, 1024) float32 slice written into a (64, 16, 1024) buffer: XLA updates in
    # place, so the equation writes 64 KiB, not the 4 MiB buffer.
    def fn(buffer, update):
        return jax.lax.dynamic_update_slice(buffer, update[None], (3, 0, 0))

    jaxpr = jax.make_jaxpr(fn)(jnp.zeros((64, 16, 1024)), jnp.ones((16, 1024)))
    work = count_work(jaxpr)["forward"]
    # The update's `[None]` is a free reshape; the slice is the only bytes written.
    assert work.other_bytes == 16 * 1024 * 4
