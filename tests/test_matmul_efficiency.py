"""A matmul's price from its shape (issue 67): the H100's table of efficiency by (M, N, K,
dtype) (tile and wave quantization, anchored at 0.73 of peak measured for 12288^3 bf16),
the one function both of `ox.estimate`'s pricers ask, and `efficiency=...` giving back
the constant every matmul was priced at before."""

import dataclasses
import json
import pathlib
import sys

import jax
import jax.numpy as jnp
import pytest

import offload_eqx as ox
from offload_eqx._targets.matmul_efficiency import H100_MATMUL, MATMUL_SHAPES

S = jax.ShapeDtypeStruct
BF16 = jnp.bfloat16
BENCHMARKS = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"


def _h100() -> ox.Speeds:
    speeds = ox.TARGETS["h100"].speeds
    assert speeds is not None
    return speeds


def _square(size: int, dtype=BF16) -> float:
    return ox.matmul_efficiency(_h100(), size, size, size, dtype)


# -- the table ---------------------------------------------------------------------------


def test_square_gemms_rise_with_size_to_the_measured_fraction():
    sizes = [256, 512, 1024, 2048, 4096, 8192, 12288]
    efficiencies = [_square(s) for s in sizes]
    assert efficiencies == sorted(efficiencies)
    assert efficiencies[0] < 0.02  # 2 tiles of 132 SMs' wave, each mostly padding
    # 12288^3 fills 4608 of its 35 waves' 4620 tile-slots: the measured 0.73 itself.
    assert efficiencies[-1] == pytest.approx(0.73 * 4608 / 4620)


def test_a_partial_wave_costs_what_the_guide_says():
    """Wave quantization (NVIDIA's Matrix Multiplication Background guide, 3.2): 132 tiles
    fill one wave of the H100's 132 SMs; one tile more needs a second wave, nearly empty."""
    full = ox.matmul_efficiency(_h100(), 128 * 132, 256, 4096, BF16)
    over = ox.matmul_efficiency(_h100(), 128 * 133, 256, 4096, BF16)
    assert full == pytest.approx(0.73)
    assert over == pytest.approx(0.73 * 133 / 264)
    # Tile quantization (3.1): a row past a whole tile pads a row of tiles.
    assert ox.matmul_efficiency(_h100(), 128 * 132 + 1, 256, 4096, BF16) < over
    # K does not enter the fraction (the roofline prices a short K's bytes).
    assert ox.matmul_efficiency(_h100(), 4096, 4096, 64, BF16) == _square(4096)


def test_big_gemms_price_above_the_old_constant_and_small_ones_below():
    assert _h100().efficiency == 0.5
    for size in (2048, 4096, 8192, 12288):
        assert _square(size) > 0.5, size
    for size in (256, 512, 1024):
        assert _square(size) < 0.5, size
    # A batch of small products fills the SMs as one large one does.
    assert ox.matmul_efficiency(_h100(), 512, 512, 512, BF16, batch=132 // 8) > 0.5


def test_float32_runs_at_the_tf32_rate_and_dtype_names_agree():
    assert _square(4096, jnp.float32) == pytest.approx(_square(4096) / 2)
    assert H100_MATMUL(4096, 4096, 4096, "bf16") == _square(4096)  # HLO's name
    assert H100_MATMUL(4096, 4096, 4096, "float8_e4m3fn") == _square(4096)  # unnamed: 1


def test_which_targets_have_a_table():
    with_table = {name for name, t in ox.TARGETS.items() if t.speeds and t.speeds.matmul_efficiency}
    assert with_table == {"h100", "h100-8", "gh200"}
    assert ox.TARGETS["gh200"].speeds.matmul_efficiency is H100_MATMUL  # type: ignore[union-attr]
    assert ox.matmul_efficiency(ox.TARGETS["tpu-v5p"].speeds, 8192, 8192, 8192, BF16) == 0.55  # type: ignore[arg-type]


def test_speeds_with_a_table_hash_print_and_serialise():
    speeds = _h100()
    assert hash(speeds) == hash(dataclasses.replace(speeds))
    assert "MatmulEfficiency(large=0.73, tile=(128, 256), units=132" in repr(speeds)
    assert json.loads(json.dumps(dataclasses.asdict(speeds)))["matmul_efficiency"]["units"] == 132


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: ox.MatmulEfficiency(1.5, (128, 256), 132), r"MatmulEfficiency\(large=1\.5\)"),
        (lambda: ox.MatmulEfficiency(0.0, (128, 256), 132), r"MatmulEfficiency\(large=0\.0\)"),
        (lambda: ox.MatmulEfficiency(0.7, (128, -256), 132), r"tile=\(128, -256\)\).*two whole"),
        (lambda: ox.MatmulEfficiency(0.7, (0, 256), 132), r"tile=\(0, 256\)\)"),
        (lambda: ox.MatmulEfficiency(0.7, (128, 256), 0), r"units=0\).*132 for an H100"),
        (lambda: ox.MatmulEfficiency(0.7, (128, 256), -132), r"units=-132\)"),
        (
            lambda: ox.MatmulEfficiency(0.7, (128, 256), 132, (("float32", 2.0),)),
            r"dtype_rates=\(\('float32', 2\.0\),\)\).*\(0, 1\]",
        ),
    ],
)
def test_bad_table_inputs_name_the_field_and_the_value(make, match):
    with pytest.raises(ValueError, match=match):
        make()


