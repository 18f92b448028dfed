"""Compiling a program for a target: this CPU, or a GPU/TPU without the hardware.

A `Program` is a flat function of array leaves with the memory (and, on a mesh, the
`PartitionSpec`) of each argument and result and its donation: built from an
`ox.filter_jit` step's plan (`program_of_step`) or from a plain function and the memories
given by name (`program_of_function`). `compile_for(program, target, log)` compiles it with
the target's compiler and returns the compiled executable, whose `memory_analysis()` the
memory reports read.

Shardings built on this machine's devices cannot be carried to another target, so a
program names memories and specs, and `compile_for` builds the shardings on the target's
devices: on the same mesh rebuilt there (same axis names, sizes and types) when the
arguments are on a mesh, else on one device. Host-resident arguments and results are
compiled as host memory on every target: on compile-only GPUs their shardings are built on
the abstract mesh and compiled under `jax.set_mesh` (a concrete-mesh `pinned_host`
sharding there silently becomes device memory); the step itself is traced with this
machine's devices in that context (`_evaluated_here`), so what it evaluates while traced
runs here, as it does for the CPU.
"""

import contextlib
import dataclasses
import functools
import os
import re
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from .._base.jax_private import context_mesh, context_mesh_set
from .._declare.placement import MEMORIES
from .._host.compute import (
    check_host_compute,
    compiler_options,
    traced_for,
    writes_in_place,
)
from .._sharding.memory_space import is_host_aval
from .._sharding.mesh import AnyMesh, resolve_mesh
from .callbacks import lower_callbacks_as_zeros_in_deviceless_gpu_compiles
from .compile_memo import compile_once
from .devices import _config_text, mesh_on_target, target_mesh, trace_on_target, uses_abstract_mesh
from .isolated import in_child
from .targets import Target

# The fields of XLA's `memory_analysis()`, each in device and in host memory.
FIELDS = ("temp", "argument", "output", "alias", "generated_code")

_BAD_MEMORY = (
    "ox.memory_report: {where} gives memory {memory!r} for `{path}`; expected one of "
    "'device', 'pinned_host', or None (the argument's own memory kind, or the result's "
    "traced memory space)."
)


@dataclasses.dataclass
class Program:
    """A flat function of array leaves, with where each argument and result lives."""

    # mesh -> the flat function (array leaves in, array leaves out), with `ox.shard`
    # inside it reading `mesh` (the target's) as the step's mesh.
    flat_on: Callable[[Any], Callable[..., list]]
    leaves: list  # array leaves (arrays or ShapeDtypeStructs), the arguments of `flat`
    in_memories: list[str]
    specs: list[PartitionSpec | None]  # over `mesh`; None: replicated
    out_memory: Any  # callable(out_avals) -> list of memories
    donate_argnums: tuple[int, ...]
    mesh: AnyMesh | None = None  # the mesh the arguments are on (rebuilt on the target)
    # callable(out_avals) -> one PartitionSpec per output over `mesh`, or None: the
    # compiler's choice (the output's memory then follows its traced type).
    out_specs: Any = None
    # Of `donate_argnums`, those donated only where the target's host update writes in
    # place (`writes_in_place`): the optimizer state in host memory.
    host_donated: tuple[int, ...] = ()

    def donated_on(self, platform: str, jaxpr: Any) -> tuple[int, ...]:
        """The arguments donated when compiling for `platform`, `jaxpr` the step traced
        for it."""
        if writes_in_place(jaxpr, platform):
            return self.donate_argnums
        return tuple(i for i in self.donate_argnums if i not in self.host_donated)


def _is_dynamic(x: Any) -> bool:
    return isinstance(x, (jax.Array, np.ndarray, np.generic, jax.ShapeDtypeStruct))


def _own_memory(leaf: Any) -> str:
    sharding = getattr(leaf, "sharding", None)
    kind = getattr(sharding, "memory_kind", None)
    return "pinned_host" if kind == "pinned_host" else "device"


def _check_memory(memory: Any, where: str, path: str) -> None:
    if memory is not None and memory not in MEMORIES:
        raise ValueError(_BAD_MEMORY.format(where=where, memory=memory, path=path))


