"""Computation placed on the host: `on_host(fn, *args)` and which targets can run it.

`on_host` compiles `fn` as one host computation of the step (JAX's `compute_on` primitive
with `compute_type="device_host"`): XLA:GPU runs it on the host CPU, on the host-memory
buffers, inside the step's program; on a CPU backend it runs where everything runs.

Three things differ from calling `jax.experimental.compute_on.compute_on2` directly:

- `fn` is traced with *device-typed* operands. Inside a host computation every value is in
  host memory, so the distinction means nothing there, but a trace with host-typed
  operands mixes them with the device-typed constants that library code creates
  (`jnp.imag` of a real array is a device-typed zero: optax's global norm fails with
  "memory_space of all inputs passed to `add` must be the same").
- Device-typed operands are sent to host memory explicitly (a `device_put` the audit
  lists) before the call, every result is host-typed, and nothing comes back implicitly.
- Arrays of two or more dimensions are passed flattened to one dimension (and reshaped
  inside the host computation), unless `flatten=False`: device arrays before they are
  sent, host arrays (the gradient of a host-resident parameter) in host memory.
  XLA:GPU rejects a host call whose operand has another layout than the call's
  parameter ("The async-start expects the async shape ... to match"), and a gradient of
  `x @ w` often has the transposed layout;
  a one-dimensional array has only one. On a mesh, flattening would reshard a leaf whose
  later dimensions are sharded, so the caller passes `flatten=False` there.

Equations traced here carry `compute_type="device_host"` in their context, which is how
the audit and the work counter recognise host work.
"""

import contextlib
import contextvars
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.extend as jex
import jax.numpy as jnp
import numpy as np
from jax.core import Tracer, eval_jaxpr

from .._base.jax_private import dce_jaxpr, extend_compute_type, separate_consts
from .._sharding.memory_space import is_host_aval, is_host_typed, labelled, to_host
from .calls import (
    HOST,
    SLICES_SCOPE,
    bind,
    chained,
    device_aval,
    slots_of,
)
from .remat_limit import remat_limit_options

NAME_SCOPE = "ox_host"  # `ox_host[optimizer update]` names a host computation

# The host computations of the optimizer update on the host (`update_on="host"`), and
# the platforms on which they are refused, and why. Measured with the deviceless compilers
# on the update and the sum in one host computation (`tests/test_optimizer_host.py`'s
# scanned model, the refusal bypassed); an earlier probe saw XLA:TPU give the host
# call's operands a linear layout. Building state
# on the host (`_jit.compile`, `_optimizer.state`) is not refused: a stacked model built for
# tpu-v5p that way needs 512 B of device memory (128 MiB on the host).
HOST_UPDATE = (
    "optimizer update",
    "apply updates",
    "optimizer update and apply",
    "delayed optimizer update",
    "delayed optimizer update and apply",
)
# The name scope of a delayed update's host computation (`ox.offload_optimizer(...,
# delay=1)`): it reads nothing the step computes, so XLA runs it beside the forward and
# backward passes, and the work counter prices it there.
DELAYED = "delayed "
DELAYED_SCOPE = f"{NAME_SCOPE}[{DELAYED}"
HOST_UPDATE_PROBLEMS: dict[str, str] = {
    "tpu": (
        "XLA:TPU gains nothing from it: under 'hybrid', on a model of 8 scanned layers "
        "of 1024x1024 (deviceless tpu-v5p), the host update needs 66.84 MiB of device "
        "memory against 24.19 MiB for the device update with `stream='layer'` (h100: "
        "12.00 against 29.01 MiB)"
    ),
}


def host_update_problem(platform: str) -> str | None:
    """Why the optimizer update on the host is refused on `platform` (`"cuda"`, `"tpu"`,
    `"cpu"`), if it is."""
    return HOST_UPDATE_PROBLEMS.get(platform)


_TRACED_FOR: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "offload_eqx_traced_for", default=None
)


@contextlib.contextmanager
def traced_for(platform: str) -> Iterator[None]:
    """Trace for `platform` (a deviceless compile for a target): what `traced_platform`
    answers inside."""
    token = _TRACED_FOR.set(platform)
    try:
        yield
    finally:
        _TRACED_FOR.reset(token)


