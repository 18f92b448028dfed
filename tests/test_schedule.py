"""The compiled-program simulation (`offload_eqx/_planning/{hlo,kernels,schedule}.py`):
small modules whose schedule is worked out by hand, then modules XLA compiled.

The hand-written modules use the syntax of `compiled.as_text()` for an H100 (tuple
results, `S(5)` host layouts, `known_trip_count`, `async-start` wrapping a computation).
"""

import dataclasses
import json
from unittest import mock

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import HostSquare, HostStack, computed_on_host

import offload_eqx as ox
from offload_eqx import Speeds
from offload_eqx._planning.hlo import arrays, parse_module
from offload_eqx._planning.kernels import _real_taps, instruction_work
from offload_eqx._planning.schedule import simulate
from offload_eqx._planning.timeline import trace_events, write_timeline

MIB2 = 1024 * 1024 * 2  # one bf16[1024,1024]
GEMM_FLOPS = 2 * 1024**3

# Round rates, so that every time below is worked out by hand: 1 TFLOP/s, 1 TB/s HBM,
# a 1 GB/s link each way.
SPEEDS = Speeds(
    flops=1e12,
    efficiency=1.0,
    memory_bandwidth=1e12,
    h2d_bandwidth=1e9,
    d2h_bandwidth=1e9,
    host_flops=1e10,
    host_bandwidth=1e9,
    host_memory=2**34,
    interconnect_bandwidth=1e9,
)

DOT = """
%fused_dot (p0: bf16[1024,1024], p1: bf16[1024,1024]) -> bf16[1024,1024] {
  %p0 = bf16[1024,1024]{1,0} parameter(0)
  %p1 = bf16[1024,1024]{1,0} parameter(1)
  ROOT %dot.1 = bf16[1024,1024]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}, metadata={op_name="jit(step)/jvp()/dot_general"}
}
"""

PREFETCH = (
    "HloModule prefetch, is_scheduled=true\n"
    + DOT
    + """
ENTRY %main (a: bf16[1024,1024], w: bf16[1024,1024]) -> bf16[1024,1024] {
  %a = bf16[1024,1024]{1,0} parameter(0)
  %w = bf16[1024,1024]{1,0:S(5)} parameter(1)
  %copy-start = (bf16[1024,1024]{1,0}, bf16[1024,1024]{1,0:S(5)}, u32[]) copy-start(%w)
  %gemm.1 = bf16[1024,1024]{1,0} fusion(%a, %a), kind=kCustom, calls=%fused_dot, metadata={op_name="jit(step)/jvp()/dot_general"}
  %copy-done = bf16[1024,1024]{1,0} copy-done(%copy-start)
  ROOT %gemm.2 = bf16[1024,1024]{1,0} fusion(%gemm.1, %copy-done), kind=kCustom, calls=%fused_dot, metadata={op_name="jit(step)/transpose(jvp())/dot_general"}
}
"""
)


def test_a_prefetch_hides_behind_the_kernel_before_its_done():
    sim = simulate(PREFETCH, SPEEDS)
    gemm = GEMM_FLOPS / 1e12  # 2.147 ms each; their 6 MiB of HBM traffic takes 6 us
    copy = MIB2 / 1e9  # 2.097 ms: shorter than the first gemm, so nothing is exposed
    assert sim.busy["h2d"] == pytest.approx(copy)
    assert sim.busy["compute"] == pytest.approx(2 * gemm)
    assert sim.seconds == pytest.approx(2 * gemm)
    assert sim.waited == {}
    assert sim.flops == 2 * GEMM_FLOPS
    assert [(e.resource, e.name, e.phase) for e in sim.events] == [
        ("h2d", "copy-start", "forward"),
        ("compute", "gemm.1", "forward"),
        ("compute", "gemm.2", "backward"),
    ]
    # A slower link: the done waits for the copy, and the wait is exposed.
    slow = simulate(PREFETCH, dataclasses.replace(SPEEDS, h2d_bandwidth=0.5e9))
    assert slow.waited["h2d"] == pytest.approx(2 * copy - gemm)
    assert slow.seconds == pytest.approx(2 * copy + gemm)


def test_kernel_launch_is_added_to_every_kernel_and_copy():
    launch = 1e-5
    sim = simulate(PREFETCH, dataclasses.replace(SPEEDS, kernel_launch=launch))
    assert sim.busy["compute"] == pytest.approx(2 * (GEMM_FLOPS / 1e12 + launch))
    assert sim.busy["h2d"] == pytest.approx(MIB2 / 1e9 + launch)
    assert sim.kernels == 2


