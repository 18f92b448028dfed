"""`ox.filter_jit` as a drop-in for `eqx.filter_jit` (issue 25).

The table runs small programs, each as Equinox users write them, through both wrappers
and compares what users rely on: the results (values, dtypes, weak types, structure),
how many times the function is traced, how many programs are compiled, what is donated
and which errors are raised. The differences that remain are documented in the docs'
table ("The compiled step"); the rows here are where the two must agree.
"""

import dataclasses
import logging
import warnings
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import offload_eqx as ox

WRAPPERS = {"eqx": eqx.filter_jit, "ox": ox.filter_jit}


class _Compiles:
    """Backend compiles, counted from JAX's own monitoring event."""

    count = 0

    @classmethod
    def listen(cls, event: str, duration_secs: float, **kwargs: Any) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            cls.count += 1


jax.monitoring.register_event_duration_secs_listener(_Compiles.listen)


@dataclasses.dataclass
class Run:
    """What one program did under one wrapper."""

    outputs: list
    traces: int
    compiles: int


def _leaf(x: Any) -> Any:
    """A comparable view of an output leaf: arrays by value, dtype and weak type."""
    if isinstance(x, jax.Array):
        return ("array", np.asarray(x).tolist(), str(x.dtype), jax.typeof(x).weak_type)
    return ("static", x)


def _flat(tree: Any) -> tuple:
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    return str(treedef), [_leaf(x) for x in leaves]


@dataclasses.dataclass
class Program:
    """`build(wrap, counter)` returns a function of no arguments that makes the calls
    (wrapping with `wrap`, counting traces with `counter.append`) and returns a list of
    their outputs."""

    build: Callable[[Callable, list], Callable[[], list]]


def run(program: Program, wrapper: str) -> Run:
    """The program built and run twice, each time with fresh functions (and so fresh
    caches): the second run is measured, after the first has compiled the eager
    operations both wrappers share (array creation, `jnp.ones`)."""
    program.build(WRAPPERS[wrapper], [])()
    traced: list = []
    calls = program.build(WRAPPERS[wrapper], traced)
    before = _Compiles.count
    outputs = calls()
    return Run([_flat(out) for out in outputs], len(traced), _Compiles.count - before)


# -- The programs. ---------------------------------------------------------------------


def numpy_float64(wrap, traced):
    """A data loader's float64 batches: converted as `jax.jit` converts them."""

    def f(x):
        traced.append(1)
        return x * 2 + 1

    step = wrap(f)
    return lambda: [step(np.zeros(3)), step(np.random.default_rng(0).normal(size=3))]


def numpy_batches_through_a_model(wrap, traced):
    mlp = eqx.nn.MLP(4, 2, 8, 1, key=jax.random.key(0))

    def loss(model, x, y):
        traced.append(1)
        return jnp.mean((jax.vmap(model)(x) - y) ** 2)

    step = wrap(eqx.filter_value_and_grad(loss))
    rng = np.random.default_rng(0)
    batches = [(rng.normal(size=(8, 4)), rng.normal(size=(8, 2))) for _ in range(3)]
    return lambda: [step(mlp, x, y) for x, y in batches]


def numpy_leaf_inside_a_module(wrap, traced):
    """A NumPy int64 held inside a module (as `eqx.internal.noinline` holds its index)."""

    class Indexed(eqx.Module):
        table: jax.Array
        index: np.ndarray

        def __call__(self, x):
            traced.append(1)
            return x + self.table[self.index]

    module = Indexed(jnp.arange(4.0), np.array(2, np.int64))
    step = wrap(lambda m, x: m(x))
    return lambda: [step(module, jnp.ones(2)), step(module, jnp.zeros(2))]


def weak_types(wrap, traced):
    """`jnp.array(1.0)` is weakly typed; adding it to an int keeps JAX's promotion."""

    def f(x, y):
        traced.append(1)
        return x + y

    step = wrap(f)
    return lambda: [step(jnp.array(1.0), jnp.array(1)), step(jnp.array(1.0), jnp.ones(2))]


