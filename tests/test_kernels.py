"""Fused kernels priced by their work (`offload_eqx/_planning/fused.py`): cuDNN attention
and splash attention compiled deviceless and priced from their shapes and masks, a Pallas
kernel by the cost estimate it declares, and a kernel no rule prices named, not free.

Counts by hand: attention over `pairs` query-key pairs costs `2 pairs (D + Dv)` FLOPs
forward (`Q K^T`, `P V`) and `2 pairs (3 D + 2 Dv)` backward (`Q K^T` again, `dV`, `dP`,
`dQ`, `dK`). A causal mask over `n` tiles a side computes `n (n + 1) / 2` of the `n^2`.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import splash_step
from jax.experimental import pallas as pl

import offload_eqx as ox
from offload_eqx._planning.flops import count_work
from offload_eqx._planning.fused import causal_share
from offload_eqx._planning.hlo import parse_module
from offload_eqx._planning.schedule import simulate
from offload_eqx._targets.targets import TARGETS

S = jax.ShapeDtypeStruct
BF16 = jnp.bfloat16


def attention_bounds(batch, heads, length, head_dim):
    """[the causal count (half of the dense forward and backward, no recomputation), the
    dense count with the backward's recomputation]."""
    dense = batch * heads * length * length * head_dim
    return 0.5 * 12 * dense, 14 * dense


def cudnn_step(q, k, v):
    def loss(q, k, v):
        out = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
        return out.astype(jnp.float32).sum()

    return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)


def test_causal_share_counts_the_tiles_on_and_below_the_diagonal():
    assert causal_share(4096, 4096) == 33 / 64  # 32 tiles a side: 32 * 33 / 2 of 32 * 32
    assert causal_share(128, 128) == 1.0
    assert causal_share(512, 512, window=128) == 7 / 16  # the diagonal and the tile before it


@pytest.mark.deviceless
def test_cudnn_causal_attention_is_priced_by_its_tiles():
    batch, length, heads, dim = 1, 512, 2, 64
    q = S((batch, length, heads, dim), BF16)
    estimate = ox.estimate(ox.filter_jit(cudnn_step), q, q, q, target="h100")
    pairs = batch * heads * length * length * 10 / 16  # 4 tiles a side: 10 of 16
    forward, backward = 2 * pairs * (2 * dim), 2 * pairs * (5 * dim)
    assert estimate.simulation is not None
    assert estimate.simulation.flops == estimate.flops == forward + backward
    low, high = attention_bounds(batch, heads, length, dim)
    assert low <= estimate.flops <= high
    peak = TARGETS["h100"].speeds.flops  # type: ignore[union-attr]
    assert estimate.seconds >= estimate.flops / peak
    assert estimate.unpriced == () and not estimate.simulation.notes
    traced = ox.estimate(ox.filter_jit(cudnn_step), q, q, q, target="h100", compile=False)
    assert traced.flops == forward + backward
    assert traced.seconds >= traced.flops / peak


@pytest.mark.deviceless
def test_cudnn_workspaces_a_deviceless_compile_leaves_unsized_are_named():
    # cuDNN sizes a kernel's workspace only on a GPU: compiled without one, the forward
    # and backward attention kernels get `u8[0]`, which the reports say, not hide.
    q = S((1, 512, 2, 64), BF16)
    report = ox.memory_report(ox.filter_jit(cudnn_step), q, q, q, target="h100")
    (note,) = report.notes
    assert "2 cuDNN kernels" in note and "fmhaSoftmaxBackward x1" in note
    assert "unsized (u8[0])" in note and f"Note: {note}" in str(report)
    assert report.as_dict()["notes"] == [note]
    estimate = ox.estimate(ox.filter_jit(cudnn_step), q, q, q, target="h100")
    assert ("memory", note) in estimate.notes and f"Note (memory): {note}" in str(estimate)
    compared = ox.compare_memory({"attention": (ox.filter_jit(cudnn_step), (q, q, q))}, "h100")
    assert f"Note (attention, h100): {note}" in str(compared)
    plain = ox.memory_report(lambda q: q @ q.mT, q, target="h100")
    assert plain.notes == ()