# -- the estimate ------------------------------------------------------------------------


def _small_step():
    def loss(w1, w2, x):
        return jnp.sum(jnp.tanh(x @ w1) @ w2)

    step = ox.filter_jit(jax.grad(loss, argnums=(0, 1)))
    return step, (S((256, 512), BF16), S((512, 128), BF16), S((64, 256), BF16))


# `ox.estimate(step, *args, target="h100")` of `_small_step` before the table (commit
# 3ac81c6, every matmul at 0.5 of peak), jaxpr count and compiled simulation, by the
# JAX that traced it (its jaxpr of `tanh`'s gradient differs).
BEFORE_TRACED = {"0.10.2": 5.624358208955224e-07, "0.12.0.1": 5.233098507462687e-07}
BEFORE_COMPILED = 9.241208358208955e-06


def _before_traced(constant: ox.StepEstimate) -> float:
    """The pinned count of before for this JAX, or (another JAX) the constant path's."""
    step, args = _small_step()
    plain = dataclasses.replace(_h100(), matmul_efficiency=None)
    target = dataclasses.replace(ox.TARGETS["h100"], name="h100-constant", speeds=plain)
    again = ox.estimate(step, *args, target=target, compile=False).seconds
    assert constant.traced_seconds == pytest.approx(again, rel=1e-12)
    return BEFORE_TRACED.get(jax.__version__, again)


def test_efficiency_by_hand_reproduces_the_constant_pricing_of_before():
    step, args = _small_step()
    traced = ox.estimate(step, *args, target="h100", compile=False)
    constant = traced.with_speeds(efficiency=0.5)
    assert constant.speeds.matmul_efficiency is None
    assert constant.seconds == pytest.approx(_before_traced(constant), rel=1e-12)
    assert traced.seconds > 2 * constant.seconds  # small matmuls: priced slower by shape


@pytest.mark.deviceless
def test_efficiency_by_hand_reproduces_the_compiled_constant_pricing_of_before():
    step, args = _small_step()
    compiled = ox.estimate(step, *args, target="h100")
    constant = compiled.with_speeds(efficiency=0.5)
    assert constant.seconds == pytest.approx(BEFORE_COMPILED, rel=1e-12)
    assert constant.traced_seconds == pytest.approx(_before_traced(constant), rel=1e-12)
    assert compiled.seconds > constant.seconds
    # The same as a target whose speeds never had a table.
    plain = dataclasses.replace(_h100(), matmul_efficiency=None)
    target = dataclasses.replace(ox.TARGETS["h100"], name="h100-constant", speeds=plain)
    assert ox.estimate(step, *args, target=target).seconds == pytest.approx(
        constant.seconds, rel=1e-12
    )


@pytest.mark.deviceless
def test_both_pricers_price_a_dot_at_the_same_efficiency():
    """One 4096^3 bf16 product, compute-bound: the jaxpr count's time and the compiled
    simulation's kernel (less its launch) are its FLOPs at the efficiency of its shape."""
    x = S((4096, 4096), BF16)
    estimate = ox.estimate(ox.filter_jit(lambda a, b: a @ b), x, x, target="h100")
    speeds = _h100()
    flops = 2.0 * 4096**3
    expected = flops / (speeds.flops * ox.matmul_efficiency(speeds, 4096, 4096, 4096, BF16))
    assert estimate.costs is not None
    assert estimate.costs.work["forward"].seconds == pytest.approx(expected, rel=1e-9)
    assert estimate.simulation is not None
    [gemm] = [e for e in estimate.simulation.events if e.flops]
    assert gemm.flops == flops
    assert gemm.end - gemm.start == pytest.approx(expected + speeds.kernel_launch, rel=1e-9)


# -- benchmarks/gpu_check.py's part ------------------------------------------------------