LOOP = """HloModule loop, is_scheduled=true

%async_computation (param_0: bf16[4,1024,1024], param_1: s32[]) -> bf16[1,1024,1024] {
  %param_0 = bf16[4,1024,1024]{2,1,0:S(5)} parameter(0)
  %param_1 = s32[] parameter(1)
  %zero = s32[] constant(0)
  ROOT %ds = bf16[1,1024,1024]{2,1,0} dynamic-slice(%param_0, %param_1, %zero, %zero), dynamic_slice_sizes={1,1024,1024}
}

%fused_scale (q0: bf16[1,1024,1024]) -> bf16[1,1024,1024] {
  %q0 = bf16[1,1024,1024]{2,1,0} parameter(0)
  ROOT %neg = bf16[1,1024,1024]{2,1,0} negate(%q0)
}

%body (state: (s32[], bf16[4,1024,1024], bf16[1,1024,1024])) -> (s32[], bf16[4,1024,1024], bf16[1,1024,1024]) {
  %state = (s32[], bf16[4,1024,1024]{2,1,0:S(5)}, bf16[1,1024,1024]{2,1,0}) parameter(0)
  %i = s32[] get-tuple-element(%state), index=0
  %stack = bf16[4,1024,1024]{2,1,0:S(5)} get-tuple-element(%state), index=1
  %fetch-start = ((bf16[4,1024,1024]{2,1,0:S(5)}, s32[]), bf16[1,1024,1024]{2,1,0}, u32[]) async-start(%stack, %i), calls=%async_computation, metadata={op_name="jit(step)/jvp()/while/body/dynamic_slice"}
  %fetch-done = bf16[1,1024,1024]{2,1,0} async-done(%fetch-start)
  %use = bf16[1,1024,1024]{2,1,0} fusion(%fetch-done), kind=kLoop, calls=%fused_scale
  ROOT %next = (s32[], bf16[4,1024,1024]{2,1,0:S(5)}, bf16[1,1024,1024]{2,1,0}) tuple(%i, %stack, %use)
}

%cond (state.1: (s32[], bf16[4,1024,1024], bf16[1,1024,1024])) -> pred[] {
  %state.1 = (s32[], bf16[4,1024,1024]{2,1,0:S(5)}, bf16[1,1024,1024]{2,1,0}) parameter(0)
  ROOT %true = pred[] constant(true)
}

ENTRY %main (s: (s32[], bf16[4,1024,1024], bf16[1,1024,1024])) -> (s32[], bf16[4,1024,1024], bf16[1,1024,1024]) {
  %s = (s32[], bf16[4,1024,1024]{2,1,0:S(5)}, bf16[1,1024,1024]{2,1,0}) parameter(0)
  ROOT %while = (s32[], bf16[4,1024,1024]{2,1,0:S(5)}, bf16[1,1024,1024]{2,1,0}) while(%s), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"4"}}
}
"""


def test_a_loop_fetches_one_slice_of_a_host_stack_per_trip():
    module = parse_module(LOOP)
    assert module.computations["main"].root.trip_count == 4
    sim = simulate(LOOP, SPEEDS)
    # Each trip reads one 2 MiB layer over the link (not the 8 MiB stack), then a
    # negate reads and writes 2 MiB of HBM; the done waits for the whole fetch.
    fetch, negate = MIB2 / 1e9, 2 * MIB2 / 1e12
    assert sim.busy["h2d"] == pytest.approx(4 * fetch)
    assert sim.busy["compute"] == pytest.approx(4 * negate)
    assert sim.waited["h2d"] == pytest.approx(4 * fetch)
    assert sim.seconds == pytest.approx(4 * (fetch + negate))
    assert sim.kernels == 4


def test_unknown_trip_counts_and_long_loops():
    unknown = LOOP.replace(', backend_config={"known_trip_count":{"n":"4"}}', "")
    sim = simulate(unknown, SPEEDS)
    assert sim.kernels == 1 and any("trip count" in note for note in sim.notes)
    # Beyond the trips simulated event by event, the last trip's time is repeated.
    long = LOOP.replace('"n":"4"', '"n":"1000"')
    sim = simulate(long, SPEEDS)
    assert sim.kernels == 1000 and sim.truncated
    assert sim.seconds == pytest.approx(1000 * (MIB2 / 1e9 + 2 * MIB2 / 1e12))


# A host computation that updates one layer of a stack held whole in host memory (the
# stack's index is an operand): XLA:GPU passes the whole stack and slices it on the host.
HOST_LAYER = """HloModule host_layer, is_scheduled=true

%host_update (g: f32[1048576], stack: f32[8,1048576], i: s32[]) -> f32[1048576] {
  %g = f32[1048576]{0} parameter(0)
  %stack = f32[8,1048576]{1,0} parameter(1)
  %i = s32[] parameter(2)
  %zero = s32[] constant(0)
  %layer = f32[1,1048576]{1,0} dynamic-slice(%stack, %i, %zero), dynamic_slice_sizes={1,1048576}
  %w = f32[1048576]{0} reshape(%layer)
  ROOT %new = f32[1048576]{0} subtract(%w, %g)
}

ENTRY %main (g: f32[1048576], stack: f32[8,1048576], i: s32[]) -> f32[1048576] {
  %g = f32[1048576]{0:S(5)} parameter(0)
  %stack = f32[8,1048576]{1,0:S(5)} parameter(1)
  %i = s32[] parameter(2)
  %call-start = ((f32[1048576]{0:S(5)}, f32[8,1048576]{1,0:S(5)}, s32[]), f32[1048576]{0}, u32[]) custom-call-start(%g, %stack, %i), async_execution_thread="host", custom_call_target="HostExecute", called_computations={%host_update}
  ROOT %call-done = f32[1048576]{0} custom-call-done(%call-start)
}
"""


