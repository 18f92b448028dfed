"""The call of an `ox.filter_jit` step as users make it (issue 17, items 4, 6, 7 and 9):
bound methods traced like modules, donation of what the step returns a new value of,
run-time errors that name leaf paths, and Ctrl-C in a donating loop."""

import signal
import time
import weakref

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import offload_eqx as ox


def _mlp(width: int = 8) -> eqx.nn.MLP:
    return eqx.nn.MLP(4, 4, width, depth=1, key=jax.random.key(0))


# -- item 4: bound methods ----------------------------------------------------------------


class Scaled(eqx.Module):
    w: jax.Array

    def __call__(self, x):
        return x @ self.w

    def shifted(self, x, shift):
        return x @ self.w + shift


def test_a_bound_call_method_is_traced_like_the_module():
    """`ox.filter_jit(model.__call__)` used to bake the weights into the program as
    constants (102,887 characters of HLO against 1,909), and plan only `args[0]`."""
    mlp = eqx.nn.MLP(64, 64, 384, depth=2, key=jax.random.key(1))
    x = jnp.ones(64)
    as_module, as_method = ox.filter_jit(mlp), ox.filter_jit(mlp.__call__)
    assert [leaf.path for leaf in as_method.plan(x).leaves] == [
        leaf.path for leaf in as_module.plan(x).leaves
    ]
    assert as_method.plan(x).leaves[0].path == "fn.layers[0].weight"
    assert len(as_method.lower(x).as_text()) < 20_000
    np.testing.assert_allclose(as_method(x), mlp(x), rtol=1e-6)


def test_a_bound_method_keeps_its_parameter_names_and_is_donated_like_an_argument():
    model = Scaled(jnp.eye(3))
    step = ox.filter_jit(model.shifted)
    assert [leaf.path for leaf in step.plan(jnp.ones(3), shift=jnp.ones(3)).leaves] == [
        "fn.w",
        "x",
        "shift",
    ]
    assert step.__name__ == "shifted"
    np.testing.assert_allclose(step(jnp.ones(3), shift=jnp.ones(3)), 2 * jnp.ones(3))


# -- item 6: donation takes only state ------------------------------------------------------


def _train_step():
    opt = ox.offload_optimizer(optax.adam(1e-2))

    @ox.filter_jit(donate="all")
    def step(model, opt_state, x, scale):
        loss, grads = eqx.filter_value_and_grad(lambda m: scale * jnp.mean(jax.vmap(m)(x) ** 2))(
            model
        )
        updates, opt_state = opt.update(grads, opt_state, model)
        return ox.apply_updates(model, updates), opt_state, loss, jax.vmap(model)(x)

    return opt, step


def test_donation_takes_what_the_step_returns_a_new_value_of():
    """A float32 scalar argument (a loss scale, shaped like the loss) and the batch
    (shaped like the predictions) used to be donated, and the next call failed."""
    opt, step = _train_step()
    model = _mlp(4)
    opt_state = opt.init(eqx.filter(model, eqx.is_array))
    x, scale = jnp.ones((3, 4)), jnp.float32(2.0)
    entry, _ = step.compilation(model, opt_state, x, scale)
    donated = {entry.plan.leaves[i].path for i in entry.donate_argnums}
    assert donated and all(p.startswith(("model.", "opt_state.")) for p in donated), donated
    new_model, new_state, _, _ = step(model, opt_state, x, scale)
    assert model.layers[0].weight.is_deleted()
    assert not x.is_deleted() and not scale.is_deleted()
    step(new_model, new_state, x, scale)  # the batch and the scale are still usable


# -- item 7: run-time errors name paths -------------------------------------------------------


def test_reusing_a_donated_model_names_the_leaves_and_the_fix():
    """It was `Invalid buffer passed to Execute() as argument 0 to replica 0`."""
    opt, step = _train_step()
    model = _mlp()
    opt_state = opt.init(eqx.filter(model, eqx.is_array))
    x, scale = jnp.ones((3, 4)), jnp.float32(1.0)
    step(model, opt_state, x, scale)
    with pytest.raises(
        ValueError,
        match=r"ox.filter_jit\(step\): `model.layers\[0\].weight`, .* donated to an earlier "
        r"call \(donate='all'\).*Pass the step's outputs, not the donated inputs",
    ):
        step(model, opt_state, x, scale)