def test_the_gpu_check_matmul_part_runs_on_a_cpu():
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import _gpu_check_matmuls  # pyright: ignore[reportMissingImports]
    finally:
        sys.path.remove(str(BENCHMARKS))
    result = _gpu_check_matmuls.matmuls([(64, 64, 64), (128, 64, 32)], "h100", calls=2)
    assert [r["shape"] for r in result["rows"]] == [[64, 64, 64], [128, 64, 32]]
    for row in result["rows"]:
        m, n, k = row["shape"]
        assert row["predicted"] == ox.matmul_efficiency(_h100(), m, n, k, BF16)
        assert row["measured"] > 0 and row["seconds"] > 0
    assert result["peak_flops"] == _h100().flops
    assert len(MATMUL_SHAPES) >= 8


# -- the compiled text's dots ------------------------------------------------------------

# Round rates and a table of 1 SM with 128 x 256 tiles at 0.5, so each time is by hand.
ROUND = ox.Speeds(
    flops=1e12,
    efficiency=1.0,
    memory_bandwidth=1e15,
    h2d_bandwidth=1e9,
    d2h_bandwidth=1e9,
    host_flops=1e10,
    host_bandwidth=1e9,
    host_memory=2**34,
    matmul_efficiency=ox.MatmulEfficiency(0.5, (128, 256), 1, (("float32", 0.5),)),
)

CUBLAS = """HloModule m, is_scheduled=true

ENTRY %main (a: bf16[64,512], b: bf16[512,256]) -> bf16[64,256] {
  %a = bf16[64,512]{1,0} parameter(0)
  %b = bf16[512,256]{1,0} parameter(1)
  %gemm = (bf16[64,256]{1,0}, s8[4194304]{0}) custom-call(%a, %b), custom_call_target="__cublas$gemm", backend_config={"gemm_backend_config":{"alpha_real":1,"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"],"lhs_batch_dimensions":[],"rhs_batch_dimensions":[]}}}
  ROOT %out = bf16[64,256]{1,0} get-tuple-element(%gemm), index=0
}
"""

BATCHED = """HloModule m, is_scheduled=true

%two_dots (p0: f32[4,128,64], p1: f32[4,64,256], p2: bf16[256,512]) -> bf16[512,512] {
  %p0 = f32[4,128,64]{2,1,0} parameter(0)
  %p1 = f32[4,64,256]{2,1,0} parameter(1)
  %d0 = f32[4,128,256]{2,1,0} dot(%p0, %p1), lhs_batch_dims={0}, lhs_contracting_dims={2}, rhs_batch_dims={0}, rhs_contracting_dims={1}
  %r = bf16[512,256]{1,0} bitcast(%d0)
  %p2 = bf16[256,512]{1,0} parameter(2)
  ROOT %d1 = bf16[512,512]{1,0} dot(%r, %p2), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

ENTRY %main (a: f32[4,128,64], b: f32[4,64,256], c: bf16[256,512]) -> bf16[512,512] {
  %a = f32[4,128,64]{2,1,0} parameter(0)
  %b = f32[4,64,256]{2,1,0} parameter(1)
  %c = bf16[256,512]{1,0} parameter(2)
  ROOT %f = bf16[512,512]{1,0} fusion(%a, %b, %c), kind=kCustom, calls=%two_dots
}
"""


def test_a_cublas_call_is_priced_by_the_shape_in_its_backend_config():
    from offload_eqx._planning.schedule import simulate

    sim = simulate(CUBLAS, ROUND)
    flops = 2.0 * 64 * 256 * 512
    # 64 x 256 fills half of one 128 x 256 tile on the one SM: 0.5 x 0.5.
    assert ox.matmul_efficiency(ROUND, 64, 256, 512, "bf16") == 0.25
    assert sim.flops == flops
    assert sim.seconds == pytest.approx(flops / (1e12 * 0.25))


def test_each_dot_of_a_fusion_runs_at_its_own_shape_and_type():
    from offload_eqx._planning.schedule import simulate

    batched, plain = 2.0 * 4 * 128 * 256 * 64, 2.0 * 512 * 512 * 256
    # 4 float32 products of 128 x 256: 4 whole tiles, one SM, at TF32's half rate: 0.25;
    # 512 x 512 in bf16: 8 whole tiles: 0.5.
    assert ox.matmul_efficiency(ROUND, 128, 256, 64, "f32", batch=4) == 0.25
    expected = batched / (1e12 * 0.25) + plain / (1e12 * 0.5)
    assert simulate(BATCHED, ROUND).seconds == pytest.approx(expected)
    # Without the table, one constant: the pricing of before.
    constant = ROUND.replace(efficiency=1.0)
    assert constant.matmul_efficiency is None
    assert simulate(BATCHED, constant).seconds == pytest.approx((batched + plain) / 1e12)
