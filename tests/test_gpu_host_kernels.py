"""Our host kernel on the GPU's host (`_host/kernels/gpu_host.py`): registered with the
CUDA plugin's own XLA:CPU once a child process has proven that a compile calling it does
not abort, used by the deviceless h100 compile of a masters host update (delayed and
not), and where the proof fails or the kernel is off, never relied on. Every compile that
could abort runs in a process of its own."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

_H100_UPDATE = textwrap.dedent(
    """
    import json, sys
    import equinox as eqx, jax, jax.numpy as jnp, optax
    import offload_eqx as ox
    from offload_eqx._inspect.memory_report import compiled_report
    from offload_eqx._targets.deviceless import program_of_step
    from offload_eqx._targets.targets import get_target

    class Block(eqx.Module):
        w_in: jax.Array = ox.field(memory="pinned_host")
        w_out: jax.Array = ox.field(memory="pinned_host")
        def __call__(self, x):
            h = ox.name(jax.nn.gelu(x @ self.w_in), "h")
            return x + h @ self.w_out

    class Stack(eqx.Module):
        blocks: Block
        activations: ox.Activations = ox.activations(h="remat")
        def __call__(self, x):
            return ox.scan(self.blocks, x)

    def make(key, layers=4, d=256):
        k1, k2 = jax.random.split(key)
        w = lambda k, a, b: jax.random.normal(k, (layers, a, b), jnp.bfloat16) * a**-0.5
        return Stack(Block(w(k1, d, 4 * d), w(k2, 4 * d, d)))

    found = {}
    for delay in (0, 1):
        opt = ox.offload_optimizer(
            optax.adamw(1e-4), update_on="host", master_dtype=jnp.float32, delay=delay
        )
        def train_step(model, opt_state, x):
            loss = lambda m: jnp.mean(m(x).astype(jnp.float32) ** 2)
            grads = eqx.filter_grad(loss)(model)
            return ox.update_and_apply(opt, grads, opt_state, model)
        model = eqx.filter_eval_shape(make, jax.random.key(0))
        state = eqx.filter_eval_shape(opt.init, model)
        x = jax.ShapeDtypeStruct((64, 256), jnp.bfloat16)
        step = ox.filter_jit(train_step, strategy="hybrid", donate="all")
        args = (model, state, x)
        report = ox.memory_report(step, *args, target="h100")
        _, compiled = compiled_report(program_of_step(step, args, {}), get_target("h100"), "s")
        found[delay] = {
            "calls": compiled.as_text().count('custom_call_target="offload_eqx_adamw"'),
            "host": dict(report.host),
            "host_total": report.host_total,
        }
    found["kernels"] = ox.host_kernels()
    print(json.dumps(found))
    """
)


def _verdict_with_child(child: str) -> str:
    """`_VERDICT` with the proof's child replaced by the code `child`."""
    return _VERDICT.replace("CHILD", repr(child))


