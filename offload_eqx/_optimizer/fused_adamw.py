"""`optax.adam` / `optax.adamw` on float32 masters in one in-place pass, one call for all leaves.

XLA:CPU compiles an update as one loop per result: Adam's `mu`, `nu`, the master and the
parameter cast from it are four passes over memory, 42 bytes a bfloat16 parameter, with
a division and a square root per element in two of them. The host kernel `adamw`
(`offload_eqx/_host/kernels/adamw.cc`), called once for every leaf, reads the gradient, the
master and both moments once and writes the moments and the master in place and the
parameter beside them: 28 bytes, on every thread of XLA's intra-op pool.

It replaces `MasterUpdate.values` where all of these hold, and nothing else:
- the transformation is `optax.adam` or `optax.adamw` as optax 0.2 builds them (any
  learning rate or schedule, weight decay a number, its mask a tree or a function, Adam
  without Nesterov momentum, `mu_dtype` None or float32), recognised from the functions
  optax chains (`recognise`), alone or last in an `optax.chain` after
  `optax.clip_by_global_norm` (the clipping runs as optax computes it, then the kernel;
  with bfloat16 gradients); anything else (`optax.MultiSteps`, a chain of your own)
  runs as XLA compiles it;
- the masters and both moments are float32, the gradients and parameters bfloat16 or
  float32;
- the program is traced for the CPU, or for a GPU whose CUDA plugin's host compiler is
  proven to find the kernel (`_host.compute.traced_platform`, `_host.kernels.gpu_host`:
  XLA:GPU compiles its host computations with an XLA:CPU inside the plugin, with an FFI
  registry of its own); an XLA:TPU program's host update runs as XLA compiles it;
- the kernel was built when offload_eqx was installed and passes its checks
  (`ox.host_kernels()`).

On the CPU the kernel is one call for every leaf, on XLA:CPU's thread pool. In an
XLA:GPU program it is one call per leaf, so that the host update can be split into one
host call per parameter, or computed a slice at a time (`_host.calls`), and written over
the donated state.

Equal to XLA, bit for bit. The scalars of the step (the bias corrections `1 - b**t`, the
learning rate at this count) are computed with the same XLA operations optax uses, in
the same program. The elementwise operations are the float32 operations XLA:CPU compiles
optax's update to, with the same roundings: XLA's simplifier merges or inverts optax's
divisions (`merged`: it merges them where the bias corrections serve more than one
leaf), and LLVM contracts some multiply-adds into one rounding where the processor has
fused multiply-add instructions (which ones depends on whether the gradient is loaded or
computed in the loop: `computed`). `adamw.cc` says each, and the tests hold the kernel to
XLA's own update of the same step, element for element, NaN, infinity and subnormal
gradients included.
"""

import contextlib
import contextvars
import dataclasses
import numbers
import os
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from .._base.jax_private import current_compute_type
from .._host.calls import HOST
from .._host.compute import host_inline, traced_platform
from .._host.kernels import gpu_host
from .._host.kernels.load import target
from .state import is_none

_SUPPORTED = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))
_OPTAX_ONLY = contextvars.ContextVar("offload_eqx_optax_only", default=False)
_WHOLE: contextvars.ContextVar[tuple[bool, bool] | None] = contextvars.ContextVar(
    "offload_eqx_whole_update", default=None
)


@contextlib.contextmanager
def optax_only() -> Iterator[None]:
    """Trace updates with optax's own operations, not the kernel: for the checks that
    read what a transformation computes from what (`checks.check_per_leaf`,
    `checks.check_elementwise`); the kernel computes the same, element by element."""
    token = _OPTAX_ONLY.set(True)
    try:
        yield
    finally:
        _OPTAX_ONLY.reset(token)