def _broadcast(prefix: Any, full: Any, where: str) -> list:
    """One entry of `prefix` (a pytree prefix of `full`) per array leaf of `full`."""
    if prefix is None or isinstance(prefix, str):
        return [prefix] * len(jax.tree_util.tree_leaves(full))
    try:
        expanded = jax.tree.broadcast(prefix, full, is_leaf=lambda x: x is None)
    except ValueError as e:
        raise ValueError(
            f"ox.memory_report: {where} is not a pytree prefix of the "
            f"{'arguments' if where == 'in_memory' else 'results'} ({e}). Give one memory "
            "per argument (a tuple as long as the arguments), a tree of the same structure, "
            "or a single 'device'/'pinned_host' for all."
        ) from None
    return jax.tree_util.tree_leaves(expanded, is_leaf=lambda x: x is None)


def _spec_on(sharding: Any, mesh: AnyMesh | None) -> PartitionSpec | None:
    if mesh is not None and isinstance(sharding, NamedSharding) and sharding.mesh == mesh:
        return sharding.spec
    return None


def program_of_step(wrapper: Any, args: tuple, kwargs: dict) -> Program:
    """The program an `ox.filter_jit` step compiles for these arguments: its plan's
    memories and specs, its output memories and shardings, its donation."""
    entry, leaves = wrapper.compilation(*args, **kwargs)
    plan = entry.plan
    memories = [
        leaf_plan.memory or _own_memory(leaf) for leaf, leaf_plan in zip(leaves, plan.leaves)
    ]
    mesh = plan.mesh
    # On a mesh, the planned input shardings are the plan's specs, plus the spec a leaf
    # without one already has (a sharded batch), as the step compiles them to run.
    specs = [
        _spec_on(s if s is not None else getattr(leaf, "sharding", None), mesh)
        for leaf, s in zip(leaves, entry.in_shardings)
    ]
    return Program(
        flat_on=entry.flat_on,
        leaves=list(leaves),
        in_memories=memories,
        specs=specs,
        out_memory=lambda out_avals: list(entry.out_memories),
        donate_argnums=tuple(entry.donate_argnums),
        host_donated=tuple(entry.host_donated),
        mesh=mesh,
        # Outputs shaped like an argument keep its shardings (the updated model stays
        # FSDP-sharded); the others are left to the compiler, as when the step runs.
        out_specs=lambda out_avals: [_spec_on(s, mesh) for s in entry.out_shardings],
    )


def _is_jit_object(fn: Any) -> bool:
    # `jax.jit(f)` wraps `f` (so does `jax.grad(f)`, which must not be unwrapped).
    return hasattr(fn, "__wrapped__") and hasattr(fn, "lower") and hasattr(fn, "trace")


def _jit_donation(fn: Any) -> tuple[int, ...]:
    """The arguments a `jax.jit(..., donate_argnums=..., donate_argnames=...)` object
    donates (names resolved to positions by jit). `jax.jit` says it publicly only once
    traced (`trace(...).args_info`); tracing a large step again costs seconds, so its
    options are read (`_jit_info`, private; nothing where a JAX release moves it)."""
    info = getattr(fn, "_jit_info", None) if _is_jit_object(fn) else None
    donated = getattr(info, "donate_argnums", ())
    return tuple(donated) if isinstance(donated, tuple) else ()


def _equinox_donation(fn: Any, count: int) -> tuple[int, ...]:
    """The arguments an `eqx.filter_jit(..., donate=...)` object donates: the first
    (`donate_first`) and the others (`donate_rest`), as it runs."""
    first, rest = getattr(fn, "donate_first", False), getattr(fn, "donate_rest", False)
    if not isinstance(first, bool) or not isinstance(rest, bool):
        return ()
    return tuple(i for i in range(count) if (first if i == 0 else rest))