def deviceless_platform() -> str | None:
    """The platform a deviceless compile is tracing and lowering for (`traced_for`),
    None outside one."""
    return _TRACED_FOR.get()


def traced_platform() -> str:
    """The platform the program being traced will be compiled for: a deviceless
    compile's target (`traced_for`), else JAX's default backend. JAX lowers a host
    computation for "cpu" on every platform (`jax.lax.platform_dependent` inside one
    picks the CPU branch in an XLA:GPU program too), so code that differs by platform
    inside one decides here, when it is traced."""
    return _TRACED_FOR.get() or jax.default_backend()


def host_inline(platform: str) -> bool:
    """Whether a host computation is inlined in the step on `platform`: XLA:CPU compiles
    it with the rest of the program, on the same memory, so its results can be written
    into donated arguments in place. XLA:GPU runs it as a host call of its own, whose
    results get buffers of their own."""
    return platform == "cpu"


def writes_in_place(jaxpr: Any, platform: str) -> bool:
    """Whether the host update of a traced step can write the state into its donated
    arguments on `platform` without holding a second copy: inlined (XLA:CPU), or split
    into chained calls (`on_host(split=True)`: one update's name on several host
    computations, or in slices), each of whose temporaries is one group's (or none)."""
    if host_inline(platform):
        return True
    found = [(name, stack) for name, stack in _host_stacks(jaxpr) if name in HOST_UPDATE]
    names = [name for name, _ in found]
    # A group computed in slices writes over the state even where it is the only call.
    sliced = any(SLICES_SCOPE in stack for _, stack in found)
    return sliced or any(names.count(name) > 1 for name in set(names))


def has_delayed_update(jaxpr: Any) -> bool:
    """Whether a traced step has a delayed host update (`delay=1`), which XLA:GPU
    overlaps with the passes."""
    return any(name.startswith(DELAYED) for name in host_computations(jaxpr))


def fetched_from_host(jaxpr: Any) -> tuple[bool, ...]:
    """For each output of a traced step with a delayed host update (the update XLA:GPU
    overlaps with the passes, `compiler_options`), whether it is a host value fetched
    to the device as it is (a parameter's new value cast from its master on the host,
    not an update added on the device); all False in a step without one. XLA:GPU gives
    such a result a device buffer of its own from the call's start, so donating the old
    value's buffer only adds copies (`Plan.donated`)."""
    if not has_delayed_update(jaxpr):
        return (False,) * len(jaxpr.outvars)
    producers = {var: eqn for eqn in jaxpr.eqns for var in eqn.outvars}

    def fetched(var: Any) -> bool:
        eqn = producers.get(var)
        if eqn is None or eqn.primitive.name != "device_put" or is_host_aval(var.aval):
            return False
        return is_host_aval(eqn.invars[list(eqn.outvars).index(var)].aval)

    return tuple(fetched(var) for var in jaxpr.outvars)


def check_host_compute(jaxpr: Any, platform: str, where: str) -> None:
    """Raise a `ValueError` if the traced step updates its optimizer state on the host
    and `platform` refuses that: decided when the step is compiled, never a silent
    fallback to the device."""
    problem = host_update_problem(platform)
    if problem is None or not set(host_computations(jaxpr)) & set(HOST_UPDATE):
        return
    raise ValueError(
        f"The step computes on the host (`ox.offload_optimizer(update_on='host')`, or a "
        f"strategy with update='host'), which {where} does not support: {problem}. For "
        "this target update on the device: `ox.offload_optimizer(tx)` (with "
        "`stream='leaf'` or `'layer'` to fetch the state piece by piece), or a strategy "
        "with update='device'."
    )


# XLA:GPU compiles a host computation to an async pair on the host thread
# (`custom-call-start` / `custom-call-done`). Its default scheduler puts the two side by
# side, so the device waits for the host even when nothing orders them; the
# latency-hiding scheduler places independent device work between them, provided it may
# keep enough async computations in flight: the fetches and sends of host-resident layers
# inside the loops count as async computations too. Measured deviceless on h100 with a
# delayed host update under a hybrid plan: 8 scanned 1024^2 layers need a limit of 3 for
# the host call to span both loops; Llama-2-13B's 40 layers (seven weights each) need
# more than 4, and with 16 (or 64) the call spans the backward loop. The scheduler gives a host
# call a fixed latency, not its cost, so it stops widening the span once a long loop
# covers that latency: at 13B the call starts after the forward loop.
OVERLAP_OPTIONS: dict[str, Any] = {
    "xla_gpu_enable_latency_hiding_scheduler": True,
    "xla_gpu_experimental_parallel_async_compute_limit": 16,
}