def test_a_host_computation_reads_only_the_layer_it_slices_from_a_stack():
    # The result lands in host memory: the gradient, one 4 MiB layer of the 32 MiB stack
    # and the 4 MiB result, at the host's 1 GB/s (the index's 4 bytes too).
    in_host = HOST_LAYER.replace("f32[1048576]{0}, u32[])", "f32[1048576]{0:S(5)}, u32[])")
    layer = 4 * 2**20
    assert simulate(in_host, SPEEDS).busy["host"] == pytest.approx((3 * layer + 4) / 1e9)
    # Used whole, the stack is read whole.
    line = "  %w = f32[1048576]{0} reshape(%layer)\n"
    whole = in_host.replace(line, line + "  %all = f32[8,1048576]{1,0} negate(%stack)\n")
    assert simulate(whole, SPEEDS).busy["host"] > 8 * layer / 1e9


def test_a_host_computation_moves_what_it_reads_or_returns_in_device_memory():
    """XLA:GPU returns a host call's results in device memory when a loop writes them
    into a host stack: they cross the link (1 GB/s here) as part of the call. So does
    an operand in device memory, the other way."""
    layer = 4 * 2**20
    host_work = (3 * layer + 4) / 1e9
    returned = simulate(HOST_LAYER, SPEEDS)
    assert returned.busy["host"] == pytest.approx(host_work + layer / 1e9)
    read = HOST_LAYER.replace(
        "%call-start = ((f32[1048576]{0:S(5)},", "%call-start = ((f32[1048576]{0},"
    ).replace("f32[1048576]{0}, u32[])", "f32[1048576]{0:S(5)}, u32[])")
    assert read != HOST_LAYER
    assert simulate(read, SPEEDS).busy["host"] == pytest.approx(host_work + layer / 1e9)


ALL_REDUCE = """HloModule collective, is_scheduled=true

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %sum = f32[] add(%x, %y)
}

ENTRY %main (g: f32[1048576]) -> f32[1048576] {
  %g = f32[1048576]{0} parameter(0)
  %ar-start = f32[1048576]{0} all-reduce-start(%g), replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=%add
  %other = f32[1048576]{0} negate(%g)
  %ar-done = f32[1048576]{0} all-reduce-done(%ar-start)
  ROOT %out = f32[1048576]{0} add(%ar-done, %other)
}
"""


def test_an_all_reduce_over_eight_devices_is_a_ring():
    sim = simulate(ALL_REDUCE, SPEEDS)
    ring = 2 * 7 / 8 * 4 * 2**20 / 1e9  # 2 (n-1)/n x 4 MiB at 1 GB/s
    negate, add = 8 * 2**20 / 1e12, 12 * 2**20 / 1e12
    assert sim.busy["network"] == pytest.approx(ring)
    assert sim.waited["network"] == pytest.approx(ring - negate)
    assert sim.seconds == pytest.approx(ring + add)
    no_link = simulate(ALL_REDUCE, dataclasses.replace(SPEEDS, interconnect_bandwidth=0.0))
    assert no_link.busy["network"] == 0 and any("interconnect" in n for n in no_link.notes)


def test_kernels_read_slices_and_write_updates_in_place():
    module = parse_module(LOOP)
    body = module.computations["body"]
    wrapped = module.computations["async_computation"]
    # The dynamic slice of the host stack reads one layer over the link, writes it on the device.
    fetch = instruction_work(module, wrapped, wrapped.root)
    assert (fetch.host_read, fetch.device_bytes) == (MIB2, MIB2)
    use = instruction_work(module, body, body.by_name["use"])
    assert (use.device_bytes, use.host_read, use.flops) == (2 * MIB2, 0, 0)
    gemm = parse_module(PREFETCH)
    main = gemm.entry_computation
    work = instruction_work(gemm, main, main.by_name["gemm.1"])
    assert (work.flops, work.device_bytes) == (GEMM_FLOPS, 3 * MIB2)


def test_text_that_is_not_a_module_is_refused():
    with pytest.raises(ValueError, match="no ENTRY computation.*as_text"):
        parse_module("HloModule nothing\n")


def test_the_timeline_is_chrome_trace_json(tmp_path):
    sim = simulate(PREFETCH, SPEEDS)
    doc = trace_events(sim, "prefetch")
    tracks = {e["args"]["name"] for e in doc["traceEvents"] if e.get("name") == "thread_name"}
    assert tracks == {"compute", "h2d", "d2h", "host", "network"}
    slices = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert [(e["name"], round(e["ts"], 3), round(e["dur"], 3)) for e in slices] == [
        ("copy-start", 0.0, round(MIB2 / 1e9 * 1e6, 3)),
        ("gemm.1", 0.0, round(GEMM_FLOPS / 1e12 * 1e6, 3)),
        ("gemm.2", round(GEMM_FLOPS / 1e12 * 1e6, 3), round(GEMM_FLOPS / 1e12 * 1e6, 3)),
    ]
    path = write_timeline(sim, str(tmp_path / "step.json"), "prefetch")
    assert json.load(open(path))["otherData"]["step_seconds"] == pytest.approx(sim.seconds)


# -- modules XLA compiled for an H100, without the hardware ------------------------------


