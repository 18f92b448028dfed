"""The runtime guard: `ox.no_implicit_transfers()` and `ox.filter_jit(audit=True)`.

Each implicit transfer is an error naming the offending leaf path; explicit transfers
stay allowed. Patterns that need two devices run in a subprocess.
"""

import os
import subprocess
import sys
import textwrap

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jaxtyping import Array, Float

import offload_eqx as ox
import offload_eqx._jit.guard as guard
from offload_eqx import ImplicitTransferError, no_implicit_transfers


class Layer(eqx.Module):
    w: Float[Array, "layers d d"] = ox.field(memory="pinned_host")

    def __call__(self, x: Float[Array, "n d"]) -> Float[Array, "n d"]:
        return jnp.tanh(ox.name(x, "h") @ self.w)


class Net(eqx.Module):
    layers: Layer
    activations: ox.Activations = ox.activations(h="offload")

    def __call__(self, x):
        return ox.scan(self.layers, x)


def make_net(layers: int = 3, d: int = 16) -> Net:
    w = jax.random.normal(jax.random.key(0), (layers, d, d)) * 0.1
    return Net(Layer(w))


def loss_fn(model: Net, x: Float[Array, "n d"]) -> Float[Array, ""]:
    return jnp.mean(model(x) ** 2)


OPT = ox.offload_optimizer(optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2)))


def make_step(strategy: str, audit: bool = True):
    @ox.filter_jit(strategy=strategy, audit=audit)
    def step(model, opt_state, x):
        loss, grads = eqx.filter_value_and_grad(loss_fn)(model, x)
        updates, opt_state = OPT.update(grads, opt_state, model)
        return ox.apply_updates(model, updates), opt_state, loss

    return step


# -- implicit uploads, each named by its leaf path --------------------------------------


def test_numpy_array_argument_is_named():
    step = make_step("annotated")
    model = ox.place(make_net())
    opt_state = OPT.init(model)
    x = np.ones((4, 16), np.float32)
    with pytest.raises(ImplicitTransferError, match=r"`x` is a numpy.ndarray \(float32\[4, 16\]\)"):
        step(model, opt_state, x)
    with pytest.raises(ImplicitTransferError, match=r"jax.device_put\(x\)"):
        step(model, opt_state, x)


def test_numpy_leaf_deep_in_optimizer_state_is_named():
    step = make_step("annotated")
    model = ox.place(make_net())
    opt_state = OPT.init(model)
    # A checkpoint restored with NumPy leaves: the upload happens on every step.
    opt_state = eqx.tree_at(
        lambda s: s.inner[1][0].mu.layers.w, opt_state, np.zeros((3, 16, 16), np.float32)
    )
    x = jnp.ones((4, 16))
    with pytest.raises(
        ImplicitTransferError, match=r"`opt_state\.inner\[1\]\[0\]\.mu\.layers\.w` is a numpy"
    ):
        step(model, opt_state, x)


def test_numpy_scalar_argument_is_named():
    @ox.filter_jit(audit=True)
    def scale(x, factor):
        return x * factor

    with pytest.raises(ImplicitTransferError, match=r"`factor` is a NumPy scalar \(float32"):
        scale(jnp.ones(3), np.float32(0.5))


def test_python_scalar_argument_of_jax_jit_is_named():
    f = jax.jit(lambda x, lr: x * lr)
    x = jnp.ones(3)
    with pytest.raises(ImplicitTransferError, match=r"`lr` is a Python float \(0.1\)"):
        with no_implicit_transfers([("x", x), ("lr", 0.1)]):
            f(x, 0.1)


def test_list_of_floats_is_named_leaf_by_leaf():
    f = jax.jit(lambda x, coeffs: x * coeffs[0] + coeffs[1])
    x = jnp.ones(3)
    coeffs = [0.5, 2.0]
    with pytest.raises(
        ImplicitTransferError, match=r"`coeffs\[0\]` is a Python float.*`coeffs\[1\]`"
    ):
        with no_implicit_transfers([("x", x), ("coeffs", coeffs)]):
            f(x, coeffs)


def test_eager_scalar_upload_in_the_training_loop_names_the_line():
    step = make_step("annotated")
    model = ox.place(make_net())
    opt_state = OPT.init(model)
    x = jnp.ones((4, 16))
    count = jnp.zeros((), jnp.int32)
    with pytest.raises(ImplicitTransferError, match=r"test_guard\.py:\d+ \(`count = count \+ 1`\)"):
        with no_implicit_transfers():
            for _ in range(2):
                model, opt_state, loss = step(model, opt_state, x)
                count = count + 1


def test_mistyped_argument_on_a_cached_call_is_named():
    """An array in pinned_host whose type says device (see `type_matches`)."""

    @ox.filter_jit(audit=True)
    def double(w):
        return w * 2.0

    w = jnp.ones(4)
    double(w)  # compiled for a device array
    host = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host")
    mistyped = jax.jit(lambda: jnp.ones(4), out_shardings=host)()
    assert mistyped.sharding.memory_kind == "pinned_host"
    with pytest.raises(ImplicitTransferError, match=r"Argument `w` is in 'pinned_host' memory"):
        double(mistyped)


# -- what stays allowed ---------------------------------------------------------------------


def test_explicit_transfers_are_allowed():
    net = make_net()
    with no_implicit_transfers():
        x = jax.device_put(np.ones(3, np.float32))
        host = jax.device_put(x, jax.memory.Space.Host)
        back = jax.device_put(host, jax.memory.Space.Device)
        model = ox.place(net)
        assert float(jnp.sum(back)) == 3.0  # device-to-host reads are allowed
    assert model.layers.w.sharding.memory_kind == "pinned_host"


