"""XLA:GPU's own rematerialization: host memory is not charged to the device's limit
(`_host/remat_limit.py`), a program over the limit is still rematerialized down to it,
and the memory report lists the clones XLA added with their FLOPs
(`_inspect/recomputed.py`). Deviceless compiles for an H100 whose description gives it a
small memory, so that a few MiB decide."""

import pathlib
import re
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
import pytest
from jax.ad_checkpoint import checkpoint_name

import offload_eqx as ox
from offload_eqx._host import compute
from offload_eqx._host.remat_limit import SLOP_OPTION, charged_host_bytes, remat_limit_options

pytestmark = pytest.mark.deviceless

S = jax.ShapeDtypeStruct
MiB = 2**20
L, D, F, B = 8, 256, 1024, 512  # 8 scanned layers of 256x1024 and 1024x256, float32


def small_h100(tmp_path: pathlib.Path, mib: int) -> ox.Target:
    """An H100 whose description (what the compiler reads) and capacity are `mib` MiB."""
    shipped = pathlib.Path(ox.__file__).parent / "_targets" / "configs" / "h100.txtpb"
    text = re.sub(
        r"device_memory_size:\s*\d+", f"device_memory_size: {mib * MiB}", shipped.read_text()
    )
    path = tmp_path / f"h100-{mib}.txtpb"
    path.write_text(text)
    return ox.Target(f"h100-{mib}", "cuda", "1x1x1", str(path), capacity=mib * MiB)


class MLP(eqx.Module):
    w1: Any
    w2: Any


def loss(model: MLP, x: jax.Array) -> jax.Array:
    def layer(h, weights):
        a, b = weights
        return jnp.tanh(jnp.tanh(h @ a) @ b), None

    h, _ = jax.lax.scan(layer, x, (model.w1, model.w2))
    return jnp.sum(h**2)


def host_update_step() -> tuple[Any, tuple]:
    """The step of the issue at small scale: parameters on the device, AdamW's moments on
    the host, updated there a step late (`delay=1`), beside the backward pass."""
    opt = ox.offload_optimizer(optax.adamw(1e-3), update_on="host", delay=1)

    @ox.filter_jit(donate="all-except-first")
    def step(x, model, state):
        return ox.update_and_apply(opt, jax.grad(loss)(model, x), state, model)

    model = MLP(S((L, D, F), jnp.float32), S((L, F, D), jnp.float32))
    return step, (S((B, D), jnp.float32), model, eqx.filter_eval_shape(opt.init, model))


def reused_matmul(x: jax.Array, w: jax.Array) -> jax.Array:
    """`x @ w` read at the start and at the end: 16 MiB live across three more matmuls
    unless XLA recomputes it at the end."""
    a = x @ w
    h = jnp.tanh(a @ w)
    h = jnp.tanh(h @ w)
    h = jnp.tanh(h @ w)
    return jnp.sum(h * a)


REUSED = (S((4096, 1024), jnp.float32), S((1024, 1024), jnp.float32))
REUSED_FLOPS = 2 * 4096 * 1024 * 1024  # one recompute of `x @ w`


def test_host_state_no_longer_makes_xla_recompute_what_fits(tmp_path, monkeypatch):
    """120 MiB: the device needs 86 to 102 MiB of it (jax 0.12 to 0.10), the host holds
    48 MiB of state. XLA:GPU charged the host results to the device's limit and cloned
    work (16 clones on jax 0.10.2, 6 on 0.12.0.1); with the limit raised by those bytes
    it clones nothing, and the step still fits."""
    target = small_h100(tmp_path, 120)
    step, args = host_update_step()
    fixed = ox.memory_report(step, *args, target=target)
    assert fixed.fits and fixed.host["output"] > 0, fixed
    assert fixed.recomputed == (), fixed
    # The same compile with XLA's limit as it was: clones, and no byte saved by them.
    monkeypatch.setattr(compute, "remat_limit_options", lambda *a, **k: {})
    before = ox.memory_report(step, *args, target=target)
    assert len(before.recomputed) > 0 and before.fits, before


def test_a_program_that_fits_only_by_xla_recompute_still_fits(tmp_path):
    """64 MiB: `reused_matmul` needs 68 MiB as written; XLA recomputes `x @ w` and it
    needs 52. The device-only program gets no option from us; the same program beside a
    host result (the limit raised by its bytes) is rematerialized just the same."""
    target = small_h100(tmp_path, 64)
    alone = ox.memory_report(reused_matmul, *REUSED, target=target)
    assert alone.fits and alone.total < 60 * MiB, alone
    assert [c.flops for c in alone.recomputed] == [REUSED_FLOPS], alone.recomputed

    def beside_host_state(x, w, state):
        new = jax.jit(lambda s: s * 0.5, out_shardings=None)(state)
        return reused_matmul(x, w), jax.device_put(new, jax.memory.Space.Host)

    state = S((4 * MiB,), jnp.float32)  # 16 MiB
    with_host = ox.memory_report(
        beside_host_state,
        *REUSED,
        state,
        target=target,
        in_memory=(None, None, "pinned_host"),
        out_memory=(None, "pinned_host"),
    )
    assert with_host.fits and with_host.device["temp"] == alone.device["temp"], with_host
    assert [c.flops for c in with_host.recomputed] == [REUSED_FLOPS], with_host.recomputed