def bf16_model_weak_learning_rate(wrap, traced):
    """A bf16 model updated with `lr = jnp.asarray(1e-3)`: the update stays bf16."""
    model = {"w": jnp.ones((3, 3), jnp.bfloat16)}

    def update(model, lr):
        traced.append(1)
        return jax.tree.map(lambda w: w - lr * w, model)

    step = wrap(update)
    return lambda: [step(model, jnp.asarray(1e-3))]


def rewrapped_grad_in_a_loop(wrap, traced):
    """`wrap(eqx.filter_grad(f))` made afresh on every iteration: one trace."""

    def f(x):
        traced.append(1)
        return jnp.sum(x**2)

    return lambda: [wrap(eqx.filter_grad(f))(jnp.arange(3.0)) for _ in range(3)]


def rewrapped_equal_module(wrap, traced):
    """An equal module wrapped again, and a bound method taken afresh."""

    class Scale(eqx.Module):
        w: jax.Array

        def __call__(self, x):
            traced.append(1)
            return self.w * x

        def double(self, x):
            traced.append(1)
            return 2 * self.w * x

    module = Scale(jnp.arange(3.0))

    def calls():
        out = [wrap(module)(jnp.ones(3)) for _ in range(2)]
        return out + [wrap(module.double)(jnp.ones(3)) for _ in range(2)]

    return calls


def grad_of_the_wrapper(wrap, traced):
    """`jax.grad(wrap(f))` outside any jit, three times: traced once."""

    def f(x):
        traced.append(1)
        return jnp.sum(jnp.sin(x) ** 2)

    step = wrap(f)
    return lambda: [jax.grad(step)(jnp.arange(3.0)) for _ in range(3)]


def vmap_of_the_wrapper(wrap, traced):
    def f(x):
        traced.append(1)
        return jnp.sum(x**2)

    step = wrap(f)
    return lambda: [jax.vmap(step)(jnp.arange(6.0).reshape(2, 3)) for _ in range(3)]


def nested_in_jax_jit(wrap, traced):
    def f(x):
        traced.append(1)
        return x * 2

    inner = wrap(f)
    outer = jax.jit(lambda x: inner(x) + 1)
    return lambda: [outer(jnp.ones(2)), outer(jnp.zeros(2))]


def static_arguments(wrap, traced):
    """Python scalars and functions are static: each new value compiles again."""

    def f(x, factor, activation):
        traced.append(1)
        return activation(x * factor)

    step = wrap(f)
    x = jnp.arange(3.0)
    return lambda: [
        step(x, 2.0, jax.nn.relu),
        step(x + 1, 2.0, jax.nn.relu),
        step(x, 3.0, jax.nn.relu),
        step(x, 3.0, jnp.tanh),
    ]


def keyword_arguments_and_outputs(wrap, traced):
    def f(x, *, y, scale=1.0):
        traced.append(1)
        return {"sum": (x + y) * scale, "tag": "sum", "n": 3}

    step = wrap(f)
    return lambda: [step(jnp.ones(2), y=jnp.ones(2)), step(jnp.ones(2), y=jnp.zeros(2), scale=2.0)]


def new_shapes(wrap, traced):
    def f(x):
        traced.append(1)
        return x.sum()

    step = wrap(f)
    return lambda: [step(jnp.ones(2)), step(jnp.ones(3)), step(jnp.ones(2))]


def random_keys(wrap, traced):
    """Typed PRNG keys as arguments, dropout as users write it."""
    dropout = eqx.nn.Dropout(0.5)

    def f(x, key):
        traced.append(1)
        return dropout(x, key=key)

    step = wrap(f)
    return lambda: [step(jnp.ones(8), jax.random.key(i)) for i in range(2)]


def while_loop_sampler(wrap, traced):
    """A sampler in `eqx.internal.while_loop`, as diffrax runs its solvers."""
    lin = eqx.nn.Linear(3, 3, key=jax.random.key(0))

    def sample(model, x):
        traced.append(1)

        def body(carry):
            i, x = carry
            return i + 1, x - 0.1 * jnp.tanh(model(x))

        return eqx.internal.while_loop(
            lambda c: c[0] < 4, body, (0, x), max_steps=8, kind="checkpointed"
        )[1]

    step = wrap(sample)
    return lambda: [step(lin, jnp.ones(3)), step(lin, jnp.zeros(3))]