@contextlib.contextmanager
def as_whole_update(leaves: int, clipped: bool) -> Iterator[None]:
    """Trace the kernel's calls with the roundings of the whole tree's update, which a
    stream computes one leaf (or one slice) at a time: XLA merges the bias corrections'
    divisions where they serve more than one of the whole tree's `leaves` (of at least
    one element), and computes a gradient `clipped` by a global transformation
    (`global_transform=optax.clip_by_global_norm(...)`) inside the moments' loop. The
    stream's parameters are then the whole update's, bit for bit."""
    token = _WHOLE.set((leaves > 1, clipped))
    try:
        yield
    finally:
        _WHOLE.reset(token)


@dataclasses.dataclass(frozen=True)
class AdamW:
    """The hyperparameters of a recognised `optax.adam(w)`: `learning_rate` a number or
    a schedule of the count; `weight_decay` None without decay; `mask` optax's mask (a
    tree, a function of the updates, or None: every leaf); `prefix` what an
    `optax.chain` applies before it (`clip_by_global_norm`)."""

    b1: float
    b2: float
    eps: float
    eps_root: float
    learning_rate: Any
    weight_decay: float | None
    mask: Any
    prefix: tuple = ()  # update functions of an `optax.chain` before it, run as they are


def _cells(fn: Any) -> dict[str, Any]:
    code, closure = getattr(fn, "__code__", None), getattr(fn, "__closure__", None)
    if code is None or closure is None:
        return {}
    try:
        return {name: cell.cell_contents for name, cell in zip(code.co_freevars, closure)}
    except ValueError:  # an empty cell
        return {}


def _is(fn: Any, qualname: str, module: str) -> bool:
    return getattr(fn, "__qualname__", None) == qualname and getattr(
        fn, "__module__", ""
    ).startswith(module)


def _unwrapped(fn: Any) -> Any:
    """The update function inside optax's `with_extra_args_support` wrapper."""
    if _is(fn, "with_extra_args_support.<locals>.update", "optax"):
        return getattr(_cells(fn).get("tx"), "update", None)
    return fn


def _number(x: Any) -> bool:
    return isinstance(x, numbers.Real | np.floating) and not isinstance(x, bool)


def _adam(fn: Any) -> dict | None:
    cells = _cells(fn)
    if not _is(fn, "scale_by_adam.<locals>.update_fn", "optax"):
        return None
    names = ("b1", "b2", "eps", "eps_root")
    if not all(_number(cells.get(n)) for n in names) or cells.get("nesterov") is not False:
        return None
    mu_dtype = cells.get("mu_dtype")
    if mu_dtype is not None and jnp.dtype(mu_dtype) != jnp.float32:
        return None
    return {n: float(cells[n]) for n in names}


def _decay(fn: Any) -> tuple[float, Any] | None:
    """`(weight decay, mask)` of optax's `add_decayed_weights`, masked or not."""
    mask = None
    if _is(fn, "masked.<locals>.update_fn", "optax"):
        cells = _cells(fn)
        mask, fn = cells.get("mask"), _unwrapped(getattr(cells.get("inner"), "update", None))
        if mask is None:
            return None
    if not _is(fn, "add_decayed_weights.<locals>.update_fn", "optax"):
        return None
    decay: Any = _cells(fn).get("weight_decay")
    return (float(decay), mask) if _number(decay) else None


def _learning_rate(fn: Any) -> Any:
    """The learning rate of optax's `scale_by_learning_rate`: a number or a schedule."""
    cells = _cells(fn)
    if _is(fn, "scale.<locals>.update_fn", "optax") and _number(cells.get("step_size")):
        return -float(cells["step_size"])
    if _is(fn, "scale_by_schedule.<locals>.update_fn", "optax"):
        step = cells.get("step_size_fn")
        inner = _cells(step)
        if _is(step, "scale_by_learning_rate.<locals>.<lambda>", "optax") and inner.get("m") == -1:
            return inner.get("learning_rate")
    return None