def _run(code: str, **env: str) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "JAX_PLATFORMS": "cpu", **env},
    )
    assert done.returncode == 0, (done.returncode, done.stdout[-2000:], done.stderr[-3000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.deviceless
def test_the_h100_masters_host_update_calls_the_kernel_delayed_or_not():
    """The optimized h100 program's host computation calls `offload_eqx_adamw` once per
    weight (in the delayed update, inside the loop over its slices), and the process
    lives. Delayed, every host argument is donated and the state is written over in
    slices: beside it the host holds the step's new gradients (the pending ones are
    read while the backward pass sends them) and the weights the forward and backward
    passes read while the update writes their new values (2 + 2 bytes beside 16 a
    parameter: 1.25x; measured 8.5 MiB beside 32, 1.27x, where one host call held two
    copies: 2x)."""
    found = _run(_H100_UPDATE)
    assert found["kernels"]["adamw on the GPU's host"].startswith("registered"), found
    for delay in ("0", "1"):
        assert found[delay]["calls"] == 2, found
    delayed = found["1"]["host"]
    assert delayed["alias"] == delayed["argument"], delayed
    assert found["1"]["host_total"] <= 1.27 * delayed["argument"], found


@pytest.mark.deviceless
def test_switched_off_the_gpus_host_runs_the_update_as_xla_compiles_it():
    found = _run(_H100_UPDATE, OFFLOAD_EQX_HOST_KERNELS="0")
    assert found["0"]["calls"] == 0 and found["1"]["calls"] == 0, found
    assert "unavailable" in found["kernels"]["adamw on the GPU's host"], found


_VERDICT = textwrap.dedent(
    """
    import json, sys
    from offload_eqx._host.kernels import gpu_host
    gpu_host._proof_command = lambda name: [sys.executable, "-c", CHILD]
    print(json.dumps({"target": gpu_host.target("adamw"), "kernels": gpu_host.host_kernels()}))
    """
)


def test_a_proof_that_aborts_leaves_the_kernel_off_the_gpus_host_and_says_why(tmp_path):
    """The child that would abort in the real plugin's compile is read as a refusal,
    cached (the next process does not try again), and nothing is registered."""
    aborts = _verdict_with_child("import os; os.abort()")
    found = _run(aborts, XDG_CACHE_HOME=str(tmp_path))
    assert found["target"] is None, found
    why = found["kernels"]["adamw on the GPU's host"]
    assert "killed the proof's process (signal 6" in why, why
    cached = json.loads((tmp_path / "offload_eqx" / "gpu_host_kernels.json").read_text())
    assert [v["ok"] for v in cached.values()] == [False], cached
    # Cached: a second process does not run the child (it would succeed this time).
    succeeds = _verdict_with_child("import json; print(json.dumps({'ok': True, 'why': ''}))")
    again = _run(succeeds, XDG_CACHE_HOME=str(tmp_path))
    assert again["target"] is None, again


def test_a_child_that_fails_is_not_cached_and_a_success_registers(tmp_path):
    failing = _verdict_with_child("raise SystemExit('no topology here')")
    found = _run(failing, XDG_CACHE_HOME=str(tmp_path))
    assert "its proof failed: no topology here" in found["kernels"]["adamw on the GPU's host"]
    assert not (tmp_path / "offload_eqx" / "gpu_host_kernels.json").exists()


def test_a_verdict_that_cannot_be_kept_is_reported(tmp_path):
    """A folder at the verdict file's path is left as it is and said, beside the
    verdict (each process then proves the kernel again)."""
    folder = tmp_path / "offload_eqx" / "gpu_host_kernels.json"
    folder.mkdir(parents=True)
    folder.parent.chmod(0o700)
    found = _run(_verdict_with_child("import os; os.abort()"), XDG_CACHE_HOME=str(tmp_path))
    why = found["kernels"]["adamw on the GPU's host"]
    assert why.startswith("unavailable: a compile calling it killed the proof's process"), why
    assert f"its verdict is not kept for other processes: {folder} is a folder" in why, why
    assert folder.is_dir() and os.listdir(folder.parent) == [folder.name]


@pytest.mark.deviceless
def test_a_plan_that_moves_the_update_to_the_gpu_runs_it_as_xla_compiles_it():
    """`update="device"` (a plan `ox.fit` tries) traces the masters update as device
    code: the kernel is registered for the GPU's host only, so it is not called there
    (the compile failed: "No FFI handler registered for offload_eqx_adamw on a platform
    CUDA")."""
    import equinox as eqx
    import jax.numpy as jnp
    import optax

    import offload_eqx as ox

    opt = ox.offload_optimizer(optax.adamw(1e-3), update_on="host", master_dtype=jnp.float32)
    model = eqx.filter_eval_shape(
        lambda: {"w": jnp.zeros((256, 256), jnp.bfloat16), "b": jnp.zeros(256, jnp.bfloat16)}
    )
    state = eqx.filter_eval_shape(opt.init, model)
    on_device = ox.Strategy("device update", params="device", optimizer="device", update="device")

    @ox.filter_jit(strategy=on_device, donate="all-except-first")
    def step(grads, model, state):
        return ox.update_and_apply(opt, grads, state, model)

    report = ox.memory_report(step, model, model, state, target="h100")
    assert report.device["argument"] > 0


@pytest.mark.deviceless
def test_the_h100_host_update_is_priced_as_the_kernel_moves_bytes():
    """With the kernel in the h100 program's host computation, the simulated host time is
    28 bytes a parameter at the h100 host's update bandwidth (the count, traced for the
    target's platform, says the same), where XLA's loops cost more."""
    import equinox as eqx
    import jax.numpy as jnp
    import optax

    import offload_eqx as ox
    from offload_eqx._planning.host_work import host_computation_bandwidth

    opt = ox.offload_optimizer(optax.adamw(1e-3), update_on="host", master_dtype=jnp.float32)
    n = 2048
    params = eqx.filter_eval_shape(lambda: {"w": jnp.ones((n, n), jnp.bfloat16)})
    state = eqx.filter_eval_shape(opt.init, params)
    step = ox.filter_jit(
        lambda g, p, s: ox.update_and_apply(opt, g, s, p), donate="all-except-first"
    )
    estimate = ox.estimate(step, params, params, state, target="h100")
    speeds = ox.TARGETS["h100"].speeds
    assert speeds is not None and estimate.simulation is not None
    kernel = 28 * n * n / host_computation_bandwidth(speeds)
    assert kernel <= estimate.simulation.busy["host"] <= 1.2 * kernel, estimate.simulation.busy
    assert estimate.traced_seconds is not None
    assert kernel <= estimate.traced_seconds <= 1.3 * kernel  # and the rest of the step


@pytest.mark.deviceless
def test_the_count_is_of_the_program_traced_for_the_target():
    """`ox.estimate`'s jaxpr count walks the program the target compiles: for the h100,
    one kernel call per leaf in the host computation (the CPU's: one for all)."""
    import equinox as eqx
    import jax.extend as jex
    import jax.numpy as jnp
    import optax

    import offload_eqx as ox
    from offload_eqx._planning.traced_time import trace_costs
    from offload_eqx._targets.targets import get_target

    opt = ox.offload_optimizer(optax.adamw(1e-3), update_on="host", master_dtype=jnp.float32)
    shapes = {"w": jnp.ones((64, 64), jnp.bfloat16), "v": jnp.ones((64, 32), jnp.bfloat16)}
    params = eqx.filter_eval_shape(lambda: shapes)
    state = eqx.filter_eval_shape(opt.init, params)
    step = ox.filter_jit(
        lambda g, p, s: ox.update_and_apply(opt, g, s, p), donate="all-except-first"
    )

    def calls(jaxpr) -> int:
        found = 0
        for eqn in jaxpr.eqns:
            found += eqn.params.get("target_name") == "offload_eqx_adamw"
            for sub in jex.core.jaxprs_in_params(eqn.params):
                found += calls(getattr(sub, "jaxpr", sub))
        return found

    def kernel_calls(target: str) -> int:
        return calls(trace_costs(step, (params, params, state), {}, get_target(target)).jaxpr)

    assert kernel_calls("h100") == 2
    assert kernel_calls("cpu") == 1