PROGRAMS = {
    f.__name__: Program(f)
    for f in (
        numpy_float64,
        numpy_batches_through_a_model,
        numpy_leaf_inside_a_module,
        weak_types,
        bf16_model_weak_learning_rate,
        rewrapped_grad_in_a_loop,
        rewrapped_equal_module,
        grad_of_the_wrapper,
        vmap_of_the_wrapper,
        nested_in_jax_jit,
        static_arguments,
        keyword_arguments_and_outputs,
        new_shapes,
        random_keys,
        while_loop_sampler,
    )
}


@pytest.mark.parametrize("name", list(PROGRAMS))
def test_same_as_eqx_filter_jit(name: str):
    """Results, traces and compiles equal `eqx.filter_jit`'s."""
    theirs = run(PROGRAMS[name], "eqx")
    ours = run(PROGRAMS[name], "ox")
    assert ours.outputs == theirs.outputs
    assert (ours.traces, ours.compiles) == (theirs.traces, theirs.compiles)


def test_strict_promotion_keeps_weak_types():
    with jax.numpy_dtype_promotion("strict"):
        out = ox.filter_jit(lambda x, y: x + y)(jnp.array(1.0), jnp.array(1))
    assert jax.typeof(out).weak_type and out.dtype == jnp.float32


def test_bf16_model_with_a_weak_learning_rate_is_donated():
    @ox.filter_jit(donate="all")
    def update(model, lr):
        return jax.tree.map(lambda w: w - lr * w, model)

    model = {"w": jnp.ones((3, 3), jnp.bfloat16)}
    new = update(model, jnp.asarray(1e-3))
    assert new["w"].dtype == jnp.bfloat16
    assert model["w"].is_deleted()


# -- Donation values. -----------------------------------------------------------------


@pytest.mark.parametrize("donate", ["warn", "warn-except-first", "all", "all-except-first"])
def test_donate_values_of_equinox(donate: str):
    """Equinox's five values; the `warn` ones donate as their `all` counterparts."""

    @ox.filter_jit(donate=donate)
    def step(first, second):
        return jax.tree.map(lambda a: a + 1, (first, second))

    first, second = {"a": jnp.ones(3)}, {"b": jnp.ones(3)}
    step(first, second)
    assert first["a"].is_deleted() == (not donate.endswith("except-first"))
    assert second["b"].is_deleted()


def test_donate_value_refused_names_the_allowed_ones():
    with pytest.raises(
        ValueError, match=r"'all', 'all-except-first', 'warn', 'warn-except-first', 'none'"
    ):
        ox.filter_jit(lambda x: x, donate="some")


# -- Ahead of time. ------------------------------------------------------------------------


def test_lower_compile_call_like_the_step():
    step = ox.filter_jit(lambda x, n, scale=1.0: {"y": x * n * scale})
    x = jnp.arange(3.0)
    compiled = step.lower(x, 4).compile()
    assert isinstance(compiled.as_text(), str)
    np.testing.assert_array_equal(compiled(x, 4)["y"], x * 4)
    np.testing.assert_array_equal(compiled(x + 1, 4)["y"], (x + 1) * 4)
    options = step.lower(x, 4).compile(compiler_options={"xla_embed_ir_in_executable": True})
    np.testing.assert_array_equal(options(x, 4)["y"], x * 4)
    with pytest.raises(TypeError, match=r"lowered for other arguments: .*static"):
        compiled(x, 5)
    with pytest.raises(
        TypeError,
        match=r"lowered for other arguments: `x` is float32\[4\], lowered for float32\[3\]",
    ):
        compiled(jnp.ones(4), 4)


def test_lower_compile_of_a_placed_training_step():
    """The compiled object of a hybrid step takes the model and returns the new one, in
    host memory where the plan keeps it."""
    from helpers import make_optimizer, make_step, scanned_model

    model = ox.place(scanned_model(jax.random.key(0)), "hybrid")
    opt = make_optimizer()
    opt_state = ox.place(opt.init(model), "hybrid")
    step = make_step(opt, "hybrid")
    x = jnp.ones((8, 16))
    compiled = step.lower(model, opt_state, x).compile()
    new_model, _, loss = compiled(model, opt_state, x)
    expected_model, _, expected_loss = step(model, opt_state, x)
    np.testing.assert_array_equal(loss, expected_loss)
    np.testing.assert_array_equal(new_model.layers.w1, expected_model.layers.w1)
    assert jax.typeof(new_model.layers.w1).memory_space == jax.memory.Space.Host


