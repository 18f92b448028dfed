"""`ox.fit` against the real XLA:GPU compiler for an H100 (deviceless), on the planner
tests' decoder (`fit_problem`). The plans between all and nothing are in
`test_fit_between.py`: its fixture compiles for minutes, so it runs beside these."""

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
import pytest
from fit_problem import decoder, fixed_estimates_of, make_problem, step_of

import offload_eqx as ox

# One worker runs the file: its module fixtures compile for minutes each.
pytestmark = [pytest.mark.deviceless, pytest.mark.xdist_group("test_fit")]


@pytest.fixture(scope="module")
def problem():
    return make_problem()


def _step(problem, strategy):
    return step_of(problem, strategy)


@pytest.fixture(scope="module")
def fixed_estimates(problem):
    return fixed_estimates_of(problem)


def test_ample_budget_moves_nothing_and_answers_with_the_fastest_simulated_plan(problem):
    result = ox.fit(_step(problem, "annotated"), *problem[1], target="h100")
    assert result.estimate.h2d_bytes == result.estimate.d2h_bytes == 0
    assert (result.strategy.params, result.strategy.optimizer) == ("device", "device")
    assert result.compiles <= 12
    # The jaxpr count's best plan saves everything and recomputes nothing; it was
    # compiled, and so were the plans the count put just behind it. The answer is the
    # fastest of them by the compiled schedule (within 0.5%, the one the count ranks
    # first): at this size, where each kernel is a few microseconds, saving every
    # residual costs more kernels than recomputing most.
    simulated = {c.label: c.simulated_seconds for c in result.candidates if c.simulated_seconds}
    counted_best = min(
        (c for c in result.candidates if c.simulated_seconds), key=lambda c: c.seconds
    )
    assert counted_best.strategy.activations == "save" and counted_best.recompute_flops == 0
    assert len(simulated) >= 2
    (best,) = [c for c in result.candidates if c.status == "best"]
    assert best.simulated_seconds is not None
    assert best.simulated_seconds <= min(simulated.values()) * 1.005
    assert result.estimate.seconds == pytest.approx(best.simulated_seconds)
    assert result.strategy == best.strategy
    # The layers' input (the `ox.scan` carry, named in the layer) is searched like any
    # name: offloaded, it leaves the device (issue 51).
    assert not any("'block_input' is the carry" in note for note in result.notes)
    assert any(dict(c.strategy.names).get("block_input") == "offload" for c in result.candidates)
    # A part that cannot be searched is explained by its error's whole first sentence.
    for note in result.notes:
        if note.startswith("Not searched"):
            assert not note.endswith((" and.", " of it.", " the.")), note
    # The update on the host (state in host memory, only gradients and updates moving)
    # is priced like every other placement.
    host = [c for c in result.candidates if c.strategy.update == "host"]
    assert host and all(c.strategy.optimizer == "pinned_host" for c in host)
    assert all(c.seconds > 0 for c in host)


def test_tight_budget_fits_and_beats_every_fixed_strategy_that_fits(problem, fixed_estimates):
    baseline = fixed_estimates["baseline"].device_bytes
    least = min(e.device_bytes for e in fixed_estimates.values())
    budget = (baseline + least) // 2
    assert baseline > budget
    lines = []
    result = ox.fit(
        _step(problem, "baseline"), *problem[1], target="h100", device_budget=budget,
        progress=lines.append,
    )  # fmt: skip
    used = result.estimate.device_bytes
    assert used is not None and (budget is None or used <= budget)
    # What `ox.fit` returns is what `ox.filter_jit` compiles under its strategy.
    again = ox.estimate(_step(problem, result.strategy), *problem[1], target="h100")
    assert again.device_bytes == result.estimate.device_bytes
    # Answered from the compiled program, as `ox.estimate` does; searched by the count.
    assert again.seconds == pytest.approx(result.estimate.seconds)
    assert again.traced_seconds == pytest.approx(result.estimate.traced_seconds)
    for name, estimate in fixed_estimates.items():
        if estimate.device_bytes <= budget:
            assert result.estimate.traced_seconds <= estimate.traced_seconds * (1 + 1e-9), name
    assert lines and "compiled" in lines[-1] and "best so far" in lines[-1]
    assert sum(c.status == "best" for c in result.candidates) == 1
    assert "best" in result.table()


def test_impossible_budget_names_the_least_memory_found(problem, fixed_estimates):
    with pytest.raises(ValueError, match=r"no plan of this step fits 'h100'") as error:
        ox.fit(_step(problem, "baseline"), *problem[1], target="h100", device_budget=1024)
    # A measured memory, at most what the smallest fixed strategy needs, and its plan.
    message = str(error.value)
    assert "The least device memory found was" in message and "0 B (" not in message
    assert "by the plan remat[" in message or "by the plan save[" in message


def test_host_budget_rules_out_host_placements(problem, fixed_estimates):
    baseline = fixed_estimates["baseline"].device_bytes
    result = ox.fit(
        _step(problem, "baseline"), *problem[1], target="h100",
        device_budget=baseline // 2, host_budget=0,
    )  # fmt: skip
    assert result.estimate.host_bytes == 0
    assert (result.strategy.params, result.strategy.optimizer) == ("device", "device")
    assert "offload" not in dict(result.strategy.names).values()


def test_an_unsearched_part_is_explained_by_a_whole_sentence():
    from offload_eqx._fit.price import _first_sentence

    long = "Activation 'k' is declared 'offload' " + "and more " * 30 + "here. Then a fix."
    assert _first_sentence("Short one. Second.") == "Short one"
    cut = _first_sentence(long, limit=100)
    assert cut.endswith(" ...") and len(cut) <= 104 and "Then" not in cut
    assert _first_sentence(long) == long.split(". ")[0]


