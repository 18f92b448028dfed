"""`ox.max_batch`: the search is exact on memory curves that are not lines, and on real
compiles the batch returned fits while the next one does not (CPU with a budget; an H100
without the hardware with `-m deviceless`)."""

import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import seed_model

import offload_eqx as ox
from offload_eqx._planning import max_batch as _max_batch
from offload_eqx._planning.max_batch import LARGEST_BATCH, _largest_fit

WIDTH = 64


def mlp_step():
    """A small MLP's gradient step and `make_args`: about 1.26 MiB at batch 1 on the CPU,
    growing by a few KiB per row (and faster past about 70 rows: not a line)."""
    model = eqx.nn.MLP(WIDTH, WIDTH, 256, 3, key=jax.random.key(0))

    @ox.filter_jit
    def loss_grad(model, x):
        return eqx.filter_grad(lambda m: jnp.sum(jax.vmap(m)(x)))(model)

    def make_args(batch):
        return model, jax.ShapeDtypeStruct((batch, WIDTH), jnp.float32)

    return loss_grad, make_args


def total_at(step, make_args, batch, target="cpu"):
    return ox.memory_report(step, *make_args(batch), target=target).total


# -- the search, on memory curves given as functions (no compiler) ----------------------

CURVES = {
    "line": lambda b: 10_000 + 300 * b,
    "line with wobble": lambda b: 10_000 + 300 * b + 50 * (b % 7),
    "convex": lambda b: 10_000 + b * b,
    "concave": lambda b: int(10_000 + 5_000 * math.sqrt(b)),
    "flat, then a line": lambda b: max(100_000, 100 * b),
    "steps of 8 rows": lambda b: 6_400 * ((b + 7) // 8),
    "a bend at 70": lambda b: 10_000 + 30 * b + (0 if b < 70 else 500 * (b - 70)),
    "refused past 90": lambda b: None if b > 90 else 50 * b,
}


def brute_force(curve, budget):
    batch = 1
    while (total := curve(batch)) is not None and total <= budget:
        batch += 1
    return batch - 1


@pytest.mark.parametrize("curve", list(CURVES))
@pytest.mark.parametrize("answer", [1, 5, 37, 200, 1000, 12345])
@pytest.mark.parametrize("start", [1, 16, 300])
def test_the_search_is_exact_whatever_the_curve(curve, answer, start):
    memory = CURVES[curve]
    budget = memory(answer) if memory(answer) is not None else 10**12
    probed = []

    def measure(batch):
        assert batch not in probed, f"batch {batch} measured twice"
        probed.append(batch)
        return memory(batch)

    low, high = _largest_fit(measure, budget, start)
    assert (low, high) == (brute_force(memory, budget), low + 1), probed
    # Never worse than bisecting up to the answer twice over, and never near the cap.
    assert len(probed) <= 2 * math.log2(max(low, start) + 2) + 8, probed
    assert max(probed) < 64 * (low + 1) + start


def test_a_line_takes_four_compiles():
    # Two to draw the line, one where it meets the budget, one past it.
    probed = []

    def measure(batch):
        probed.append(batch)
        return 1_000 + 30 * batch

    assert _largest_fit(measure, 1_000 + 30 * 97 + 29, 1) == (97, 98)
    assert probed == [1, 2, 97, 98]


# -- real compiles on the CPU, with a budget ---------------------------------------------


def test_the_batch_returned_fits_and_the_next_does_not():
    step, make_args = mlp_step()
    budget = total_at(step, make_args, 40) + 1_000
    lines, probes = [], []
    batch = ox.max_batch(
        step, make_args, target="cpu", device_budget=budget, progress=lines.append, probes=probes
    )
    assert total_at(step, make_args, batch) <= budget < total_at(step, make_args, batch + 1)
    assert batch >= 40
    batches = [p["batch"] for p in probes]
    assert batches[0] == 1 and len(set(batches)) == len(batches) <= 8
    assert {batch, batch + 1} <= set(batches)  # decided by compiles, not by the line
    assert all(p["fits"] == (p["total"] <= budget) for p in probes)
    assert all(isinstance(p["report"], ox.MemoryReport) for p in probes)
    assert len(lines) == len(probes)
    assert "batch 1:" in lines[0] and "fits" in lines[0]


def test_default_budget_is_the_targets_capacity():
    step, make_args = mlp_step()
    capacity = total_at(step, make_args, 20)
    target = ox.Target("cpu", "cpu", capacity=capacity)
    batch = ox.max_batch(step, make_args, target=target, start=16)
    assert total_at(step, make_args, batch) <= capacity < total_at(step, make_args, batch + 1)


def test_a_strategy_recompiles_the_step_under_it():
    def grad_step(model, x):
        return eqx.filter_grad(lambda m: jnp.sum(m(x)))(model)

    model = seed_model(2, WIDTH, 128, memory="device")

    def make_args(batch):
        return model, jax.ShapeDtypeStruct((batch, WIDTH), jnp.float32)

    baseline = ox.filter_jit(grad_step, strategy="baseline")
    budget = 600_000  # about 330 kB at batch 1
    without = ox.max_batch(baseline, make_args, target="cpu", device_budget=budget)
    remat = ox.max_batch(baseline, make_args, target="cpu", device_budget=budget, strategy="remat")
    # Recomputing the layers' activations instead of saving them fits a larger batch.
    assert remat > 1.5 * without
    rewrapped = ox.filter_jit(grad_step, strategy="remat")
    assert (
        total_at(rewrapped, make_args, remat) <= budget < total_at(rewrapped, make_args, remat + 1)
    )


def test_a_compile_refused_for_memory_is_a_misfit(monkeypatch):
    step, make_args = mlp_step()
    real = ox.memory_report

    def refusing(fn, *args, **kwargs):
        if args[1].shape[0] > 30:
            raise RuntimeError("RESOURCE_EXHAUSTED: Ran out of memory in memory space hbm.")
        return real(fn, *args, **kwargs)

    monkeypatch.setattr(_max_batch, "memory_report", refusing)
    probes = []
    batch = ox.max_batch(step, make_args, target="cpu", device_budget=10**9, probes=probes)
    assert batch == 30
    assert all(p["total"] is None and p["report"] is None for p in probes if p["batch"] > 30)


@pytest.mark.parametrize("integer", [np.int64, np.int32])
def test_numpy_integer_budgets_are_accepted(integer):
    step, make_args = mlp_step()
    budget = total_at(step, make_args, 40) + 1_000
    batch = ox.max_batch(
        step, make_args, target="cpu", device_budget=integer(budget), max_compiles=integer(12)
    )
    assert total_at(step, make_args, batch) <= budget < total_at(step, make_args, batch + 1)


def _fake_report(total):
    device = {"temp": total, "argument": 0, "output": 0, "alias": 0, "generated_code": 0}
    return ox.MemoryReport("step", "cpu", device=device, host=dict.fromkeys(device, 0))


def test_equal_totals_at_batches_of_other_shapes_are_searched_through(monkeypatch):
    # A peak set by something else (an optimizer update, say) until the activations pass
    # it: batches 1 to 1000 compile to the same total, and the answer is past them.
    def flat_then_line(fn, model, x, target):
        return _fake_report(max(1_000_000, 1_000 * x.shape[0]))

    monkeypatch.setattr(_max_batch, "memory_report", flat_then_line)
    step, make_args = mlp_step()
    assert ox.max_batch(step, make_args, target="cpu", device_budget=3_000_500) == 3_000


def test_make_args_that_ignores_the_batch_stops_after_two_compiles(monkeypatch):
    step, make_args = mlp_step()
    real = ox.memory_report
    compiled = []

    def counting(fn, *args, **kwargs):
        compiled.append(args[1].shape[0])
        return real(fn, *args, **kwargs)

    monkeypatch.setattr(_max_batch, "memory_report", counting)
    with pytest.raises(
        ValueError,
        match=r"`make_args` ignores the batch: `make_args\(1\)` and `make_args\(2\)` return "
        r"arguments of the same shapes.*the batch it was given does not reach the arguments",
    ):
        ox.max_batch(step, lambda batch: make_args(8), target="cpu", device_budget=10**9)
    assert compiled == [8, 8]


# -- errors ---------------------------------------------------------------------------------


def test_batch_one_too_large_names_the_bytes_and_the_budget():
    step, make_args = mlp_step()
    needs = total_at(step, make_args, 1)
    with pytest.raises(
        ValueError, match=rf"even at batch 1: .*\({needs} bytes\) on the device, budget 1000 B"
    ):
        ox.max_batch(step, make_args, target="cpu", device_budget=1000)


def test_cpu_needs_a_budget():
    step, make_args = mlp_step()
    with pytest.raises(ValueError, match="device memory of 'cpu' is unknown.*device_budget="):
        ox.max_batch(step, make_args, target="cpu")


def test_unknown_target():
    step, make_args = mlp_step()
    with pytest.raises(ValueError, match="Unknown target 'h200'; expected one of .*'h100'"):
        ox.max_batch(step, make_args, target="h200", device_budget=10**9)


@pytest.mark.parametrize(
    "options, error, match",
    [
        ({"device_budget": 0}, ValueError, r"device_budget=0\): expected a positive number"),
        ({"device_budget": True}, TypeError, r"device_budget=True\): expected an int"),
        ({"start": 0}, ValueError, r"start=0\): expected a positive int"),
        ({"start": True}, TypeError, r"start=True\): expected a positive int"),
        ({"max_compiles": 0}, ValueError, r"max_compiles=0\)"),
        ({"start": LARGEST_BATCH + 1}, ValueError, "the search stops at batch 1048576"),
    ],
)
def test_bad_options(options, error, match):
    step, make_args = mlp_step()
    options = {"device_budget": 10**9, **options}
    with pytest.raises(error, match=match):
        ox.max_batch(step, make_args, target="cpu", **options)


def test_make_args_must_return_a_tuple():
    step, make_args = mlp_step()
    with pytest.raises(TypeError, match=r"`make_args\(1\)` returned a list; expected a tuple"):
        ox.max_batch(
            step,
            lambda b: list(make_args(b)),  # pyright: ignore[reportArgumentType]
            target="cpu",
            device_budget=10**9,
        )


def test_a_strategy_needs_a_filter_jit_step():
    _, make_args = mlp_step()
    with pytest.raises(TypeError, match=r"strategy='remat'.*ox.max_batch\(ox.filter_jit\(step\)"):
        ox.max_batch(lambda m, x: x, make_args, target="cpu", device_budget=10**9, strategy="remat")


def test_running_out_of_compiles_says_what_is_known():
    step, make_args = mlp_step()
    budget = total_at(step, make_args, 40)
    with pytest.raises(RuntimeError, match=r"3 compiles .*: batch \d+ fits and .*Probes .*: 1: "):
        ox.max_batch(step, make_args, target="cpu", device_budget=budget, max_compiles=3)


def test_a_compile_error_names_the_batch():
    step, make_args = mlp_step()

    def make_bad_args(batch):
        model, x = make_args(batch)
        # A wrong width from batch 3 on: the step cannot trace there.
        return model, jax.ShapeDtypeStruct((batch, WIDTH + (batch >= 3)), jnp.float32)

    budget = total_at(step, make_args, 40)
    with pytest.raises(RuntimeError, match=r"at batch \d+ failed for a reason other than memory"):
        ox.max_batch(step, make_bad_args, target="cpu", device_budget=budget)
    try:
        ox.max_batch(step, make_bad_args, target="cpu", device_budget=budget)
    except RuntimeError as error:
        assert error.__cause__ is not None and "memory" not in str(error.__cause__).lower()


def test_a_budget_no_batch_reaches_stops_at_the_cap():
    step, make_args = mlp_step()
    with pytest.raises(RuntimeError, match="still fits 'cpu' at batch 1048576"):
        ox.max_batch(step, make_args, target="cpu", device_budget=10**15)


# -- an H100 without the hardware ---------------------------------------------------------------


@pytest.mark.deviceless
def test_h100_batch_returned_fits_and_the_next_does_not():
    pytest.importorskip("jax_plugins.xla_cuda12", reason="needs the 'cuda' extra")
    step, make_args = mlp_step()
    budget = 8_000_000  # about 600 rows
    probes = []
    batch = ox.max_batch(step, make_args, target="h100", device_budget=budget, probes=probes)
    assert total_at(step, make_args, batch, "h100") <= budget
    assert total_at(step, make_args, batch + 1, "h100") > budget
    assert len(probes) <= 10
    assert all(p["report"].target == "h100" for p in probes)


# -- within the host's memory too -------------------------------------------------------


def _fake_reports(device_per_row, host_per_row, host_base):
    def report(fn, model, x, target):
        rows = x.shape[0]
        device = {"temp": device_per_row * rows, "argument": 0, "output": 0, "alias": 0}
        host = {"temp": host_base + host_per_row * rows, "argument": 0, "output": 0, "alias": 0}
        return ox.MemoryReport("step", "cpu", device={**device, "generated_code": 0},
                               host={**host, "generated_code": 0})  # fmt: skip

    return report


@pytest.mark.parametrize("host_budget, answer", [(60_000, 10), (59_999, 9), (10**9, 1_000)])
def test_the_batch_fits_the_host_budget_as_well_as_the_devices(monkeypatch, host_budget, answer):
    """Device 1,000 bytes a row (budget 1e6: 1,000 rows), host 10,000 + 5,000 a row: the
    host binds first unless its budget is large; the answer is exact either way."""
    monkeypatch.setattr(_max_batch, "memory_report", _fake_reports(1_000, 5_000, 10_000))
    step, make_args = mlp_step()
    probes, lines = [], []
    batch = ox.max_batch(
        step, make_args, target="cpu", device_budget=10**6, host_budget=host_budget,
        probes=probes, progress=lines.append,
    )  # fmt: skip
    assert batch == answer
    by_batch = {p["batch"]: p for p in probes}
    assert by_batch[answer]["fits"] and not by_batch[answer + 1]["fits"]
    assert by_batch[answer]["host_total"] == 10_000 + 5_000 * answer
    assert all("host" in line for line in lines)


def test_batch_one_over_the_host_budget_names_the_host_bytes(monkeypatch):
    monkeypatch.setattr(_max_batch, "memory_report", _fake_reports(1_000, 5_000, 10_000))
    step, make_args = mlp_step()
    with pytest.raises(ValueError, match=r"even at batch 1.*14\.65 KiB \(15000 bytes\) in host memory, host budget 0 bytes.*host_budget"):  # fmt: skip
        ox.max_batch(step, make_args, target="cpu", device_budget=10**6, host_budget=0)


def test_the_default_host_budget_is_the_targets_host_memory_per_device():
    from offload_eqx._planning.batch_budgets import host_limit_of

    h100 = ox.TARGETS["h100"]
    assert h100.speeds is not None
    assert host_limit_of(h100, None) == h100.speeds.host_memory
    assert host_limit_of(h100, 123) == 123
    assert host_limit_of(ox.TARGETS["cpu"], None) is None  # the CPU's host is its device