@pytest.mark.deviceless
def test_cudnn_convolution_backward_kernels_cost_the_forward_convolution():
    # XLA:GPU compiles both gradients of a convolution to cuDNN custom calls carrying the
    # forward convolution's dimensions: each costs 2 x its output x 3 x 3 x 16 FLOPs, of
    # which the taps on the padding (1 of 32 rows and columns a side) are not run.
    image, kernel = S((2, 32, 32, 16), BF16), S((3, 3, 16, 8), BF16)

    def loss(x, k):
        numbers = ("NHWC", "HWIO", "NHWC")
        out = jax.lax.conv_general_dilated(x, k, (1, 1), "SAME", dimension_numbers=numbers)
        return out.astype(jnp.float32).sum()

    step = ox.filter_jit(jax.grad(loss, argnums=(0, 1)))
    estimate = ox.estimate(step, image, kernel, target="h100")
    forward = 2 * (2 * 32 * 32 * 8) * (3 * 3 * 16)
    assert estimate.flops == 2 * forward
    assert estimate.simulation is not None
    assert estimate.simulation.flops == pytest.approx(2 * forward * (94 / 96) ** 2)


def test_cudnn_attention_counts_every_query_head_of_grouped_queries():
    # 4 query heads over 1 key/value head, no mask: every pair of every query head.
    q, kv = S((2, 128, 4, 32), BF16), S((2, 256, 1, 32), BF16)

    def forward(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, implementation="cudnn")

    work = count_work(jax.make_jaxpr(forward)(q, kv, kv))
    assert work["forward"].flops == 2 * (2 * 4 * 128 * 256) * (32 + 32)


@pytest.mark.deviceless
def test_splash_causal_attention_is_priced_by_its_block_mask():
    batch, heads, length, dim, block = 1, 2, 1024, 128, 256
    q = S((batch, heads, length, dim), BF16)
    step = ox.filter_jit(splash_step(heads, length, block))
    estimate = ox.estimate(step, q, q, q, target="tpu-v5p")
    # 4 blocks a side: 10 of 16 computed, by each of fwd (Q K^T, P V), dq (Q K^T, dP, dQ)
    # and dkv (Q K^T, dV, dP, dK).
    pairs = batch * heads * length * length * 10 / 16
    kernels = 2 * pairs * (2 * dim) + 2 * pairs * (3 * dim) + 2 * pairs * (4 * dim)
    assert estimate.simulation is not None
    assert estimate.simulation.flops == pytest.approx(kernels, rel=1e-3)  # + a small dot
    low, high = attention_bounds(batch, heads, length, dim)
    assert low <= estimate.simulation.flops <= high
    peak = TARGETS["tpu-v5p"].speeds.flops  # type: ignore[union-attr]
    assert estimate.seconds >= estimate.simulation.flops / peak
    assert estimate.flops == pytest.approx(kernels, rel=1e-3) and estimate.unpriced == ()


def add_kernel(
    x, y, declared: bool, interpret: bool = False, flops=3 * 10**9, name: str | None = "add_kernel"
):
    def kernel(x_ref, y_ref, out_ref):
        out_ref[...] = x_ref[...] + y_ref[...]

    estimate = pl.CostEstimate(flops=flops, transcendentals=0, bytes_accessed=4096)
    block = pl.BlockSpec((128, 128), lambda i, j: (i, j))
    return pl.pallas_call(
        kernel,
        out_shape=S(x.shape, x.dtype),
        grid=(2, 2),
        in_specs=[block, block],
        out_specs=block,
        cost_estimate=estimate if declared else None,
        name=name,
        interpret=interpret,
    )(x, y)


# Pallas on a GPU lowers with Mosaic GPU, which JAX says `pl.pallas_call` will stop using.
MOSAIC_GPU = "ignore:Using ``pl.pallas_call`` for Mosaic GPU:DeprecationWarning"