def compiler_options(
    jaxpr: Any,
    platform: str,
    device_memory: int | None = None,
    donated: Sequence[int] | None = None,
    out_memories: Sequence[str] | None = None,
) -> dict[str, Any] | None:
    """The XLA options a step is compiled with (None: the defaults), on XLA:GPU
    (`platform` `"cuda"` for a target, `"gpu"` for a device):

    - `OVERLAP_OPTIONS` for a step with a delayed host update, so that its host
      computation overlaps the loops. An undelayed host update waits for every gradient,
      so there is nothing to overlap, and the scheduler's extra prefetching costs device
      memory (the 8B decoder's hybrid host update, h100: 2.29 GiB under these options,
      1.83 GiB without).
    - For a step that holds host memory, the rematerialization limit raised by the host
      bytes XLA:GPU charges to the device (`remat_limit`), so that XLA recomputes no
      work the plan did not ask for while the device's own buffers are held to the limit
      they had. `device_memory` is the memory the compiler's target description gives
      (deviceless compiles; None on a GPU, whose allocator limit is read), `donated` the
      donated arguments and `out_memories` each result's memory when the compile places
      results itself (None: as traced)."""
    options: dict[str, Any] = {}
    if platform in ("cuda", "gpu") and has_delayed_update(jaxpr):
        options.update(OVERLAP_OPTIONS)
    options.update(remat_limit_options(jaxpr, platform, device_memory, donated, out_memories))
    return options or None


def is_host_computation(eqn: Any) -> bool:
    """Whether a jaxpr equation is a host computation (or an equation inside one)."""
    if eqn.primitive.name == "compute_on" and eqn.params.get("compute_type") == HOST:
        return True
    return getattr(getattr(eqn, "ctx", None), "compute_type", None) == HOST


def host_computations(jaxpr: Any) -> list[str]:
    """The name of every host computation of a (closed) jaxpr, at any depth
    (`"optimizer update"`; "host computation" where none was given)."""
    return [name for name, _ in _host_stacks(jaxpr)]


def _host_stacks(jaxpr: Any) -> list[tuple[str, str]]:
    """`(name, name stack)` of every host computation of a (closed) jaxpr, at any depth."""
    found = []
    for eqn in getattr(jaxpr, "jaxpr", jaxpr).eqns:
        if eqn.primitive.name == "compute_on" and eqn.params.get("compute_type") == HOST:
            stack = str(eqn.source_info.name_stack)
            start = stack.rfind(NAME_SCOPE + "[")
            name = stack[start + len(NAME_SCOPE) + 1 :].split("]")[0] if start >= 0 else ""
            found.append((name, stack))
            continue
        for sub in jex.core.jaxprs_in_params(eqn.params):
            found.extend(_host_stacks(sub))
    return found


def _separate_consts(closed: Any) -> tuple[Any, list]:
    return separate_consts(closed)


def _sharded_in_type(x: Any) -> bool:
    """Whether `x`'s type names mesh axes (Explicit sharding): a reshape of it must say
    how the result is sharded, so it is not flattened."""
    spec = getattr(getattr(jax.typeof(x), "sharding", None), "spec", None) or ()
    return any(entry is not None for entry in spec)