def test_updates_of_another_model_name_the_leaf():
    """It was a broadcasting `TypeError` (or JAX's pytree-structure message)."""

    class Pair(eqx.Module):
        a: jax.Array
        b: jax.Array

    model = Pair(jnp.ones(3), jnp.ones((2, 2)))
    with pytest.raises(
        ValueError,
        match=r"`updates.a` has shape \(4,\) but `model.a` has shape \(3,\), so the updates "
        r"were made for another model",
    ):
        ox.apply_updates(model, Pair(jnp.ones(4), jnp.ones((2, 2))))
    with pytest.raises(ValueError, match=r"differ in structure.*made for another model"):
        ox.apply_updates(_mlp(8), eqx.filter(_mlp(16), eqx.is_array))


# -- item 9: Ctrl-C in a donating loop ----------------------------------------------------------


def _interrupt_next_call(step, *args):
    """Make the next call of `step` on these arguments' entry receive SIGINT just after
    its program ran (after the donation), as if Ctrl-C came then."""
    entry, _ = step.compilation(*args)
    run = entry.jitted

    def interrupted(*leaves):
        entry.jitted = run
        out = run(*leaves)
        signal.raise_signal(signal.SIGINT)
        return out

    entry.jitted = interrupted


@pytest.fixture
def python_sigint():
    """Python's own SIGINT handler in place, as in a script (restored afterwards)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def test_ctrl_c_after_the_inputs_were_donated_reaches_the_loop_before_the_next_donation(
    python_sigint,
):
    """Ctrl-C that lands after the step donated its inputs, before the loop rebinds its
    names, left the loop's names on deleted buffers (10 of 10 tries; plain
    `eqx.filter_jit` does the same). The step now returns its outputs, the loop's names
    are bound to them, and the interrupt is raised by the next call before it donates
    anything (issue 26, item 15)."""
    opt, step = _train_step()
    x, scale = jnp.ones((3, 4)), jnp.float32(1.0)
    model, opt_state, _, _ = step(_mlp(), opt.init(eqx.filter(_mlp(), eqx.is_array)), x, scale)
    copies = jax.tree.map(lambda a: jnp.copy(a) if eqx.is_array(a) else a, (model, opt_state))
    expected = step(*copies, x, scale)  # the same step, not interrupted

    _interrupt_next_call(step, model, opt_state, x, scale)
    model, opt_state, _, _ = step(model, opt_state, x, scale)  # returns: names rebound
    for got, want in zip(jax.tree.leaves((model, opt_state)), jax.tree.leaves(expected)):
        np.testing.assert_array_equal(got, want)
    with pytest.raises(KeyboardInterrupt, match=r"names your loop bound to them hold the state"):
        step(model, opt_state, x, scale)
    assert not model.layers[0].weight.is_deleted()  # nothing donated by the refused call
    step(model, opt_state, x, scale)  # training goes on


def test_ctrl_c_held_by_a_step_arrives_after_a_grace_when_no_step_follows(python_sigint):
    """Where the loop does not call the step again, the held Ctrl-C still arrives (its
    names bound by then)."""
    opt, step = _train_step()
    x, scale = jnp.ones((3, 4)), jnp.float32(1.0)
    model, opt_state, _, _ = step(_mlp(), opt.init(eqx.filter(_mlp(), eqx.is_array)), x, scale)
    _interrupt_next_call(step, model, opt_state, x, scale)
    model, opt_state, _, _ = step(model, opt_state, x, scale)
    with pytest.raises(KeyboardInterrupt):
        for _ in range(200):  # the loop does something else: up to 10 s
            time.sleep(0.05)
    assert not model.layers[0].weight.is_deleted()


def test_ctrl_c_is_still_held_after_the_program_sets_its_own_handler(python_sigint):
    """A handler the program installs after the first donating call (a library, a test
    runner) used to replace ours for good, so Ctrl-C again lost the donated state; it
    is now chained behind ours, and receives the signal when it is delivered."""
    opt, step = _train_step()
    x, scale = jnp.ones((3, 4)), jnp.float32(1.0)
    model, opt_state, _, _ = step(_mlp(), opt.init(eqx.filter(_mlp(), eqx.is_array)), x, scale)
    seen = []

    def own(signum, frame):
        seen.append(signum)
        raise KeyboardInterrupt("the program's own handler")

    signal.signal(signal.SIGINT, own)
    _interrupt_next_call(step, model, opt_state, x, scale)
    try:
        model, opt_state, _, _ = step(model, opt_state, x, scale)  # returns: names rebound
    except KeyboardInterrupt as error:
        pytest.fail(f"Ctrl-C was not held during the donating call: {error}")
    assert seen == []
    with pytest.raises(KeyboardInterrupt, match="the program's own handler"):
        step(model, opt_state, x, scale)
    assert seen == [signal.SIGINT]
    assert not model.layers[0].weight.is_deleted()


def test_ctrl_c_just_after_a_donating_step_returned_is_held_too(python_sigint):
    """A Ctrl-C between the step's return and the loop's rebinding (here: its first
    instants after the return) is held as one during the call: the outputs reach the
    loop's names, the next donating call raises it, and `last_outputs` keeps them."""
    opt, step = _train_step()
    x, scale = jnp.ones((3, 4)), jnp.float32(1.0)
    model, opt_state, _, _ = step(_mlp(), opt.init(eqx.filter(_mlp(), eqx.is_array)), x, scale)
    outputs = step(model, opt_state, x, scale)
    signal.raise_signal(signal.SIGINT)  # would have raised here, the outputs unbound
    model, opt_state, _, _ = outputs
    del outputs
    with pytest.raises(KeyboardInterrupt, match=r"while \(or just after\)"):
        step(model, opt_state, x, scale)
    assert not model.layers[0].weight.is_deleted()