def _h100():
    pytest.importorskip("jax_plugins.xla_cuda12", reason="needs the 'cuda' extra")


def _stack_step(strategy):
    model = eqx.filter_eval_shape(lambda: HostStack(HostSquare(jnp.zeros((4, 512, 512)))))
    x = jax.ShapeDtypeStruct((256, 512), jnp.float32)
    opt = ox.offload_optimizer(optax.adam(1e-3))
    state = eqx.filter_eval_shape(opt.init, model)

    def step(model, state, x):
        grads = eqx.filter_grad(lambda m: jnp.mean(m(x) ** 2))(model)
        return ox.update_and_apply(opt, grads, state, model)

    return ox.filter_jit(step, strategy=strategy, donate="all"), (model, state, x)


def _overlaps(a, b) -> bool:
    return a.start < b.end and b.start < a.end


def _simulation(estimate: ox.StepEstimate):
    assert estimate.simulation is not None
    return estimate.simulation


def _speeds(target: str) -> Speeds:
    speeds = ox.TARGETS[target].speeds
    assert speeds is not None
    return speeds


@pytest.mark.deviceless
def test_h100_layer_fetches_inside_the_scan_overlap_compute():
    _h100()
    step, args = _stack_step("hybrid")
    estimate = ox.estimate(step, *args, target="h100")
    sim = _simulation(estimate)
    assert estimate.model == "compiled" and estimate.traced_seconds is not None
    looped = [e for e in sim.events if e.resource == "h2d" and "while/body" in e.op_name]
    fetches = [e for e in looped if e.phase != "update"]
    kernels = [e for e in sim.events if e.resource == "compute"]
    # Inside the scan, one layer of 1 MiB per fetch (not the 4 MiB stack), each trip.
    assert len(fetches) % 4 == 0 and all(e.bytes <= 512 * 512 * 4 for e in fetches)
    # The update (adam's state in host memory, `stream=None`) reads each stack in two
    # slices of its elements: the weights and both moments, half a stack a trip, and no
    # stack of the state or the weights whole.
    sliced = [e for e in looped if e.phase == "update"]
    assert len(sliced) == 6 and all(e.bytes == 2 * 512 * 512 * 4 for e in sliced)
    whole = [e for e in sim.events if e.resource == "h2d" and e.bytes == 4 * 512 * 512 * 4]
    # One: the gradient stack, which the backward scan wrote to host memory layer by
    # layer (the weights are host-resident), fetched whole for the update.
    assert len(whole) == 1 and whole[0].phase == "update"
    # XLA placed each fetch's done right after its start, before the layer's matmul:
    # nothing hides a fetch, and the stream waits for every one of them.
    assert not any(_overlaps(f, k) for f in fetches for k in kernels)
    # The backward pass writes each layer's residual gradient back to host memory
    # (`dynamic-update-slice-start`) while the next matmul runs.
    writes = [
        e
        for e in sim.events
        if e.resource == "d2h" and "while/body" in e.op_name and e.phase == "backward"
    ]
    assert len(writes) == 4 and all(any(_overlaps(w, k) for k in kernels) for w in writes)
    assert sim.seconds < sum(sim.busy.values())
    # The FLOPs of the compiled program are the jaxpr's (recomputation included).
    assert sim.flops == pytest.approx(estimate.flops, rel=1e-6)


@pytest.mark.deviceless
def test_h100_host_update_runs_after_the_backward_pass_with_nothing_beside_it():
    _h100()
    host = ox.Strategy("hybrid_host_update", "pinned_host", "pinned_host", update="host")
    step, args = _stack_step(host)
    sim = _simulation(ox.estimate(step, *args, target="h100"))
    (update,) = [e for e in sim.events if e.resource == "host"]
    backward = [e for e in sim.events if e.resource == "compute" and e.phase == "backward"]
    assert update.phase == "update" and update.start >= max(e.end for e in backward)
    # Nothing overlaps it: the compute stream waits for all of it.
    assert sim.waited["host"] == pytest.approx(update.end - update.start)
    # One loop per result, as XLA:CPU compiles it: mu and nu each read the gradient and
    # themselves and write (3 arrays of 4 MiB each), the parameter reads itself and both
    # new moments and writes (4): 10 arrays, at the host's bandwidth (one pass was 7).
    speeds = _speeds("h100")
    assert update.end - update.start == pytest.approx(
        10 * 4 * 2**20 / speeds.host_bandwidth, rel=0.01
    )