def on_host(
    fn: Callable[..., Any],
    *args: Any,
    flatten: bool = True,
    name: str = "host computation",
    labels: tuple[tuple[str, str], ...] = (),
    split: bool = False,
    sliced: bool = False,
    reuse: dict[int, int] | None = None,
    slice_all: bool = False,
) -> Any:
    """`fn(*args)` computed on the host; every array result is host-typed, and Python
    values among the results (an optimizer state's int or string) come back as they are.

    With `split`, the computation is one call per group of results that read the same
    large operands, each call after the one before (`host_split`): what lets XLA:GPU
    write the results into donated arguments holding one group's temporaries at a time.

    With `sliced` too, a group whose results exceed `host_chunks.CHUNK_BYTES` and that is
    elementwise is computed a slice at a time (`host_chunks`), each slice's results
    written over the arrays they replace: `reuse[i] = j` says that result `i` (of a
    tuple) replaces `args[j]`, leaf by leaf (their paths match), e.g. the state the
    computation updates, donated by the step; a result that replaces nothing gets a
    buffer of its own. Unflattened operands (on a mesh) are not sliced. With
    `slice_all`, every elementwise group is computed in slices (at least
    `calls.LEAST_SLICES`), however small: a delayed update's, whose whole results
    XLA:GPU's latency-hiding scheduler copies into the state all at once, after the
    last call.

    `name` labels the computation in the audit; `labels[i] = (kind, root)` labels what
    is sent of `args[i]` (`("gradient", "grads")` reports `grads.w1` as a gradient).

    Array leaves of `args` are the computation's operands (device-typed ones are sent to
    host memory first, explicitly, flattened to one dimension when `flatten`); other
    leaves are constants of the computation.
    """
    dynamic, static = eqx.partition(args, eqx.is_array)
    with_path, treedef = jax.tree_util.tree_flatten_with_path(dynamic)
    shapes = [np.shape(x) for _, x in with_path]
    sent = []
    for path, x in with_path:
        flat = flatten and np.ndim(x) >= 2 and not _sharded_in_type(x)
        if not is_host_typed(x):
            index = getattr(path[0], "idx", 0)
            kind, root = labels[index] if index < len(labels) else ("input", f"args[{index}]")
            with labelled(kind, root + jax.tree_util.keystr(path[1:])):
                x = to_host(x.reshape(-1) if flat else x)
        elif flat:
            x = x.reshape(-1)  # in host memory: a host-typed gradient keeps its layout
        sent.append(x)

    # Python values among the results (an optimizer state's int or string) are not the
    # computation's: they come back as `fn` returned them.
    values: list = []

    def flat_fn(*flat):
        restored = [x.reshape(shape) for x, shape in zip(flat, shapes)]
        out = fn(*eqx.combine(jax.tree_util.tree_unflatten(treedef, restored), static))
        arrays, out_values = eqx.partition(out, eqx.is_array)
        values.append(out_values)
        return arrays

    with extend_compute_type(HOST):
        closed, out_shape = jax.make_jaxpr(flat_fn, return_shape=True)(
            *[device_aval(x) for x in sent]
        )
    jaxpr, consts = closed, []
    if any(isinstance(c, Tracer) for c in closed.consts):
        # `fn` closes over values of the enclosing trace: they become operands, sent to
        # host memory like the others (as `compute_on2` does).
        jaxpr, consts = _separate_consts(closed)
        consts = [to_host(c) for c in consts]
    scope = f"{NAME_SCOPE}[{name}]"
    with jax.named_scope(scope):
        if split:
            slots = slots_of(out_shape, with_path, reuse or {}, len(consts))
            outs = chained(
                jaxpr, [*consts, *sent], slots, scope, sliced and flatten, slice_all and flatten
            )
        else:
            outs = bind(jaxpr, [*consts, *sent])
    arrays = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(out_shape), outs)
    return eqx.combine(arrays, values[0])


def _nbytes(x: Any) -> int:
    return int(np.prod(np.shape(x), dtype=np.int64)) * x.dtype.itemsize


def on_host_if_cheap(
    fn: Callable[..., Any],
    operands: list,
    limit: int,
    name: str = "host computation",
    flatten: bool = True,
) -> list | None:
    """`fn(*operands)` (a list of arrays) computed on the host, when the operands it
    actually reads that are in device memory add up to at most `limit` bytes (a PRNG
    key: a model built from it is computed where it will live); None otherwise, for the
    caller to compute on the device. Operands `fn` does not read are not sent."""
    closed = jax.make_jaxpr(fn)(*[device_aval(x) for x in operands])
    jaxpr, used = dce_jaxpr(closed.jaxpr, [True] * len(closed.jaxpr.outvars))
    read = [x for x, u in zip(operands, used) if u]
    if sum(_nbytes(x) for x in read if not is_host_typed(x)) > limit:
        return None
    consts = closed.consts

    def run(*kept: Any) -> list:
        # A literal result (a constant flag) evaluates to a Python scalar: an array here.
        return [jnp.asarray(x) for x in eval_jaxpr(jaxpr, consts, *kept)]

    return on_host(run, *read, name=name, flatten=flatten)