def test_the_timers_signal_for_an_interrupt_already_delivered_is_dropped(python_sigint):
    """The grace timer sends SIGINT to the main thread for a held Ctrl-C; if a donating
    call delivered that Ctrl-C first, the signal still arrived and raised a second
    `KeyboardInterrupt` wherever Python was (seen in the test session inside JAX's
    garbage-collection callback, "Exception ignored")."""
    from offload_eqx._jit import interrupts

    opt, step = _train_step()
    x, scale = jnp.ones((3, 4)), jnp.float32(1.0)
    model, opt_state, _, _ = step(_mlp(), opt.init(eqx.filter(_mlp(), eqx.is_array)), x, scale)
    interrupts._Hold.fired = True  # the timer fired; the interrupt was delivered since
    signal.raise_signal(signal.SIGINT)  # its signal arrives now: nothing is raised
    assert not interrupts._Hold.fired
    with pytest.raises(KeyboardInterrupt):  # a Ctrl-C of the user's is not dropped
        time.sleep(1)  # past the grace after the last step
        signal.raise_signal(signal.SIGINT)


def _calling_back(kind: str):
    """A step whose host callback is interrupted by Ctrl-C (the signal arrives while the
    callback's Python code runs)."""

    def interrupt(x):
        signal.raise_signal(signal.SIGINT)
        time.sleep(1.0)  # Python raises the interrupt here
        return x

    def step(model, x):
        if kind == "debug":
            jax.debug.callback(interrupt, x)
        else:
            x = jax.pure_callback(interrupt, jax.ShapeDtypeStruct(x.shape, x.dtype), x)
        return jax.tree.map(lambda w: w + x.sum(), model), x.sum()

    return step


@pytest.mark.filterwarnings("ignore:.*the step can raise while it runs")
@pytest.mark.parametrize("donate", ["none", "all"])
@pytest.mark.parametrize("kind", ["debug", "pure"])
def test_ctrl_c_in_a_host_callback_is_a_keyboard_interrupt_that_says_the_state_is_kept(
    python_sigint, kind, donate
):
    """It surfaced as XLA's `JaxRuntimeError: INTERNAL: CpuCallback error calling
    callback`, which `except KeyboardInterrupt` does not catch, and said nothing of the
    state (issue 50, item 7). A step that calls back donates nothing, so the inputs hold
    the state before the step, and the error says so."""
    step = ox.filter_jit(_calling_back(kind), donate=donate)
    model = {"w": jnp.ones(3)}
    with pytest.raises(KeyboardInterrupt, match=r"ran a host callback.*arguments you passed still"):
        step(model, jnp.ones(3))
    assert not model["w"].is_deleted()
    np.testing.assert_array_equal(model["w"], np.ones(3))


def test_ctrl_c_in_the_callback_of_a_step_donating_anyway_is_held(python_sigint):
    """With `donate_on_error=True` the step donates although it calls back: Ctrl-C is then
    held as in every donating step, the step returns its outputs, and the interrupt
    comes at the next call, before it donates."""
    step = ox.filter_jit(_calling_back("pure"), donate="all", donate_on_error=True)
    model, _ = step({"w": jnp.ones(3)}, jnp.ones(3))
    with pytest.raises(KeyboardInterrupt, match=r"while \(or just after\) ox.filter_jit"):
        for _ in range(3):
            model, _ = step(model, jnp.ones(3))
    assert not model["w"].is_deleted()