def _adam_chain(update: Any) -> AdamW | None:
    parts = _cells(update).get("update_fns")
    if not isinstance(parts, tuple) or len(parts) not in (2, 3):
        return None
    parts = tuple(_unwrapped(p) for p in parts)
    adam = _adam(parts[0])
    learning_rate = _learning_rate(parts[-1])
    decay = _decay(parts[1]) if len(parts) == 3 else (None, None)
    if adam is None or learning_rate is None or decay is None:
        return None
    if not (_number(learning_rate) or callable(learning_rate)):
        return None
    weight_decay, mask = decay
    if weight_decay == 0.0:  # optax skips a decay of zero altogether
        weight_decay = None
    return AdamW(learning_rate=learning_rate, weight_decay=weight_decay, mask=mask, **adam)


def recognise(tx: Any) -> AdamW | None:
    """The hyperparameters of `tx` if it is `optax.adam(...)` or `optax.adamw(...)` as
    optax builds them, or `optax.chain(..., adamw)` (a global transform before it:
    `prefix`, run as optax runs it), else None (see the module docstring)."""
    update = getattr(tx, "update", None)
    spec = _adam_chain(update)
    if spec is not None:
        return spec
    parts = _cells(update).get("update_fns")
    if not isinstance(parts, tuple) or len(parts) < 2:
        return None
    spec = _adam_chain(parts[-1])
    if spec is None or not all(_is_clip(p) for p in parts[:-1]):
        return None
    return dataclasses.replace(spec, prefix=parts[:-1])


def clips_first(global_transform: Any, tx: Any) -> bool:
    """Whether `optax.chain(global_transform, tx)` is a clipping the kernel recognises
    before `optax.adam(w)`."""
    spec = recognise(optax.chain(global_transform, tx))
    return spec is not None and bool(spec.prefix)


def _is_clip(update: Any) -> bool:
    """Whether `update` is optax's `clip_by_global_norm`: the one transformation before
    Adam whose arithmetic the kernel is held to (`adamw.cc`: XLA computes the clipped
    gradient inside the moments' loop, and contracts as it does for a widened one)."""
    return _is(_unwrapped(update), "clip_by_global_norm.<locals>.update_fn", "optax")


def _decayed(spec: AdamW, wide: Any) -> list[bool] | None:
    """Whether weight decay applies, leaf by leaf of `wide` (None: a mask that is not
    made of Python booleans, which the kernel cannot follow)."""
    if spec.weight_decay is None:
        return [False] * len(jax.tree_util.tree_leaves(wide))
    if spec.mask is None:
        return [True] * len(jax.tree_util.tree_leaves(wide))
    mask = spec.mask(wide) if callable(spec.mask) else spec.mask
    flags = jax.tree_util.tree_map(
        lambda m, sub: jax.tree_util.tree_map(lambda _: m, sub), mask, wide
    )
    leaves = jax.tree_util.tree_leaves(flags)
    if not all(isinstance(f, bool | np.bool_) for f in leaves):
        return None
    return [bool(f) for f in leaves]


def _states(state: Any) -> tuple[Any, Any] | None:
    """`(Adam's state, the schedule's state or None)` of an `optax.adam(w)` state."""
    if not isinstance(state, tuple) or not state:
        return None
    adam, last = state[0], state[-1]
    if not isinstance(adam, optax.ScaleByAdamState):
        return None
    return adam, last if isinstance(last, optax.ScaleByScheduleState) else None


def _scalars(spec: AdamW, adam: Any, schedule: Any, merged: bool, computed: bool) -> jax.Array:
    """The kernel's scalars, computed as optax computes them (`tree_bias_correction`,
    `scale_by_learning_rate`); `merged`: XLA merges the bias corrections' divisions into
    one, as it does where they serve more than one leaf; `computed`: the gradient is
    computed in the moments' loop (clipped there), not loaded (`adamw.cc`)."""
    count: Any = optax.safe_increment(adam.count)
    c1 = (1 - spec.b1**count).astype(jnp.float32)
    c2 = (1 - spec.b2**count).astype(jnp.float32)
    if schedule is None:
        step = jnp.asarray(-1 * spec.learning_rate, jnp.float32)
    else:
        step = jnp.asarray(-1 * spec.learning_rate(schedule.count), jnp.float32)
    wd = 0.0 if spec.weight_decay is None else spec.weight_decay
    f32 = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
    b1, b2 = spec.b1, spec.b2
    return jnp.stack(
        [f32(1 - b1), f32(b1), f32(1 - b2), f32(b2), c1, c2]
        + [f32(spec.eps_root), f32(spec.eps), f32(wd), step, f32(float(merged))]
        + [f32(float(computed))]
    )