def test_memory_report_lists_xla_clones_with_their_flops(tmp_path):
    report = ox.memory_report(reused_matmul, *REUSED, target=small_h100(tmp_path, 64))
    (clone,) = report.recomputed
    assert ".remat" in clone.instruction and clone.op == "fusion (matmul)", clone
    assert clone.flops == REUSED_FLOPS and clone.runs == 1, clone
    assert "XLA recomputed 1 instruction on its own (1 fusion (matmul); 8.59 GFLOP a step" in str(
        report
    )
    assert report.as_dict()["recomputed"] == [clone.as_dict()]
    roomy = ox.memory_report(reused_matmul, *REUSED, target="h100")
    assert roomy.recomputed == () and "recomputed" not in str(roomy)


def _host_program(host_mib: int) -> Any:
    def f(x, state):
        return jnp.sin(x), jax.device_put(state, jax.memory.Space.Host)

    state = jax.ShapeDtypeStruct((host_mib * MiB // 4,), jnp.float32)
    return jax.make_jaxpr(f)(jnp.zeros((256, 256), jnp.float32), state)


def test_the_slop_factor_adds_the_host_results_over_the_devices_room():
    """limit = (base - device inputs/outputs) * factor / 100, base 80% of the described
    memory: the factor adds 100 x host bytes / room, floored."""
    closed = _host_program(16)
    assert charged_host_bytes(closed) == 16 * MiB
    device_memory = 1000 * MiB
    room = device_memory * 80 // 100 - 256 * 256 * 4  # x in, sin(x) out (aliased: donated)
    options = remat_limit_options(closed, "cuda", device_memory, donated=(0,))
    assert options == {SLOP_OPTION: 95 + (100 * 16 * MiB) // room}
    assert remat_limit_options(closed, "tpu", device_memory) == {}
    assert remat_limit_options(closed, "cuda", 1 * MiB) == {}  # no room: XLA's own limit
    device_only = jax.make_jaxpr(jnp.sin)(jnp.zeros((256, 256), jnp.float32))
    assert remat_limit_options(device_only, "cuda", device_memory) == {}


def test_offloaded_activation_stacks_are_charged_host_bytes():
    """A scan's offloaded residuals are one host stack, live from the forward loop to the
    backward one: XLA's pass charges it, so the slop factor counts it."""
    policy = jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=[],
        names_which_can_be_offloaded=["x"],
        offload_src="device",
        offload_dst="pinned_host",
    )

    def loss(ws, h):
        def body(c, w):
            return jnp.tanh(checkpoint_name(jnp.sin(c @ w), "x")), None

        h, _ = jax.lax.scan(jax.checkpoint(body, policy=policy), h, ws)
        return jnp.sum(h)

    closed = jax.make_jaxpr(jax.grad(loss))(jnp.zeros((4, 64, 64)), jnp.zeros((8, 64)))
    assert charged_host_bytes(closed) == 4 * 8 * 64 * 4  # 4 layers' x, float32


class _Program:
    """What `within_capacity` reads of a compiled program: its device memory."""

    def __init__(self, temp: int):
        self.temp = temp

    def memory_analysis(self):
        return type("Stats", (), {"temp_size_in_bytes": self.temp})()


@pytest.mark.parametrize(
    ("first", "again", "capacity", "kept"),
    [
        (100, 90, 120, "first"),  # fits: compiled once
        (100, 90, 95, "again"),  # over; XLA's own factor needs less
        (100, 110, 95, "first"),  # over; XLA's own factor needs more
        (100, 90, None, "first"),  # capacity unknown
    ],
)
def test_a_raised_factor_never_costs_a_fit(first, again, capacity, kept):
    """The raised factor raises the scheduler's limit too, which may prefetch more: over
    the capacity, the program compiled with XLA's own factor is kept where it needs
    less, and the factor is set back explicitly (options given to a compile add to the
    jit's)."""
    from offload_eqx._host.remat_limit import SLOP_OPTION, default_slop, within_capacity

    programs = {"first": _Program(first), "again": _Program(again)}
    seen = []

    def recompile(options):
        seen.append(options)
        return programs["again"]

    options = {SLOP_OPTION: 401, "other": True}
    compiled, used = within_capacity(programs["first"], options, recompile, capacity)
    assert compiled is programs[kept]
    if kept == "again":
        assert used == {SLOP_OPTION: default_slop(), "other": True}
    else:
        assert used is options
    compiled_again = 0 if capacity is None or first <= capacity else 1
    assert seen == [{SLOP_OPTION: default_slop(), "other": True}] * compiled_again
    assert within_capacity(programs["first"], {"other": True}, recompile, 1)[0] is programs["first"]