@pytest.mark.deviceless
@pytest.mark.filterwarnings(MOSAIC_GPU)
@pytest.mark.parametrize("target", ["h100", "tpu-v5p"])
def test_a_pallas_kernel_is_priced_by_its_declared_cost_estimate(target):
    x = S((256, 256), jnp.float32)
    step = ox.filter_jit(lambda x, y: add_kernel(x, y, declared=True))
    estimate = ox.estimate(step, x, x, target=target)
    assert estimate.simulation is not None
    assert estimate.simulation.flops == estimate.flops == 3e9
    speeds = TARGETS[target].speeds
    assert speeds is not None
    assert estimate.seconds >= 3e9 / (speeds.flops * speeds.efficiency)
    assert estimate.unpriced == ()


@pytest.mark.deviceless
@pytest.mark.filterwarnings(MOSAIC_GPU)
def test_an_unnamed_pallas_kernel_is_timed_by_its_declared_flops():
    """Issue 50, item 6: a kernel called straight from the step without a name is compiled
    under the step's scope (`jit(flat)/pallas_call`), not its own name; it was found by
    neither, its FLOPs counted but its time taken from its bytes (0.162 ms for 2 TFLOP on
    an H100). Found by its operand shapes, it takes at least its FLOPs at the peak."""
    x = S((256, 256), jnp.float32)
    step = ox.filter_jit(lambda x, y: add_kernel(x, y, True, flops=2 * 10**12, name=None))
    estimate = ox.estimate(step, x, x, target="h100")
    speeds = TARGETS["h100"].speeds
    assert speeds is not None
    assert estimate.flops == 2e12
    assert estimate.seconds >= 2e12 / speeds.flops  # at least 2.0 ms at the dense peak
    assert estimate.unpriced == ()


@pytest.mark.deviceless
@pytest.mark.filterwarnings(MOSAIC_GPU)
@pytest.mark.parametrize("target", ["h100", "tpu-v5p"])
def test_a_kernel_without_a_cost_estimate_is_named_with_its_bytes(target):
    x = S((256, 256), jnp.float32)
    step = ox.filter_jit(lambda x, y: add_kernel(x, y, declared=False))
    estimate = ox.estimate(step, x, x, target=target)
    assert estimate.flops == 0 and len(estimate.unpriced) == 1
    assert "Pallas kernel `add_kernel` (it declares no cost estimate)" in estimate.unpriced[0]
    text = str(estimate)
    # 3 arrays of 256 KiB: two read, one written.
    assert "add_kernel" in text and "priced by the 768.00 KiB it reads and writes alone" in text
    assert any("add_kernel" in note for _, note in estimate.notes)


def test_fit_says_when_the_step_calls_a_kernel_no_rule_prices():
    # A Pallas kernel in interpret mode compiles to ordinary instructions on the CPU: the
    # jaxpr count, which orders the candidates, is what cannot price it.
    model = eqx.nn.MLP(8, 8, 16, 1, key=jax.random.key(0))
    optimizer = optax.sgd(0.1)
    state = optimizer.init(eqx.filter(model, eqx.is_array))

    @ox.filter_jit
    def step(model, state, x):
        def loss(model):
            inputs = add_kernel(x, x, declared=False, interpret=True)
            return jnp.sum(jax.vmap(model)(inputs[:, :8]) ** 2)

        grads = eqx.filter_grad(loss)(model)
        updates, state = optimizer.update(grads, state)
        return eqx.apply_updates(model, updates), state

    x = jnp.ones((256, 256))
    result = ox.fit(step, model, state, x, target="cpu", device_budget=2**30, max_compiles=1)
    (note,) = [n for n in result.notes if "no rule prices" in n]
    assert "Pallas kernel `add_kernel` (it declares no cost estimate)" in note
    assert "FLOPs not counted" in note and note in result.table()