@pytest.mark.parametrize("strategy", list(ox.STRATEGIES))
def test_no_false_alarm_on_any_strategy(strategy: str):
    step = make_step(strategy)
    model = ox.place(make_net(), strategy)
    opt_state = ox.place(OPT.init(model), strategy)
    x = jnp.ones((4, 16))
    with no_implicit_transfers():
        for _ in range(2):
            model, opt_state, loss = step(model, opt_state, x)
    assert np.isfinite(float(loss))


def test_unrelated_errors_pass_through():
    with pytest.raises(ZeroDivisionError):
        with no_implicit_transfers():
            _ = 1 / 0


# -- two devices: an array committed elsewhere (subprocess) ----------------------------------

_TWO_DEVICES = textwrap.dedent(
    """
    import jax, jax.numpy as jnp
    import offload_eqx as ox
    from offload_eqx import ImplicitTransferError, no_implicit_transfers

    d0, d1 = jax.devices()
    w = jax.device_put(jnp.ones((4, 4)), d0)
    x = jax.device_put(jnp.ones((2, 4)), d1)  # committed to the other device

    @ox.filter_jit(audit=True)
    def apply(w, x):
        return x @ w

    try:
        apply(w, x)
    except ImplicitTransferError as e:
        print("FILTER_JIT:", e)

    # jax.jit with explicit in_shardings reshards a committed argument: the guard sees a
    # device-to-device transfer, which we name.
    f = jax.jit(lambda w, x: x @ w, in_shardings=jax.sharding.SingleDeviceSharding(d0))
    try:
        with no_implicit_transfers():
            f(w, x)
    except ImplicitTransferError as e:
        print("RESHARD:", e)
    """
)


def test_array_committed_to_another_device_is_named():
    env = dict(
        os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu"
    )
    result = subprocess.run(
        [sys.executable, "-c", _TWO_DEVICES], capture_output=True, text=True, env=env, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert "FILTER_JIT: Implicit device-to-device transfer: `x` (float32[2,4]) is on cpu:1 " in (
        result.stdout
    ), result.stdout
    assert "RESHARD: Implicit device-to-device transfer" in result.stdout, result.stdout


# -- the pytest plugin: fixture and marker ------------------------------------------------------

_PLUGIN_TESTS = textwrap.dedent(
    """
    import jax.numpy as jnp
    import numpy as np
    import pytest
    import jax

    f = jax.jit(lambda x: x + 1)

    def test_fixture_catches(no_implicit_transfers):
        f(np.ones(3))

    @pytest.mark.no_implicit_transfers
    def test_marker_catches():
        jnp.ones(3) + 1

    @pytest.mark.no_implicit_transfers
    def test_marker_allows_explicit():
        f(jax.device_put(np.ones(3)))

    def test_unguarded_is_unchanged():
        f(np.ones(3))
    """
)


def test_pytest_fixture_and_marker(tmp_path):
    (tmp_path / "test_user.py").write_text(_PLUGIN_TESTS)
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "offload_eqx._pytest_plugin",
            "-p",
            "no:cacheprovider",
            "-o",
            "addopts=",
            str(tmp_path / "test_user.py"),
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=120,
    )
    out = result.stdout
    assert "2 failed, 2 passed" in out, out
    assert "FAILED test_user.py::test_fixture_catches" in out, out
    assert "FAILED test_user.py::test_marker_catches" in out, out
    assert "ImplicitTransferError" in out, out


def test_offenders_are_listed_without_running_anything():
    arguments = [("x", np.ones((2, 2), np.float32)), ("cfg", {"lr": 0.1, "w": jnp.ones(2)})]
    found = guard.upload_offenders(arguments)
    assert found == [
        "`x` is a numpy.ndarray (float32[2, 2])",
        "`cfg['lr']` is a Python float (0.1)",
    ]


def test_audit_refuses_misplaced_arguments_on_a_cached_step():
    from helpers import scanned_model

    model = scanned_model(jax.random.key(0))
    step = ox.filter_jit(lambda model, x: model(x), audit=True)
    x = jnp.ones((8, 16))
    step(model, x)  # first call: moved once, explicitly, to the planned pinned_host
    with pytest.raises(
        ImplicitTransferError,
        match=r"`model.layers.w1` is in 'device', planned 'pinned_host'.*ox.place",
    ):
        step(model, x)  # the same device-resident model again: would copy every call
    step(ox.place(model), x)  # placed once: fine


# -- JAX's transfer-guard text, recognised in one function -----------------------------------


def test_jax_transfer_guard_message_is_recognised():
    add_one = jax.jit(lambda x: x + 1)
    with pytest.raises(jax.errors.JaxRuntimeError) as info:
        with jax.transfer_guard("disallow"):
            add_one(np.ones((2, 3), np.float32))  # JAX's own error, not ours
    assert guard.blocked_transfer(info.value) == guard.GuardedTransfer(
        "host-to-device", "ShapedArray(float32[2,3])"
    )
    assert guard.blocked_transfer(jax.errors.JaxRuntimeError("INVALID_ARGUMENT: other")) is None
    # The same words in another exception type are not JAX's guard.
    assert guard.blocked_transfer(RuntimeError("Disallowed host-to-device transfer")) is None


def test_guard_errors_are_the_public_type():
    assert ox.ImplicitTransferError is ImplicitTransferError
    assert issubclass(ImplicitTransferError, RuntimeError)