def test_an_optimizer_declared_on_the_host_is_searched_on_the_device_where_the_target_cannot():
    """An optimizer made with `update_on="host"` ran its update on the host under every
    plan `ox.fit` tried, and XLA:TPU refuses host computations: every compile failed and
    fit said "no plan fits" (issue 26, item 9). The search decides where the update runs."""
    tiny = decoder.Config("tiny", vocab=64, dim=32, ffn=64, layers=2, heads=2, seq=16)
    model, opt_state = decoder.abstract_state(tiny, "hybrid_host_update")
    tokens = jax.ShapeDtypeStruct((2, tiny.seq + 1), jnp.int32)
    step = decoder.make_step(decoder.make_optimizer(update_on="host"), "annotated")
    result = ox.fit(step, model, opt_state, tokens, target="tpu-v5p", max_compiles=2)
    assert result.strategy.update == "device"
    with pytest.raises(ValueError, match=r"target 'tpu-v5p' does not support"):
        ox.estimate(step, model, opt_state, tokens, target="tpu-v5p", compile=False)


def test_a_delayed_optimizer_is_searched_and_its_host_update_overlaps_the_step(problem):
    """The delay (`ox.offload_optimizer(..., delay=1)`) is the user's choice, since it
    changes the results; `ox.fit` searches where its update runs. The host update is the
    fastest simulated plan: its host computation applies the previous step's gradients
    while the device runs the loops. `ox.fit` finds it only if it compiles it (the jaxpr
    count ranks it behind every device update: it cannot see the optimizer's kernels
    leave the device, so the check by simulation tries the other update location
    first), and only if it compiles it as `ox.filter_jit` would, with XLA:GPU's
    latency-hiding scheduler (without, the host computation does not overlap and a
    device update wins). Either missing fails this test."""
    model, _, tokens = problem[1]
    optimizer = ox.offload_optimizer(optax.adamw(1e-3, weight_decay=0.01), delay=1)
    state = jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
        eqx.filter_eval_shape(optimizer.init, model),
    )
    args = (model, state, tokens)
    step = decoder.make_step(optimizer, "annotated")
    result = ox.fit(step, *args, target="h100", max_compiles=8)
    assert result.strategy.update == "host"
    sim = result.estimate.simulation
    assert sim is not None and sim.busy["host"] > 0
    assert sim.waited.get("host", 0.0) < 0.5 * sim.busy["host"]
    # It beats every plan updating on the device that was compiled and fits.
    device = [
        c.simulated_seconds
        for c in result.candidates
        if c.strategy.update == "device" and c.simulated_seconds and c.status == "fits"
    ]
    assert device and result.estimate.seconds < min(device)


class _Twelve(eqx.Module):
    """Twelve named activations in one region: 3^12 combinations under the remat base."""

    ws: jax.Array = ox.field(memory="device")
    activations: ox.Activations = ox.activations(**{f"a{i}": "save" for i in range(12)})

    def __call__(self, x):
        def body(x):
            for i in range(12):
                x = ox.name(jnp.tanh(x @ self.ws[i]), f"a{i}")
            return x

        return ox.checkpoint(body, x)


def test_twelve_names_are_searched_along_a_frontier_not_every_combination():
    """12 declared names made 1,062,888 candidates (76-106 s, +3.6 GiB); the candidates
    now grow with the names (issue 26, item 11)."""
    model = _Twelve(jax.ShapeDtypeStruct((12, 64, 64), jnp.float32))  # pyright: ignore[reportArgumentType]
    x = jax.ShapeDtypeStruct((32, 64), jnp.float32)

    @ox.filter_jit
    def step(model, x):
        return eqx.filter_grad(lambda m: jnp.sum(m(x)))(model)

    result = ox.fit(step, model, x, target="h100", max_compiles=2)
    assert len(result.candidates) <= 4 * (12 + 2)
    assert any("along a frontier" in note for note in result.notes)


def test_a_wrong_call_fails_before_the_cpu_is_measured(monkeypatch):
    from offload_eqx._planning import traced_time

    measured = []
    monkeypatch.setattr(traced_time, "cpu_speeds", lambda: measured.append(1))
    with pytest.raises(TypeError, match="missing 1 required positional argument: 'x'"):
        ox.fit(lambda w, x: jnp.sum(w @ x), jnp.ones((4, 4)), target="cpu", device_budget=2**30)
    assert not measured


def test_only_a_plain_scans_carry_is_left_out_of_the_search():
    """A block's output returned as a plain `jax.lax.scan`'s carry is kept by that scan
    whatever its policy; a layer's input named inside an `ox.scan` layer is not."""
    from jax.ad_checkpoint import checkpoint_name

    from offload_eqx._fit.space import named_values
    from offload_eqx._plan.remat_policy import OX_SCAN_SCOPE

    def plain(x):
        body = lambda c, _: (checkpoint_name(jnp.sin(c), "out"), None)  # noqa: E731
        return jax.lax.scan(body, x, length=3)[0]

    def ours(x):
        body = lambda c, _: (jnp.sin(checkpoint_name(c, "layer_in")), None)  # noqa: E731
        with jax.named_scope(OX_SCAN_SCOPE):
            return jax.lax.scan(body, x, length=3)[0]

    x = jnp.ones(4)
    assert named_values(jax.make_jaxpr(plain)(x).jaxpr)["out"].carry
    layer_in = named_values(jax.make_jaxpr(ours)(x).jaxpr)["layer_in"]
    assert not layer_in.carry and layer_in.bytes == 3 * 4 * 4