@pytest.mark.deviceless
def test_h100_a_host_computation_in_a_loop_returns_its_results_to_the_device():
    """A compiler fact the in-loop host update depends on (`benchmarks/README.md`, "A
    host update inside the backward loop"): XLA:GPU, as JAX 0.10.2 reaches it, returns
    the results of a host computation inside a loop to device memory when the loop
    writes them into a host stack (and reads the loop's slices of host stacks from
    device memory), so each layer's state would cross the link twice. When this fails,
    XLA keeps them in host memory, and that design may pay."""
    _h100()
    from offload_eqx._targets.devices import target_mesh

    mesh = target_mesh("h100")
    spec = jax.sharding.PartitionSpec()
    host = jax.sharding.NamedSharding(mesh.abstract_mesh, spec, memory_kind="pinned_host")

    update = computed_on_host(jax.jit(lambda w, g: w - 0.1 * g))

    def step(W, G):
        def body(_, wg):
            return None, jax.device_put(update(*wg), host)

        return jax.lax.scan(body, None, (W, G))[1]

    stack = jax.ShapeDtypeStruct((4, 256, 256), jnp.float32, sharding=host)
    with jax.set_mesh(mesh):
        compiled = jax.jit(step, out_shardings=host).trace(stack, stack).lower().compile()
    text = compiled.as_text()
    assert text is not None
    module = parse_module(text)
    (start,) = [
        i
        for c in module.computations.values()
        for i in c.instructions
        if i.opcode == "custom-call-start"
        and "host" in (i.attribute("async_execution_thread") or "")
    ]
    assert isinstance(start.type, tuple)
    (result,) = [a for a in arrays(start.type[1]) if a.dims]
    assert not result.host  # returned to the device, then written to the host stack
    # The slices of the host stacks it reads are fetched to the device first, too.
    assert not any(a.host for a in arrays(start.type[0]) if a.dims)
    # Each of the 4 trips: w and g to the host, one pass over them and the result on
    # the host, then the result to the device.
    speeds = _speeds("h100")
    layer = 256 * 256 * 4
    per_trip = (
        2 * layer / speeds.d2h_bandwidth
        + 3 * layer / speeds.host_bandwidth
        + layer / speeds.h2d_bandwidth
    )
    assert simulate(compiled, speeds).busy["host"] == pytest.approx(4 * per_trip, rel=0.01)


@pytest.mark.deviceless
def test_h100_8_all_reduce_is_priced_as_a_ring():
    _h100()
    from offload_eqx._targets.devices import target_devices

    devices = target_devices("h100-8")
    mesh = jax.sharding.Mesh(np.array(devices).reshape(8), ("d",))
    sharded = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("d"))
    whole = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    x = jax.ShapeDtypeStruct((8, 2**20), jnp.float32, sharding=sharded)
    compiled = jax.jit(lambda x: jnp.sum(x, axis=0), out_shardings=whole).trace(x).lower().compile()
    speeds = _speeds("h100-8")
    sim = simulate(compiled, speeds)
    ring = 2 * 7 / 8 * 4 * 2**20 / speeds.interconnect_bandwidth
    assert sim.busy["network"] == pytest.approx(ring + speeds.kernel_launch, rel=1e-6)
    assert [e.resource for e in sim.events].count("network") == 1


@pytest.mark.parametrize(
    ("groups", "size"),
    [
        ("{{0,1,2,3},{4,5,6,7}}", 4),
        ("[2,4]<=[8]", 4),
        ("mesh['data'=2,'model'=4] {'model'}", 4),
        ("mesh['data'=2,'model'=4] {'data','model'}", 8),
    ],
)
def test_replica_groups_in_each_form_xla_prints(groups, size):
    from offload_eqx._planning.hlo import parse_instruction
    from offload_eqx._planning.kernels import group_size

    line = f"  %ar = f32[8]{{0}} all-reduce(%g), replica_groups={groups}, to_apply=%add"
    parsed = parse_instruction(line)
    assert parsed is not None
    instruction, _ = parsed
    assert instruction.opcode == "all-reduce" and group_size(instruction) == size


TRANSPOSE = """HloModule flip, is_scheduled=true

%fused_flip (p: f32[1024,2048]) -> f32[2048,1024] {
  %p = f32[1024,2048]{1,0} parameter(0)
  ROOT %t = f32[2048,1024]{1,0} transpose(%p), dimensions={1,0}
}

ENTRY %main (x: f32[1024,2048]) -> f32[2048,1024] {
  %x = f32[1024,2048]{1,0} parameter(0)
  ROOT %flip = f32[2048,1024]{1,0} fusion(%x), kind=kLoop, calls=%fused_flip
}
"""


def test_a_transposing_kernel_moves_at_the_transpose_rate_and_temp_is_touched_first():
    moved = 2 * 8 * 2**20  # 8 MiB read, 8 MiB written
    assert simulate(TRANSPOSE, SPEEDS).seconds == pytest.approx(moved / 1e12)
    strided = dataclasses.replace(SPEEDS, transpose_bandwidth=1e10)
    assert simulate(TRANSPOSE, strided).seconds == pytest.approx(moved / 1e10)
    # A runtime that allocates its temporary buffer afresh faults it in first.
    fresh = dataclasses.replace(SPEEDS, first_touch_bandwidth=1e9)
    sim = simulate(TRANSPOSE, fresh, temp_bytes=10**6)
    assert sim.seconds == pytest.approx(1e-3 + moved / 1e12)
    assert sim.events[0].name == "temporary buffer (first touch)" and sim.events[0].end == 1e-3
    assert simulate(TRANSPOSE, SPEEDS, temp_bytes=10**6).seconds == pytest.approx(moved / 1e12)