def program_of_function(
    fn: Callable,
    args: tuple,
    kwargs: dict,
    in_memory: Any,
    out_memory: Any,
    donate_argnums: Sequence[int],
) -> Program:
    """The program of a plain function (or `jax.jit` object), with the memories of its
    arguments and results given by name (`in_memory`, `out_memory`, pytree prefixes)."""
    if not donate_argnums:
        donate_argnums = _jit_donation(fn) or _equinox_donation(fn, len(args))
    if _is_jit_object(fn):
        fn = fn.__wrapped__  # compile the function as given; options replace its shardings
    all_leaves, treedef = jax.tree_util.tree_flatten((args, kwargs))
    mask = [_is_dynamic(x) for x in all_leaves]
    statics = [x for x, m in zip(all_leaves, mask) if not m]
    leaves = [x for x, m in zip(all_leaves, mask) if m]
    requested = _broadcast(in_memory, args, "in_memory") + [None] * len(
        [x for x in jax.tree_util.tree_leaves(kwargs) if _is_dynamic(x)]
    )
    arg_leaves = [x for x in jax.tree_util.tree_leaves(args)]
    requested_dynamic = [r for r, x in zip(requested, arg_leaves) if _is_dynamic(x)]
    requested_dynamic += [None] * (len(leaves) - len(requested_dynamic))
    paths = [
        jax.tree_util.keystr(p)
        for p, x in jax.tree_util.tree_flatten_with_path((args, kwargs))[0]
        if _is_dynamic(x)
    ]
    memories = []
    for memory, leaf, path in zip(requested_dynamic, leaves, paths):
        _check_memory(memory, "in_memory", "args" + path)
        memories.append(memory or _own_memory(leaf))
    donated_args = set(donate_argnums)
    donate = []
    index = 0
    for i, arg in enumerate(args):
        count = sum(1 for x in jax.tree_util.tree_leaves(arg) if _is_dynamic(x))
        if i in donated_args:
            donate.extend(range(index, index + count))
        index += count
    out_cell: list = []

    def flat(*dynamic):
        dynamic_iter, static_iter = iter(dynamic), iter(statics)
        rebuilt = [next(dynamic_iter) if m else next(static_iter) for m in mask]
        call_args, call_kwargs = jax.tree_util.tree_unflatten(treedef, rebuilt)
        out = fn(*call_args, **call_kwargs)
        out_cell[:] = [out]
        # The arrays it returns: an `eqx.nn.MLP` returned whole holds its activation.
        return [x for x in jax.tree_util.tree_leaves(out) if _is_dynamic(x)]

    def out_memories(out_avals):
        requested_out = _broadcast(out_memory, out_cell[0], "out_memory")
        out_leaves = jax.tree_util.tree_leaves(out_cell[0])
        requested_out = [r for r, x in zip(requested_out, out_leaves) if _is_dynamic(x)]
        result = []
        for memory, aval in zip(requested_out, out_avals):
            _check_memory(memory, "out_memory", "output")
            if memory is None:
                memory = "pinned_host" if is_host_aval(aval) else "device"
            result.append(memory)
        return result

    # Arguments on a mesh (placed arrays, or ShapeDtypeStructs with a NamedSharding)
    # keep their specs, on that mesh rebuilt on the target's devices.
    mesh = resolve_mesh([("args", leaves)])
    specs = [_spec_on(getattr(leaf, "sharding", None), mesh) for leaf in leaves]
    return Program(lambda _: flat, leaves, memories, specs, out_memories, tuple(donate), mesh)


# -- compiling for a target ------------------------------------------------------------


# A line of XLA's C++ log ("W1124 07:34:39.803348   20326 file.cc:3231] ...").
_XLA_LOG_LINE = re.compile(r"^[IWEF]\d{4} ")