def test_an_ffi_call_is_named_in_the_jaxpr_count():
    x = S((64,), jnp.float32)

    def f(x):
        return jax.ffi.ffi_call("my_ffi_kernel", S(x.shape, x.dtype))(x)

    work = count_work(jax.make_jaxpr(f)(x))["forward"]
    assert work.unpriced and "my_ffi_kernel" in work.unpriced[0][0]
    assert work.unpriced[0][1] == 2 * 64 * 4 and "FLOPs are not counted" in work.note


def test_an_unknown_custom_call_is_named_not_free():
    text = """HloModule m, is_scheduled=true

ENTRY %main (a: f32[1024]) -> f32[1024] {
  %a = f32[1024]{0} parameter(0)
  ROOT %mystery.1 = f32[1024]{0} custom-call(%a), custom_call_target="my_library_kernel"
}
"""
    speeds = TARGETS["h100"].speeds
    assert speeds is not None
    sim = simulate(text, speeds)
    assert sim.unpriced == (
        ("mystery.1", "custom call `my_library_kernel` (no rule prices it)", 8192.0),
    )
    assert any("mystery.1" in note and "8.00 KiB" in note for note in sim.notes)


def test_an_instruction_printed_over_several_lines_is_read_whole():
    # XLA:TPU prints a Pallas kernel's `kernel_metadata` with line breaks inside it; the
    # instructions after it belong to the same computation.
    text = """HloModule m, is_scheduled=true

ENTRY %main (a: f32[8,128]) -> f32[8,128] {
  %a = f32[8,128]{1,0} parameter(0)
  %k.1 = f32[8,128]{1,0} custom-call(%a), custom_call_target="tpu_custom_call", frontend_attributes={kernel_metadata={
"xprof_metadata":"{\\"block_q\\": 512}"
}}, metadata={op_name="jit(f)/k/pallas_call"}, backend_config={"custom_call_config":{"body":"", "cost_estimate":{"flops":"1000","transcendentals":"0","bytes_accessed":"8192"}}}
  ROOT %b = f32[8,128]{1,0} add(%k.1, %k.1)
}
"""
    module = parse_module(text)
    names = [i.name for i in module.entry_computation.instructions]
    assert names == ["a", "k.1", "b"]
    assert module.entry_computation.by_name["k.1"].op_name == "jit(f)/k/pallas_call"
    speeds = TARGETS["tpu-v5p"].speeds
    assert speeds is not None
    assert simulate(text, speeds).flops == 1000


@pytest.mark.parametrize(
    "entry", ["estimate", "memory_report", "compare_memory", "fit", "max_batch"]
)
def test_a_missing_cudnn_names_the_extra_before_any_trace(monkeypatch, entry):
    pytest.importorskip("jax_plugins.xla_cuda12", reason="needs the 'cuda' extra")
    from jax._src.lib import cuda_versions

    def missing():
        raise RuntimeError("cuDNN not found.")

    monkeypatch.setattr(cuda_versions, "cudnn_get_version", missing)
    traced = []

    def step(q):
        traced.append(1)
        return cudnn_step(q, q, q)

    q = S((1, 128, 2, 64), BF16)
    pattern = r"cuDNN could not be loaded \(cuDNN not found\).*extra 'cuda'.*nvidia-cudnn-cu12"
    calls = {
        "estimate": lambda s: ox.estimate(s, q, target="h100"),
        "memory_report": lambda s: ox.memory_report(s, q, target="h100"),
        "compare_memory": lambda s: ox.compare_memory({"step": (s, (q,))}, target="h100"),
        "fit": lambda s: ox.fit(s, q, target="h100"),
        "max_batch": lambda s: ox.max_batch(
            s, lambda b: (S((b, 128, 2, 64), BF16),), target="h100"
        ),
    }
    with pytest.raises(ImportError, match=pattern):
        calls[entry](ox.filter_jit(step))
    assert traced == []