def test_a_traced_estimate_has_no_timeline_and_says_how_to_get_one(tmp_path):
    def step(w, x):
        return jnp.sum(jnp.tanh(x @ w))

    w, x = jnp.ones((64, 64)), jnp.ones((8, 64))
    traced = ox.estimate(step, w, x, target="cpu", compile=False)
    assert traced.model == "traced" and traced.simulation is None
    with pytest.raises(ValueError, match=r"compile=False.*ox.estimate\(\.\.\., compile=True\)"):
        traced.timeline(str(tmp_path / "step.json"))
    compiled = ox.estimate(step, w, x, target="cpu")
    assert compiled.model == "compiled" and isinstance(compiled.simulation, ox.Simulation)
    assert compiled.traced_seconds == pytest.approx(traced.seconds)
    document = json.load(open(compiled.timeline(str(tmp_path / "step.json"))))
    names = {e["name"] for e in document["traceEvents"] if e["ph"] == "X"}
    assert any("dot" in n or "fusion" in n for n in names)
    assert compiled.to_dict()["model"] == "compiled" and "simulation" in compiled.to_dict()


COUNTED = """HloModule counted, is_scheduled=true

%fused_scale (q0: f32[1024]) -> f32[1024] {
  %q0 = f32[1024]{0} parameter(0)
  ROOT %neg = f32[1024]{0} negate(%q0)
}

%body (s: (s32[], f32[1024])) -> (s32[], f32[1024]) {
  %s = (s32[], f32[1024]{0}) parameter(0)
  %i = s32[] get-tuple-element(%s), index=0
  %v = f32[1024]{0} get-tuple-element(%s), index=1
  %one = s32[] constant(1)
  %next_i = s32[] add(%i, %one)
  %next_v = f32[1024]{0} fusion(%v), kind=kLoop, calls=%fused_scale
  ROOT %t = (s32[], f32[1024]{0}) tuple(%next_i, %next_v)
}

%cond (c: (s32[], f32[1024])) -> pred[] {
  %limit = s32[] constant(7)
  %c = (s32[], f32[1024]{0}) parameter(0)
  %k = s32[] get-tuple-element(%c), index=0
  ROOT %lt = pred[] compare(%k, %limit), direction=LT
}

ENTRY %main (v0: f32[1024]) -> (s32[], f32[1024]) {
  %v0 = f32[1024]{0} parameter(0)
  %zero = s32[] constant(2)
  %start = s32[] copy(%zero)
  %init = (s32[], f32[1024]{0}) tuple(%start, %v0)
  ROOT %loop = (s32[], f32[1024]{0}) while(%init), condition=%cond, body=%body
}
"""


def test_a_trip_count_is_read_from_the_condition_when_xla_prints_none():
    # XLA:TPU prints no `known_trip_count`: `i < 7` from `i = 2` runs 5 trips.
    sim = simulate(COUNTED, SPEEDS)
    assert sim.notes == ()
    assert [e.name for e in sim.events].count("next_v") == 5
    module = parse_module(COUNTED)
    main = module.entry_computation
    assert module.trip_count(main, main.by_name["loop"]) == 5
    le = parse_module(COUNTED.replace("direction=LT", "direction=LE"))
    assert le.trip_count(le.entry_computation, le.entry_computation.by_name["loop"]) == 6


@pytest.mark.deviceless
def test_with_speeds_prices_the_same_program_again_without_compiling():
    """`StepEstimate.with_speeds`: a faster host link shortens the waits for the layer
    fetches; unchanged speeds give the same answer; the memory is the compile's."""
    _h100()
    step, args = _stack_step("hybrid")
    estimate = ox.estimate(step, *args, target="h100")
    speeds = _speeds("h100")
    with mock.patch("offload_eqx._planning.estimate.compiled_report") as compile_again:
        same = estimate.with_speeds()
        fast = estimate.with_speeds(
            h2d_bandwidth=10 * speeds.h2d_bandwidth, d2h_bandwidth=10 * speeds.d2h_bandwidth
        )
    compile_again.assert_not_called()
    assert same.seconds == pytest.approx(estimate.seconds, rel=1e-12)
    assert same.traced_seconds == pytest.approx(estimate.traced_seconds, rel=1e-12)
    sim, fast_sim = _simulation(estimate), _simulation(fast)
    assert fast.speeds.h2d_bandwidth == 10 * speeds.h2d_bandwidth
    # Each copy's bytes move ten times faster; its launch cost stays.
    launches = speeds.kernel_launch * sum(e.resource == "h2d" for e in sim.events)
    expected = (sim.busy["h2d"] - launches) / 10 + launches
    assert fast_sim.busy["h2d"] == pytest.approx(expected, rel=1e-6)
    assert fast_sim.waited["h2d"] < sim.waited["h2d"] and fast.seconds < estimate.seconds
    assert fast_sim.busy["compute"] == pytest.approx(sim.busy["compute"], rel=1e-12)
    assert (fast.device_bytes, fast.host_bytes) == (estimate.device_bytes, estimate.host_bytes)
    assert fast.traced_seconds is not None and estimate.traced_seconds is not None
    assert fast.traced_seconds <= estimate.traced_seconds