def xla_contracts() -> bool:
    """Whether XLA:CPU lets LLVM contract multiply-adds in this process: not where
    `XLA_FLAGS` turns its backend's optimisations off (`--xla_backend_optimization_level=0`),
    which compiles every float operation rounded on its own."""
    for flag in os.environ.get("XLA_FLAGS", "").split():
        name, _, value = flag.partition("=")
        if name == "--xla_backend_optimization_level" and value.strip() == "0":
            return False
    return True


# From jax 0.11, XLA:CPU contracts a rank-0 leaf's multiply-adds even with its
# optimisations off (its scalar code is emitted apart from its loops), the gradient's
# product in the moments whatever the gradient's type.
_SCALARS_CONTRACT = tuple(int(p) for p in jax.__version__.split(".")[:2]) >= (0, 11)


def _flags(decayed: list[bool], masters: list) -> np.ndarray:
    """The kernel's `flags` per leaf (`adamw.cc`): bit 0 weight decay, bit 1 contracted
    as XLA contracts, bit 2 the gradient's product contracted even where widened."""
    everywhere = xla_contracts()
    flags = []
    for decays, master in zip(decayed, masters):
        scalar = not everywhere and _SCALARS_CONTRACT and master.ndim == 0
        flags.append(int(decays) | 2 * int(everywhere or scalar) | 4 * int(scalar))
    return np.asarray(flags, np.int8)


_KERNEL_PLATFORMS = ("cpu", "cuda", "gpu")


def _target(name: str, platform: str) -> str | None:
    """Kernel `name`'s XLA target for the code being traced on `platform`: the CPU's
    (where the device is this CPU too), or a GPU's host computation's; None for a GPU's
    device code (the update on the device, `optimizer=device` in a plan)."""
    if platform == "cpu":
        return target(name)
    return gpu_host.target(name) if current_compute_type() == HOST else None


def _call(name: str, leaves: list[list], s: jax.Array, flags: np.ndarray) -> list[tuple]:
    """`(new master, mu, nu, parameter)` per leaf: one kernel call for every leaf where
    the host computation is inlined (XLA:CPU), else one call per leaf."""
    if host_inline(traced_platform()) or len(leaves[0]) < 2:
        return _one_call(name, leaves, s, flags)
    return [
        _one_call(name, [[part[i]] for part in leaves], s, flags[i : i + 1])[0]
        for i in range(len(leaves[0]))
    ]


def _one_call(name: str, leaves: list[list], s: jax.Array, flags: np.ndarray) -> list[tuple]:
    """One kernel call for `leaves`: `(new master, mu, nu, parameter)` per leaf."""
    grads, masters, mus, nus, likes = leaves
    operands, results, aliases = [s], [], {}
    for i, (g, m, mu, nu, like) in enumerate(zip(grads, masters, mus, nus, likes)):
        operands += [g, m, mu, nu]
        results += [jax.ShapeDtypeStruct(m.shape, jnp.float32)] * 3
        results.append(jax.ShapeDtypeStruct(m.shape, like.dtype))
        aliases.update({1 + 4 * i + k: 4 * i + k - 1 for k in (1, 2, 3)})
    call = jax.ffi.ffi_call(name, results, input_output_aliases=aliases)
    outs = call(*operands, flags=flags)
    return [tuple(outs[4 * i : 4 * i + 4]) for i in range(len(grads))]


def _supported(grads: list, masters: list, mus: list, nus: list, likes: list) -> bool:
    return (
        all(jnp.dtype(g.dtype) in _SUPPORTED for g in grads)
        and all(jnp.dtype(p.dtype) in _SUPPORTED for p in likes)
        and all(x.dtype == jnp.float32 for x in masters + mus + nus)
        and all(g.shape == m.shape == p.shape for g, m, p in zip(grads, masters, likes))
    )