@pytest.mark.deviceless
def test_splash_compiled_alone_is_priced_dense_and_says_so():
    # XLA prints a block mask of more than a few entries as `{...}`: without the traced
    # program the compiled text prices splash as a dense mask, an upper bound, and says so.
    q = S((1, 2, 1024, 128), BF16)
    step = ox.filter_jit(splash_step(2, 1024, 256))
    estimate = ox.estimate(step, q, q, q, target="tpu-v5p")
    assert estimate.simulation is not None
    alone = simulate(estimate.simulation.program, estimate.speeds)
    dense = 2 * (2 * 1024 * 1024) * (2 + 3 + 4) * 128
    assert alone.flops == pytest.approx(dense, rel=1e-3)
    assert any("block mask was not read" in note for note in alone.notes)
    assert not any("not read" in note for note in estimate.simulation.notes)


def test_splash_without_its_mask_is_priced_dense_and_says_so():
    # The compiled text alone (no trace) of a splash kernel whose block mask XLA prints
    # as `{...}`: the dense count, an upper bound, with a note.
    from offload_eqx._planning.fused import splash_cost

    q = ("bfloat16", (1, 2, 1024, 128))
    table = ("int8", (1, 8, 8))
    cost = splash_cost("splash_mha_fwd_residuals", [table, table, q, q, q], None, {}, 2)
    assert cost is not None and cost.flops == 2 * (2 * 1024 * 1024) * 256
    assert "not read" in cost.note
    mask = np.tril(np.ones((1, 8, 8), np.int8))
    blocks = {"block_q": 128, "block_kv": 128}
    cost = splash_cost("splash_mha_fwd_residuals", [table, table, q, q, q], mask, blocks, 2)
    assert cost is not None and cost.flops == 2 * (2 * 36 * 128 * 128) * 256 and not cost.note


@pytest.mark.deviceless
@pytest.mark.parametrize("target", ["h100", "tpu-v5p"])
def test_a_shard_map_on_this_machines_devices_is_refused_with_the_fix(target):
    # A kernel XLA cannot partition runs in a `shard_map`; on a mesh of this machine's CPU
    # devices it cannot compile for a GPU or TPU target, which JAX said in argument
    # indices (TPU) or mid-trace (GPU). The fix the error gives compiles.
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((1,), ("batch",), axis_types=(jax.sharding.AxisType.Auto,))
    x = S((8, 128), jnp.float32)

    def doubled(mesh):
        return jax.shard_map(lambda x: 2 * x, mesh=mesh, in_specs=P("batch"), out_specs=P("batch"))

    fix = {"h100": "cannot yet be compiled for a GPU", "tpu-v5p": "mesh=mesh.abstract_mesh"}
    with pytest.raises(ValueError, match=r"`jax.shard_map` on a mesh") as e:
        ox.estimate(ox.filter_jit(doubled(mesh)), x, target=target)
    assert fix[target] in str(e.value)
    if target == "tpu-v5p":
        fixed = ox.filter_jit(doubled(mesh.abstract_mesh))
        assert ox.memory_report(fixed, x, target=target).total > 0


def test_a_gpu_compiles_cudnn_workspace_is_read_from_its_text():
    # What a compile on a GPU prints (a sized workspace) and what a deviceless one does.
    from offload_eqx._inspect.workspaces import cudnn_workspaces, unsized_workspaces

    line = (
        "  %fwd = (bf16[4,8,1024,128]{3,1,2,0}, f32[4,8,1024]{2,1,0}, u8[{size}]{0}) "
        'custom-call(%q, %k, %v), custom_call_target="__cudnn$fmhaSoftmax", api_version=1'
    )
    text = "\n".join([line.replace("{size}", "1048576"), line.replace("{size}", "0")])
    assert cudnn_workspaces(text) == [("__cudnn$fmhaSoftmax", 2**20), ("__cudnn$fmhaSoftmax", 0)]
    assert unsized_workspaces(text) == {"__cudnn$fmhaSoftmax": 1}