def test_with_speeds_refuses_what_is_not_a_speed():
    w = jnp.ones((64, 64))
    estimate = ox.estimate(lambda w, x: jnp.sum(x @ w), w, w, target="cpu", compile=False)
    with pytest.raises(TypeError, match=r"with_speeds\(h2d=\.\.\.\).*h2d_bandwidth"):
        estimate.with_speeds(h2d=1e9)
    with pytest.raises(ValueError, match=r"ox.Speeds\(h2d_bandwidth=-1\.0\)"):
        estimate.with_speeds(h2d_bandwidth=-1.0)
    half = {"flops": estimate.speeds.flops / 2}
    half["memory_bandwidth"] = estimate.speeds.memory_bandwidth / 2
    slower = estimate.with_speeds(**half)
    assert slower.model == "traced" and slower.seconds > estimate.seconds


@pytest.mark.deviceless
def test_gh200_compiles_the_h100_gpu_with_grace_memory_and_the_c2c_link():
    """GH200: the same GPU compiled with 96 GB of HBM, and a host link of NVLink-C2C (450
    GB/s each way): the layer fetches the H100 waits for nearly vanish."""
    _h100()
    gh200 = ox.TARGETS["gh200"]
    assert gh200.capacity == 96 * 10**9 and gh200.platform == "cuda"
    speeds = _speeds("gh200")
    assert speeds.h2d_bandwidth == speeds.d2h_bandwidth == 450e9
    assert speeds.flops == _speeds("h100").flops
    step, args = _stack_step("hybrid")
    h100, grace = (ox.estimate(step, *args, target=t) for t in ("h100", "gh200"))
    assert grace.device_bytes == h100.device_bytes  # the same program
    assert _simulation(grace).flops == _simulation(h100).flops
    waits, grace_waits = _simulation(h100).waited["h2d"], _simulation(grace).waited["h2d"]
    assert grace_waits < waits / 5 and grace.seconds < h100.seconds


@pytest.mark.deviceless
def test_xla_tpu_batched_dot_as_a_dilated_convolution_counts_its_real_taps():
    """XLA:TPU writes `einsum("bqhd,bkhd->bhqk")` as a convolution whose batch dimensions
    are windows of their own size with as much input dilation: one tap of each window
    meets an input element. Counting every tap made the decoder's attention 64 times its
    FLOPs (a 1B step simulated at 3.1 s on v5p against 0.5 s by the count)."""
    pytest.importorskip("libtpu", reason="needs the 'tpu' extra")
    q = jax.ShapeDtypeStruct((4, 256, 16, 128), jnp.bfloat16)
    step = ox.filter_jit(lambda q, k: jnp.einsum("bqhd,bkhd->bhqk", q, k))
    estimate = ox.estimate(step, q, q, target="tpu-v5p")
    assert estimate.flops == 2 * 4 * 16 * 256 * 256 * 128
    assert _simulation(estimate).flops == pytest.approx(estimate.flops, rel=1e-9)