def _by_master(master: Any, trees: tuple) -> tuple[Any, list[int], list[list]] | None:
    """`(the masters' structure, None leaves included; the positions of the masters;
    each tree's leaves at those positions)`, None where a tree has another structure."""
    structure = jax.tree_util.tree_structure(master, is_leaf=is_none)
    leaves = jax.tree_util.tree_leaves(master, is_leaf=is_none)
    kept = [i for i, x in enumerate(leaves) if x is not None]
    try:
        flat = [structure.flatten_up_to(t) for t in trees]
    except (ValueError, TypeError):
        return None
    if any(flat_tree[i] is None for flat_tree in flat for i in kept):
        return None
    return structure, kept, [[flat_tree[i] for i in kept] for flat_tree in flat]


def fused_values(
    tx: Any,
    grads: Any,
    master: Any,
    inner: Any,
    like: Any,
    extra_args: dict,
    otherwise: Callable[[], Any],
) -> Any:
    """`(new parameter values, new masters, new inner state)` of `tx` applied to the
    masters, by the host kernel where it applies (the module docstring), else
    `otherwise()` (which computes the same with optax)."""
    spec = recognise(tx)
    if spec is None or _OPTAX_ONLY.get() or traced_platform() not in _KERNEL_PLATFORMS:
        return otherwise()
    adam_inner = inner[-1] if spec.prefix else inner
    states = _states(adam_inner)
    if states is None or (spec.prefix and len(inner) != len(spec.prefix) + 1):
        return otherwise()
    adam, schedule = states
    found = _by_master(master, (grads, master, adam.mu, adam.nu, like))
    if found is None or not _supported(*found[2]):
        return otherwise()
    if spec.prefix and any(g.dtype != jnp.bfloat16 for g in found[2][0]):
        # XLA contracts a clipped float32 gradient's moments otherwise than the kernel
        # computes them: the update stays XLA's, bit for bit the definition.
        return otherwise()
    wide = jax.tree_util.tree_map(lambda g: g.astype(jnp.float32), grads)
    decayed = _decayed(spec, wide)
    name = _target("adamw", traced_platform())
    if name is None or decayed is None or len(decayed) != len(found[1]):
        return otherwise()
    prefix_states = []
    if spec.prefix:  # the global transform, as optax computes it, on the widened gradients
        for update, state in zip(spec.prefix, inner[:-1]):
            wide, state = update(wide, state, master, **extra_args)
            prefix_states.append(state)
        found = _by_master(master, (wide, master, adam.mu, adam.nu, like))
        if found is None or not _supported(*found[2]):
            return otherwise()
    structure, kept, leaves = found
    # Called by a stream on one leaf, the kernel rounds as the whole tree's update does.
    merged, clipped = _WHOLE.get() or (sum(1 for m in leaves[1] if m.size) > 1, False)
    s = _scalars(spec, adam, schedule, merged, bool(spec.prefix) or clipped)
    outs = _call(name, leaves, s, _flags(decayed, leaves[1])) if leaves[0] else []
    values, new_master, new_adam = _assemble(structure, kept, adam_inner, adam, schedule, outs)
    return values, new_master, (*prefix_states, new_adam) if spec.prefix else new_adam


def _assemble(structure: Any, kept: list[int], inner: Any, adam: Any, schedule: Any, outs: list):
    """The kernel's results as `otherwise` returns them, in the masters' structure."""

    def tree(i):
        leaves: list = [None] * structure.num_leaves
        for position, out in zip(kept, outs):
            leaves[position] = out[i]
        return jax.tree_util.tree_unflatten(structure, leaves)

    new_master, mu, nu, values = (tree(i) for i in range(4))
    new_adam = adam._replace(count=optax.safe_increment(adam.count), mu=mu, nu=nu)
    new_inner = [new_adam, *inner[1:]]
    if schedule is not None:
        new_inner[-1] = schedule._replace(count=optax.safe_increment(schedule.count))
    return values, new_master, tuple(new_inner)