# -- Run-time errors: eqx.error_if. --------------------------------------------------------


def test_error_if_raises_equinox_runtime_error_with_the_message(caplog):
    def f(x):
        return eqx.error_if(x, x > 1, "x is too large") * 2

    step = ox.filter_jit(f)
    np.testing.assert_array_equal(step(jnp.zeros(3)), jnp.zeros(3))
    with caplog.at_level(logging.ERROR):
        with pytest.raises(eqx.EquinoxRuntimeError, match="x is too large"):
            step(jnp.full(3, 2.0))
    assert "you do not appear to be using" not in caplog.text
    assert "pure_callback failed" not in caplog.text


def test_branched_error_if_in_a_training_step():
    def step(model, x):
        loss = jnp.sum(model(x) ** 2)
        index = jnp.where(jnp.isnan(loss), 0, jnp.where(loss > 1e6, 1, 2))
        return eqx.branched_error_if(loss, index < 2, index, ["loss is NaN", "loss diverged"])

    model = eqx.nn.Linear(3, 1, key=jax.random.key(0))
    jitted = ox.filter_jit(step)
    assert np.isfinite(float(jitted(model, jnp.ones(3))))
    with pytest.raises(eqx.EquinoxRuntimeError, match="loss is NaN"):
        jitted(model, jnp.full(3, jnp.nan))
    with pytest.raises(eqx.EquinoxRuntimeError, match="loss diverged"):
        jitted(model, jnp.full(3, 1e5))


def test_an_error_if_in_a_donating_step_keeps_the_state_it_was_given():
    """`eqx.error_if` in a `donate="all"` step deleted the model and optimizer state when
    it fired (issue 26, item 14): such a step donates nothing unless told to, and says so;
    `jax.debug.print` (which cannot raise) keeps donation."""
    opt = optax.sgd(0.1)

    def step(model, opt_state, x):
        loss, grads = eqx.filter_value_and_grad(lambda m: jnp.sum(m(x) ** 2))(model)
        loss = eqx.error_if(loss, ~jnp.isfinite(loss), "loss is not finite")
        updates, opt_state = opt.update(grads, opt_state)
        return eqx.apply_updates(model, updates), opt_state, loss

    model = eqx.nn.Linear(3, 1, key=jax.random.key(0))
    opt_state = opt.init(eqx.filter(model, eqx.is_array))
    checked = ox.filter_jit(step, donate="all")
    with pytest.warns(UserWarning, match=r"an Equinox check.*donates nothing"):
        model, opt_state, _ = checked(model, opt_state, jnp.ones(3))
    with pytest.raises(eqx.EquinoxRuntimeError, match="loss is not finite"):
        checked(model, opt_state, jnp.full(3, jnp.nan))
    assert not model.weight.is_deleted()
    checked(model, opt_state, jnp.ones(3))  # training resumes from the state it was given

    def printed(model, x):
        jax.debug.print("{}", x[0])
        return eqx.apply_updates(model, jax.tree.map(jnp.zeros_like, model)), x

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        entry, _ = ox.filter_jit(printed, donate="all").compilation(model, jnp.ones(3))
    assert entry.donate_argnums


def test_a_step_without_checks_is_not_waited_for():
    """Only programs with an Equinox check block on their result (dispatch stays async)."""
    step = ox.filter_jit(lambda x: x + 1)
    entry, _ = step.compilation(jnp.ones(2))
    assert not entry.checks
    checked = ox.filter_jit(lambda x: eqx.error_if(x, x > 1, "no"))
    entry, _ = checked.compilation(jnp.ones(2))
    assert entry.checks


# -- The cache is the function's. ----------------------------------------------------------