@contextlib.contextmanager
def compiler_log(lines: list[str]) -> Iterator[None]:
    """XLA's log lines written while the block runs go into `lines`, not the terminal.

    A program over the target's memory makes XLA log "Can't reduce memory use below ..."
    (its rematerialisation gave up) and, on GPU, "The byte size of input/output arguments
    ... exceeds the base limit": expected for such a program, which the report already
    says does not fit (`MemoryReport.compiler_log` keeps them). Anything else written to
    the process's stderr in the meantime is passed on after the block.
    """
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as sink:
        os.dup2(sink.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            sink.seek(0)
            text = sink.read().decode(errors="replace")
            others = [line for line in text.splitlines() if not _XLA_LOG_LINE.match(line)]
            lines.extend(line for line in text.splitlines() if _XLA_LOG_LINE.match(line))
            if others:
                sys.stderr.write("\n".join(others) + "\n")


def _evaluated_here(flat: Callable[..., list], here: Any) -> Callable[..., list]:
    """`flat`, traced with the concrete mesh `here` (the one outside `jax.set_mesh(target
    mesh)`, usually none) as JAX's context, the target's abstract mesh kept.

    A GPU target's program is traced under `jax.set_mesh` of its compile-only devices, and
    JAX runs whatever a step evaluates while traced (`jax.ensure_compile_time_eval`:
    `eqx.nn.RotaryPositionalEmbedding`'s tables, diffrax's `is_successful`) on the context
    mesh's devices: on compile-only ones it fails, "'Executable' object has no attribute
    'local_devices'". The jit around `flat` has taken the target's mesh by then (it
    compiles for it); inside, such values are computed on this machine, as for the CPU
    and TPU targets, and enter the program as constants.
    """

    @functools.wraps(flat)  # the program keeps the step's name
    def traced_here(*leaves: Any) -> list:
        with context_mesh_set(here):
            return flat(*leaves)

    return traced_here


def compile_for(program: Program, target: Target, log: list[str]) -> Any:
    """Compile `program` with `target`'s compiler (no device needed for GPU/TPU), once per
    process for each distinct program (`compile_memo`); XLA's log lines go into `log`
    (`compiler_log`). Host callbacks are compiled out of a GPU target's program
    (`callbacks`): this process has no GPU to register them with."""
    lower_callbacks_as_zeros_in_deviceless_gpu_compiles()
    on_mesh = program.mesh is not None
    if program.mesh is not None:
        mesh = mesh_on_target(target, program.mesh)
    else:
        mesh = target_mesh(target)
    abstract_mesh = uses_abstract_mesh(target)
    sharding_mesh = mesh.abstract_mesh if abstract_mesh else mesh

    def sharding(memory: str, spec: PartitionSpec | None) -> NamedSharding:
        return NamedSharding(sharding_mesh, spec or PartitionSpec(), memory_kind=memory)

    in_shardings = [sharding(m, s) for m, s in zip(program.in_memories, program.specs)]
    abstract = [
        jax.ShapeDtypeStruct(np.shape(leaf), leaf.dtype, sharding=s)
        for leaf, s in zip(program.leaves, in_shardings)
    ]

    flat = program.flat_on(sharding_mesh)
    if abstract_mesh:
        flat = _evaluated_here(flat, context_mesh())

    def compile_with(out_shardings: list | None, isolate: bool = True) -> Any:
        donated = program.donated_on(target.platform, traced.jaxpr)
        xla_options = compiler_options(
            traced.jaxpr, target.platform, _described_memory(target), donated, out_memories
        )
        options: dict[str, Any] = {
            "donate_argnums": donated,
            "keep_unused": bool(donated),  # as the step compiles it (`_jit.compile`)
            "compiler_options": xla_options,
        }
        if out_shardings is not None:
            options["out_shardings"] = out_shardings
        jitted = jax.jit(flat, in_shardings=in_shardings, **options)
        lowered = jitted.trace(*abstract).lower()
        if isolate:  # in a child process while `ox.fit` searches (`isolated`)
            lowered = in_child(lowered, target)
        return compile_once(lowered, target, xla_options, compiler_log, log)

    context = jax.set_mesh(mesh) if abstract_mesh else contextlib.nullcontext()
    with context, traced_for(target.platform):
        traced = trace_on_target(jax.jit(flat, in_shardings=in_shardings), abstract, target)
        check_host_compute(traced.jaxpr, target.platform, f"target {target.name!r}")
        out_avals = traced.jaxpr.out_avals
        out_memories = program.out_memory(out_avals)
        if not on_mesh:
            return compile_with([sharding(m, None) for m in out_memories])
        # On a mesh, an output is sharded as the step would return it: by its planned
        # spec, or as the compiler chooses (None, its memory following its traced type).
        # An output asked for in another memory than its type's gets the spec the
        # compiler chose for it.
        specs = program.out_specs(out_avals) if program.out_specs else [None] * len(out_avals)
        traced_memories = ["pinned_host" if is_host_aval(a) else "device" for a in out_avals]
        if any(s is None and m != t for s, m, t in zip(specs, out_memories, traced_memories)):
            # Compiled here: only JAX's `Compiled` tells the shardings XLA chose.
            chosen = compile_with(None, isolate=False).output_shardings
            specs = [
                s if s is not None or m == t else getattr(c, "spec", PartitionSpec())
                for s, m, t, c in zip(specs, out_memories, traced_memories, chosen)
            ]
        out_shardings = [None if s is None else sharding(m, s) for s, m in zip(specs, out_memories)]
        return compile_with(out_shardings)


def _described_memory(target: Target) -> int | None:
    """The device memory a GPU target's description gives its compiler
    (`device_memory_size`), which XLA:GPU's rematerialization limit starts from."""
    if target.platform != "cuda":
        return None
    found = re.search(r"^\s*device_memory_size:\s*(\d+)", _config_text(target), re.MULTILINE)
    return int(found.group(1)) if found else None


def memory_fields(stats: Any) -> tuple[dict[str, int], dict[str, int]]:
    """`FIELDS` in device memory and in host memory, in bytes, from `memory_analysis()`."""
    device = {f: int(getattr(stats, f"{f}_size_in_bytes", 0) or 0) for f in FIELDS}
    host = {f: int(getattr(stats, f"host_{f}_size_in_bytes", 0) or 0) for f in FIELDS}
    return device, host