def test_a_finished_runs_state_leaves_device_memory():
    """`last_outputs` kept the latest donating call's outputs in the function's cache
    for as long as the function lived: on the first GPU run, each strategy tried in turn
    left its 7.2 GB model and AdamW state on the device, until one ran out of memory.
    They are held weakly now (strongly only after a held Ctrl-C)."""
    opt, step = _train_step()
    x, scale = jnp.ones((3, 4)), jnp.float32(1.0)
    model = _mlp()
    state = opt.init(eqx.filter(model, eqx.is_array))
    model, state, loss, predictions = step(model, state, x, scale)
    del predictions
    weight = weakref.ref(model.layers[0].weight)
    kept = step.last_outputs  # while the loop's names hold them
    assert kept[0].layers[0].weight is model.layers[0].weight and kept[2] is loss
    assert kept[3] is None  # dropped by the loop
    del model, state, loss, kept
    assert weight() is None
    assert step.last_outputs is None


def test_a_step_that_donates_nothing_keeps_nothing():
    step = ox.filter_jit(lambda m, x: jax.vmap(m)(x))
    step(_mlp(), jnp.ones((3, 4)))
    assert step.last_outputs is None


def test_a_structure_called_again_takes_the_fast_path_and_leaves_it_when_it_must():
    """The second call of a structure runs its entry without building the key; new
    static leaves, new shapes and a new memory still take the whole path (issue 50,
    item 10)."""
    calls = []

    def forward(model, x):
        calls.append(1)  # counts traces
        return model(x)

    step = ox.filter_jit(forward)
    model = eqx.nn.MLP(4, 4, 8, 1, key=jax.random.key(0))
    x = jnp.ones(4)
    expected = model(x)
    np.testing.assert_allclose(step(model, x), expected, rtol=1e-6)
    fast = step.cache.fast
    assert len(fast) == 1
    np.testing.assert_allclose(step(model, x), expected, rtol=1e-6)
    assert len(calls) == 1
    other = eqx.tree_at(lambda m: m.activation, model, jax.nn.tanh)  # a new static leaf
    np.testing.assert_allclose(step(other, x), other(x), rtol=1e-6)
    assert len(calls) == 2
    np.testing.assert_allclose(step(model, x), expected, rtol=1e-6)  # the first again
    assert len(calls) == 2
    y = x * 2.0
    np.testing.assert_allclose(step(model, y), model(y), rtol=1e-6)
    assert len(calls) == 2  # new values, same types: no retrace
    half = jnp.ones(4, jnp.bfloat16)  # a new dtype: traced again, through the whole path
    np.testing.assert_allclose(step(model, half), model(half), rtol=1e-2)
    assert len(calls) == 3
    np.testing.assert_allclose(step(model, y), model(y), rtol=1e-6)
    assert len(calls) == 3


def test_a_module_as_the_function_takes_the_fast_path_with_its_own_arrays():
    """`ox.filter_jit(model)(x)`: the function's arrays are leaves of the fast path's
    structure, so two models of one structure share a program and each call reads its
    own model's arrays."""
    first = eqx.nn.MLP(4, 4, 8, 1, key=jax.random.key(0))
    second = eqx.nn.MLP(4, 4, 8, 1, key=jax.random.key(1))
    x = jnp.ones(4)
    one, two = ox.filter_jit(first), ox.filter_jit(second)
    for _ in range(3):  # the first call of each compiles or finds the entry; then fast
        np.testing.assert_allclose(one(x), first(x), rtol=1e-6)
        np.testing.assert_allclose(two(x), second(x), rtol=1e-6)
    assert len(one.cache.fast) == 1
    assert one.compilations == 1
    assert not np.allclose(one(x), two(x))


class Named(eqx.Module):
    """A module with a static leaf that is a string: equal strings made apart are equal
    keys of the compile cache, not the same object."""

    w: jax.Array
    name: str

    def __call__(self, x):
        return x * self.w