def test_the_cache_is_shared_and_cleared():
    def f(x):
        return x * 3

    a, b = ox.filter_jit(f), ox.filter_jit(f)
    a(jnp.ones(2))
    assert b.compilations == 1
    assert ox.filter_jit(f, donate="all").compilations == 0  # other options: another cache
    eqx.clear_caches()
    assert a.compilations == 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        b(jnp.ones(2))
    assert a.compilations == 1


def test_an_array_in_two_donated_arguments_is_copied_for_the_call():
    """`eqx.nn.State(model)` shares the model's initial state arrays with the state;
    `eqx.filter_jit(donate="all")` fails at run time on them (one buffer donated twice)."""
    model = eqx.nn.BatchNorm(3, "batch", mode="ema")
    state = eqx.nn.State(model)

    @ox.filter_jit(donate="all")
    def step(model, state, x):
        forward = jax.vmap(model, axis_name="batch", in_axes=(0, None), out_axes=(0, None))
        y, state = forward(x, state)
        return model, state, y

    x = jnp.arange(6.0).reshape(2, 3)
    expected = eqx.filter_jit(step.__wrapped__)(model, state, x)
    model, state, y = step(model, state, x)
    np.testing.assert_allclose(y, expected[2])
    model, state, y = step(model, state, x)  # the outputs are distinct buffers
    assert np.all(np.isfinite(y))


_ALIAS_PROGRAM = """
import jax, jax.numpy as jnp, equinox as eqx
import offload_eqx as ox

class Counter(eqx.Module):
    count: jax.Array = ox.field(memory="pinned_host")

@ox.filter_jit(donate="all")
def step(counter):
    on_device = jax.device_put(counter.count, jax.memory.Space.Device) + 1
    return on_device, Counter(jax.device_put(on_device, jax.memory.Space.Host))

counter = ox.place(Counter(jnp.zeros((), jnp.int32)))
for _ in range(3):
    value, counter = step(counter)
print(int(value), int(counter.count), counter.count.sharding.memory_kind)
"""


def test_a_device_output_shaped_like_a_donated_host_leaf_is_not_aliased_to_it():
    """Device outputs off a mesh are left to the compiler, except one with the shape and
    dtype of a donated host-resident argument: XLA would alias the host buffer to it and
    abort the process (run in a child process, so that an abort fails this test only)."""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", _ALIAS_PROGRAM], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["3", "3", "pinned_host"]


# -- Errors: the same exception types (ours may be a subclass, with a message in paths).


def _wrong_shapes(wrap):
    wrap(lambda a, b: a @ b)(jnp.ones((2, 3)), jnp.ones((2, 3)))


def _unhashable_static(wrap):
    wrap(lambda x, table: x * table["a"])(jnp.ones(2), {"a": {1.0}})


def _donated_input_used_again(wrap):
    step = wrap(lambda m: {"w": m["w"] + 1}, donate="all")
    model = {"w": jnp.ones(3)}
    step(model)
    step(model)


def _python_error_in_the_function(wrap):
    def f(x):
        raise KeyError("no such layer")

    wrap(f)(jnp.ones(2))


def _bool_of_a_tracer(wrap):
    wrap(lambda x: x if x > 0 else -x)(jnp.ones(()))


def _missing_argument(wrap):
    wrap(lambda x, y: x + y)(jnp.ones(2))


def _bad_donate_value(wrap):
    wrap(lambda x: x, donate="some")


def _not_callable(wrap):
    wrap(3)


def _error_if(wrap):
    wrap(lambda x: eqx.error_if(x, x > 0, "positive"))(jnp.ones(2))


ERRORS = {
    f.__name__.lstrip("_"): f
    for f in (
        _wrong_shapes,
        _unhashable_static,
        _donated_input_used_again,
        _python_error_in_the_function,
        _bool_of_a_tracer,
        _missing_argument,
        _bad_donate_value,
        _not_callable,
        _error_if,
    )
}


@pytest.mark.parametrize("name", list(ERRORS))
def test_same_errors_as_eqx_filter_jit(name: str):
    with pytest.raises(Exception) as theirs:
        ERRORS[name](eqx.filter_jit)
    with pytest.raises(Exception) as ours:
        ERRORS[name](ox.filter_jit)
    assert isinstance(ours.value, type(theirs.value)), (ours.value, theirs.value)