@pytest.mark.deviceless
def test_xla_tpu_head_split_projection_as_a_padded_convolution_counts_its_real_taps():
    """XLA:TPU writes a projection into heads (`btd,dhk->bthk`) as a convolution over a
    padded input of size 1 with a window of one tap per head: 15 of each window's 16 taps
    meet padding. Counting them made every q/k/v/o projection of the decoder 16 times its
    FLOPs (a 1B step simulated at 930 ms on v5p; 394 ms once the taps are counted)."""
    pytest.importorskip("libtpu", reason="needs the 'tpu' extra")
    x = jax.ShapeDtypeStruct((4, 256, 512), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((512, 16, 128), jnp.bfloat16)
    step = ox.filter_jit(lambda x, w: jnp.einsum("btd,dhk->bthk", x, w))
    estimate = ox.estimate(step, x, w, target="tpu-v5p")
    assert estimate.flops == 2 * 4 * 256 * 512 * 16 * 128
    assert _simulation(estimate).flops == pytest.approx(estimate.flops, rel=1e-9)


@pytest.mark.parametrize(
    "window",
    [
        # (input size, window, stride, pad low, pad high, input dilation, window dilation)
        (1, 16, 1, 15, 15, 1, 1),  # XLA:TPU's head split: one real tap per window
        (4, 4, 1, 3, 3, 4, 1),  # its batched dot: dilation as large as the window
        (7, 3, 2, 1, 1, 1, 1),  # a strided convolution with 'SAME'-like padding
        (5, 3, 1, -1, 2, 2, 2),  # negative padding, both dilations
    ],
)
def test_a_windows_real_taps_are_counted_as_the_definition_counts_them(window):
    """The count of taps meeting input elements equals a direct enumeration of every
    (output, tap) pair of the padded, dilated input."""
    n, size, stride, low, high, dilate, rhs = window
    span = (n - 1) * dilate + 1 + low + high
    outputs = max(0, (span - (size - 1) * rhs - 1) // stride + 1)
    positions = [o * stride + k * rhs - low for o in range(outputs) for k in range(size)]
    real = sum(p >= 0 and p % dilate == 0 and p // dilate < n for p in positions)
    assert _real_taps(*window) == (real, outputs * size)
    assert 0 < real < outputs * size  # each case has taps on both sides


@pytest.mark.deviceless
def test_xla_tpu_moves_one_layers_slice_of_an_offloaded_activation_per_copy():
    """XLA:TPU offloads a scanned activation with a `dynamic-update-slice-start` into a
    host buffer holding every layer's, and fetches it back with a `dynamic-slice-start`:
    each moves one layer's slice. Pricing the whole buffer for each layer made q/k/v
    offloading of Llama-2-13B on a v5p slice 9 times slower than full remat (41 s
    simulated against 4.4 s)."""
    pytest.importorskip("libtpu", reason="needs the 'tpu' extra")
    layers, rows, width = 8, 1024, 512
    model = eqx.filter_eval_shape(lambda: HostStack(HostSquare(jnp.zeros((layers, width, width)))))
    x = jax.ShapeDtypeStruct((rows, width), jnp.float32)
    strategy = ox.Strategy("offload_x", "device", "device", "remat", names={"x": "offload"})
    step = ox.filter_jit(
        lambda m, x: eqx.filter_grad(lambda m: jnp.mean(m(x) ** 2))(m), strategy=strategy
    )
    estimate = ox.estimate(step, model, x, target="tpu-v5p")
    sim, speeds = _simulation(estimate), _speeds("tpu-v5p")
    assert sim.program is not None
    opcodes = {i.opcode for c in sim.program.computations.values() for i in c.instructions}
    assert {"dynamic-slice-start", "dynamic-update-slice-start"} <= opcodes
    layer_bytes = rows * width * 4
    assert estimate.h2d_bytes == estimate.d2h_bytes == layers * layer_bytes
    for resource, moved, bandwidth in (
        ("h2d", estimate.h2d_bytes, speeds.h2d_bandwidth),
        ("d2h", estimate.d2h_bytes, speeds.d2h_bandwidth),
    ):
        assert sim.busy[resource] == pytest.approx(moved / bandwidth, rel=0.05)


# Lines of the program XLA:GPU (jax 0.11.2) compiled on an attached H100 for the 1B
# decoder's step, shapes made small: an asynchronous in-place update of a stack of saved
# residuals, and a cuBLASLt matmul (XLA picks cuBLASLt when it autotunes on the GPU).
ATTACHED_H100 = """HloModule attached, is_scheduled=true

%fused_dus (p0: f32[16,1024], p1: s32[], p2: f32[1024]) -> f32[16,1024] {
  %p0 = f32[16,1024]{1,0} parameter(0)
  %p2 = f32[1024]{0} parameter(2)
  %b = f32[1,1024]{1,0} bitcast(%p2)
  %p1 = s32[] parameter(1)
  %zero = s32[] constant(0)
  ROOT %dus = f32[16,1024]{1,0} dynamic-update-slice(%p0, %b, %p1, %zero)
}

ENTRY %main (stack: f32[16,1024], i: s32[], row: f32[1024], a: bf16[8192,2048], w: bf16[2048,2048]) -> (f32[16,1024], f32[16,1024], bf16[8192,2048]) {
  %stack = f32[16,1024]{1,0} parameter(0)
  %i = s32[] parameter(1)
  %row = f32[1024]{0} parameter(2)
  %a = bf16[8192,2048]{1,0} parameter(3)
  %w = bf16[2048,2048]{1,0} parameter(4)
  %fusion = f32[16,1024]{1,0} fusion(%stack, %i, %row), kind=kLoop, calls=%fused_dus
  %fusion-start = ((f32[16,1024]{1,0}, s32[], f32[1024]{0}), f32[16,1024]{1,0}, u32[]) fusion-start(%stack, %i, %row), kind=kLoop, calls=%fused_dus
  %fusion-done = f32[16,1024]{1,0} fusion-done(%fusion-start)
  %custom-call = (bf16[8192,2048]{1,0}, s8[33554432]{0}) custom-call(%a, %w), custom_call_target="__cublas$lt$matmul", backend_config={"gemm_backend_config":{"alpha_real":1,"beta":0,"dot_dimension_numbers":{"lhs_batch_dimensions":[],"lhs_contracting_dimensions":["1"],"rhs_batch_dimensions":[],"rhs_contracting_dimensions":["0"]},"epilogue":"DEFAULT"}}
  %product = bf16[8192,2048]{1,0} get-tuple-element(%custom-call), index=0
  ROOT %out = (f32[16,1024]{1,0}, f32[16,1024]{1,0}, bf16[8192,2048]{1,0}) tuple(%fusion, %fusion-done, %product)
}
"""


def test_an_attached_h100s_async_update_and_cublaslt_matmul_are_priced():
    """On the first GPU run the 1B decoder's baseline step simulated 858 ms (measured
    242): an asynchronous in-place update (`fusion-start`) was priced as reading and
    writing its whole 16 GiB stack, and cuBLASLt's matmuls counted no FLOPs (the
    tutorial's optimizer step: 8.9 ms against 56 measured)."""
    module = parse_module(ATTACHED_H100)
    main = module.entry_computation
    sync = instruction_work(module, main, main.by_name["fusion"])
    async_ = instruction_work(module, main, main.by_name["fusion-start"])
    assert async_ == sync
    assert async_.device_bytes == 2 * 1024 * 4 + 4  # the row read and written, the index
    matmul = instruction_work(module, main, main.by_name["custom-call"])
    assert matmul.flops == 2 * 8192 * 2048 * 2048 and not matmul.unpriced