def test_equal_static_leaves_take_the_fast_path(monkeypatch):
    """The fast path compared each static leaf by identity: a static equal to the one
    of the cached call but made apart (a name read from a config, a string joined
    afresh) took the whole path every call, key built and looked up, to find the same
    program. It compares them as the key does now (issue 66, item 11)."""
    from offload_eqx._jit import dispatch

    whole_path = []
    real = dispatch._dispatch
    monkeypatch.setattr(
        dispatch, "_dispatch", lambda *a, **k: whole_path.append(1) or real(*a, **k)
    )
    step = ox.filter_jit(lambda model, x: model(x))
    x = jnp.ones(3)
    step(Named(jnp.ones(3), "".join(["la", "yer"])), x)  # compiles; the fast path learns it
    assert len(whole_path) == 1
    model = Named(jnp.ones(3) + 1, "".join(["la", "yer"]))  # an equal name, another object
    np.testing.assert_allclose(step(model, x), 2 * np.ones(3))
    assert len(whole_path) == 1, "an equal static leaf left the fast path"
    np.testing.assert_allclose(step(Named(jnp.ones(3), "other"), x), np.ones(3))
    assert len(whole_path) == 2  # another value: the whole path, which compiles it
    assert step.compilations == 2


def test_the_fast_path_reads_the_options_it_branches_on_from_the_cache():
    """Each read of a field of the wrapper (an `eqx.Module`) costs about a microsecond
    of a call; the per-call path read three. It reads the cache alone, which holds the
    options it branches on, pickled with it."""
    import pickle

    audited = ox.filter_jit(lambda x: x + 1, audit=True)
    module = ox.filter_jit(Scaled(jnp.eye(2)))
    assert (audited.cache.audit, audited.cache.fn_has_arrays) == (True, False)
    assert (module.cache.audit, module.cache.fn_has_arrays) == (False, True)
    restored = pickle.loads(pickle.dumps(module.cache))
    assert (restored.audit, restored.fn_has_arrays) == (False, True)


def test_a_donating_call_reads_the_sigint_handler_raw(python_sigint, monkeypatch):
    """Each donating call checks that its Ctrl-C handler is still in front. It read the
    handler with `signal.getsignal`, which tries to make an enum member of it and, for a
    function, fails with a `ValueError` it catches: 21,000 instructions a call, most of
    the interrupt handling's (issue 66, item 11). The handler is read raw; the tests
    above show the chaining unchanged."""
    opt, step = _train_step()
    x, scale = jnp.ones((3, 4)), jnp.float32(1.0)
    model, opt_state, _, _ = step(_mlp(), opt.init(eqx.filter(_mlp(), eqx.is_array)), x, scale)
    read = []
    real = signal.getsignal
    monkeypatch.setattr(signal, "getsignal", lambda *a: read.append(a) or real(*a))
    model, opt_state, _, _ = step(model, opt_state, x, scale)
    assert model.layers[0].weight is step.last_outputs[0].layers[0].weight  # it donated
    assert read == []
    handler = signal.getsignal(signal.SIGINT)
    assert getattr(handler, "__name__", None) == "_handler"  # still in front


def test_a_donating_step_called_again_takes_the_fast_path(monkeypatch):
    """A donating step built its key every call (the fast path took only programs that
    donate nothing): 82k instructions a call over `jax.jit`'s on a tiny MLP. A structure
    called before now runs its entry without the key, holding Ctrl-C and keeping its
    outputs as the whole path does (issue 66, item 11)."""
    from offload_eqx._jit import dispatch

    whole_path = []
    real = dispatch._dispatch
    monkeypatch.setattr(
        dispatch, "_dispatch", lambda *a, **k: whole_path.append(1) or real(*a, **k)
    )
    opt, step = _train_step()
    x, scale = jnp.ones((3, 4)), jnp.float32(1.0)
    model, opt_state = _mlp(), opt.init(eqx.filter(_mlp(), eqx.is_array))
    copies = jax.tree.map(lambda a: jnp.copy(a) if eqx.is_array(a) else a, (model, opt_state))
    for _ in range(3):
        first = model.layers[0].weight
        model, opt_state, loss, _ = step(model, opt_state, x, scale)
        assert first.is_deleted()  # donated, on either path
    assert len(whole_path) == 1
    kept = step.last_outputs
    assert kept[0].layers[0].weight is model.layers[0].weight and kept[2] is loss
    reference = ox.filter_jit(step.fn)  # donates nothing: the same steps on the copies
    expected = copies
    for _ in range(3):
        expected = reference(*expected, x, scale)[:2]
    arrays = eqx.filter((model, opt_state), eqx.is_array)
    for got, want in zip(
        jax.tree.leaves(arrays), jax.tree.leaves(eqx.filter(expected, eqx.is_array))
    ):
        np.testing.assert_allclose(got, want, rtol=1e-6)
