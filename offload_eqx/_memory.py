"""Memory reports: what a step needs in each memory space, compiled for a chosen target.

`ox.memory_report(fn, *args, target="h100")` compiles `fn` for the target (this CPU, or an
H100/TPU without the hardware, see `_targets.py`) and reads XLA's `memory_analysis()`: temp,
argument, output and alias bytes, in device and in host memory. The device total is the one
JAX's host-offloading tutorial prints: temp + argument + output - alias.

Arguments may be arrays or `jax.ShapeDtypeStruct`s (for example from
`eqx.filter_eval_shape`), so a model far larger than this machine's memory can be planned
without allocating it.

- An `ox.filter_jit` function is compiled from its plan: each array leaf in its planned
  memory, each output in the memory of its traced type, the same donation.
- Any other function (a plain function, or the function inside a `jax.jit`) is compiled as
  given. Shardings built on this machine's devices cannot be carried to another target, so
  the memory of each argument and result is given by name instead: `in_memory` and
  `out_memory` are pytree prefixes of the arguments and of the results holding
  `"device"`/`"pinned_host"` (or `None`: an argument's own memory kind, a result's traced
  memory space), and `donate_argnums` is `jax.jit`'s.

Arguments on a mesh (arrays placed over a mesh of this machine's devices, or
`ShapeDtypeStruct`s with `NamedSharding`s on one) are compiled on the same mesh rebuilt on
the target's devices: the same axis names, sizes and types, so the target must have as many
devices as the mesh (`"h100-8"` for a (2, 4) mesh, `"tpu-v5p-4"` for (1, 4) or (4,)). Inputs
are sharded by the plan's specs, outputs by `Compilation.out_shardings` (an output shaped
like an argument keeps its shardings; others are left to the compiler, as when the step
runs). XLA analyses an SPMD program per device, so every byte reported is one device's.

Host-resident arguments and results are compiled as host memory on every target: on
compile-only GPUs their shardings are built on the abstract mesh and compiled under
`jax.set_mesh` (a concrete-mesh `pinned_host` sharding there silently becomes device memory).
"""

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from ._jit import _JitWrapper
from ._mesh import AnyMesh, resolve_mesh
from ._placement import MEMORIES
from ._plan import Plan
from ._targets import Target, get_target, mesh_on_target, target_mesh, uses_abstract_mesh

FIELDS = ("temp", "argument", "output", "alias", "generated_code")

_BAD_MEMORY = (
    "ox.memory_report: {where} gives memory {memory!r} for `{path}`; expected one of "
    "'device', 'pinned_host', or None (the argument's own memory kind, or the result's "
    "traced memory space)."
)
_BAD_PROGRAM = (
    "ox.compare_memory: program {name!r} is {value!r}; expected a tuple `(fn, args)` or "
    "`(fn, args, options)`, where `args` is a tuple of arguments and `options` a dict of "
    "`ox.memory_report` keywords (`in_memory`, `out_memory`, `donate_argnums`)."
)


@dataclasses.dataclass(frozen=True)
class MemoryReport:
    """Compiled memory of one program on one target, in bytes.

    `device` and `host` map each of `temp`, `argument`, `output`, `alias`,
    `generated_code` to bytes; `total` is the device total (temp + argument + output -
    alias) and `host_total` the same sum in host memory.

    The bytes are those of one device: XLA compiles one SPMD program that every device
    of the mesh runs, and analyses it per device. `mesh` holds the mesh's axis sizes
    (`{"data": 2, "fsdp": 4}`) when the arguments are on one, else None (one device).
    """

    name: str
    target: str
    device: Mapping[str, int]
    host: Mapping[str, int]
    mesh: Mapping[str, int] | None = None

    @property
    def devices(self) -> int:
        """How many devices run the program (each needs the bytes reported)."""
        return int(np.prod(list(self.mesh.values()), dtype=np.int64)) if self.mesh else 1

    @property
    def total(self) -> int:
        return _total(self.device)

    @property
    def host_total(self) -> int:
        return _total(self.host)

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "target": self.target,
            "device": dict(self.device),
            "host": dict(self.host),
            "total": self.total,
            "host_total": self.host_total,
            "mesh": None if self.mesh is None else dict(self.mesh),
        }

    def __str__(self) -> str:
        header = ("memory", *FIELDS[:4], "total")
        rows = [
            (
                "device",
                *(format_bytes(self.device[f]) for f in FIELDS[:4]),
                format_bytes(self.total),
            ),
            (
                "host",
                *(format_bytes(self.host[f]) for f in FIELDS[:4]),
                format_bytes(self.host_total),
            ),
        ]
        if self.mesh is None:
            title = f"Memory of {self.name!r} compiled for {self.target!r}"
        else:
            title = (
                f"Memory per device of {self.name!r} compiled for {self.target!r} over the "
                f"mesh {_describe(self.mesh)} ({self.devices} devices, each needs this)"
            )
        return title + "\n" + _table(header, rows)

    __repr__ = __str__


def _describe(mesh: Mapping[str, int]) -> str:
    return "{" + ", ".join(f"{name!r}: {size}" for name, size in mesh.items()) + "}"


def _total(fields: Mapping[str, int]) -> int:
    return fields["temp"] + fields["argument"] + fields["output"] - fields["alias"]


def format_bytes(n: int) -> str:
    """Bytes in the largest binary unit that keeps a leading digit (`17.25 MiB`)."""
    sign = "-" if n < 0 else ""
    n = abs(n)
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{sign}{n / size:.2f} {unit}"
    return f"{sign}{n} B"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    lines = [
        "  ".join(
            str(h).rjust(w) if i else str(h).ljust(w)
            for i, (h, w) in enumerate(zip(header, widths))
        )
    ]
    lines.append("  ".join("-" * w for w in widths))
    for row in rows:
        lines.append(
            "  ".join(
                str(c).rjust(w) if i else str(c).ljust(w)
                for i, (c, w) in enumerate(zip(row, widths))
            )
        )
    return "\n".join(lines)


# -- turning a function into (flat function, leaves, memories) ----------------------------


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


@dataclasses.dataclass
class _Program:
    flat: Callable[..., list]
    leaves: list  # array leaves (arrays or ShapeDtypeStructs), the arguments of `flat`
    in_memories: list[str]
    specs: list[PartitionSpec | None]  # over `mesh`; None: replicated
    out_memory: Any  # callable(out_avals) -> list of memories
    donate_argnums: tuple[int, ...]
    mesh: AnyMesh | None = None  # the mesh the arguments are on (rebuilt on the target)
    # callable(out_avals) -> one PartitionSpec per output over `mesh`, or None: the
    # compiler's choice (the output's memory then follows its traced type).
    out_specs: Any = None
    plan: Plan | None = None  # an `ox.filter_jit` plan, whose mesh `ox.shard` reads


def _spec_on(sharding: Any, mesh: AnyMesh | None) -> PartitionSpec | None:
    if mesh is not None and isinstance(sharding, NamedSharding) and sharding.mesh == mesh:
        return sharding.spec
    return None


def _from_filter_jit(wrapper: _JitWrapper, args: tuple, kwargs: dict) -> _Program:
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
    return _Program(
        flat=entry.flat,
        leaves=list(leaves),
        in_memories=memories,
        specs=specs,
        out_memory=lambda out_avals: list(entry.out_memories),
        donate_argnums=tuple(entry.donate_argnums),
        mesh=mesh,
        # Outputs shaped like an argument keep its shardings (the updated model stays
        # FSDP-sharded); the others are left to the compiler, as when the step runs.
        out_specs=lambda out_avals: [_spec_on(s, mesh) for s in entry.out_shardings],
        plan=plan,
    )


def _is_jit_object(fn: Any) -> bool:
    # `jax.jit(f)` wraps `f` (so does `jax.grad(f)`, which must not be unwrapped).
    return hasattr(fn, "__wrapped__") and hasattr(fn, "lower") and hasattr(fn, "trace")


def _from_function(
    fn: Callable,
    args: tuple,
    kwargs: dict,
    in_memory: Any,
    out_memory: Any,
    donate_argnums: Sequence[int],
) -> _Program:
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
        return jax.tree_util.tree_leaves(out)

    def out_memories(out_avals):
        requested_out = _broadcast(out_memory, out_cell[0], "out_memory")
        result = []
        for memory, aval in zip(requested_out, out_avals):
            _check_memory(memory, "out_memory", "output")
            if memory is None:
                host = getattr(aval, "memory_space", None) == jax.memory.Space.Host
                memory = "pinned_host" if host else "device"
            result.append(memory)
        return result

    # Arguments on a mesh (placed arrays, or ShapeDtypeStructs with a NamedSharding)
    # keep their specs, on that mesh rebuilt on the target's devices.
    mesh = resolve_mesh([("args", leaves)])
    specs = [_spec_on(getattr(leaf, "sharding", None), mesh) for leaf in leaves]
    return _Program(flat, leaves, memories, specs, out_memories, tuple(donate), mesh)


# -- compiling for a target ------------------------------------------------------------------


@contextlib.contextmanager
def _plan_on(plan: Plan | None, mesh: AnyMesh) -> Iterator[None]:
    """While compiling for a target, the plan's mesh (which `ox.shard` reads inside the
    step) is the target's mesh, not the mesh of this machine the arguments are on."""
    if plan is None or plan.mesh is None:
        yield
        return
    original = plan.mesh
    plan.mesh = mesh
    try:
        yield
    finally:
        plan.mesh = original


def _compile(program: _Program, target: Target) -> Any:
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

    def compile_with(out_shardings: list | None) -> Any:
        options: dict[str, Any] = {"donate_argnums": program.donate_argnums}
        if out_shardings is not None:
            options["out_shardings"] = out_shardings
        jitted = jax.jit(program.flat, in_shardings=in_shardings, **options)
        return jitted.trace(*abstract).lower().compile()

    context = jax.set_mesh(mesh) if abstract_mesh else contextlib.nullcontext()
    with context, _plan_on(program.plan, sharding_mesh):
        traced = jax.jit(program.flat, in_shardings=in_shardings).trace(*abstract)
        out_avals = traced.jaxpr.out_avals
        out_memories = program.out_memory(out_avals)
        if not on_mesh:
            return compile_with([sharding(m, None) for m in out_memories])
        # On a mesh, an output is sharded as the step would return it: by its planned
        # spec, or as the compiler chooses (None, its memory following its traced type).
        # An output asked for in another memory than its type's gets the spec the
        # compiler chose for it.
        specs = program.out_specs(out_avals) if program.out_specs else [None] * len(out_avals)
        traced_memories = ["pinned_host" if _is_host(a) else "device" for a in out_avals]
        if any(s is None and m != t for s, m, t in zip(specs, out_memories, traced_memories)):
            chosen = compile_with(None).output_shardings
            specs = [
                s if s is not None or m == t else getattr(c, "spec", PartitionSpec())
                for s, m, t, c in zip(specs, out_memories, traced_memories, chosen)
            ]
        out_shardings = [None if s is None else sharding(m, s) for s, m in zip(specs, out_memories)]
        return compile_with(out_shardings)


def _is_host(aval: Any) -> bool:
    return getattr(aval, "memory_space", None) == jax.memory.Space.Host


def _stats_fields(stats: Any) -> tuple[dict[str, int], dict[str, int]]:
    device = {f: int(getattr(stats, f"{f}_size_in_bytes", 0) or 0) for f in FIELDS}
    host = {f: int(getattr(stats, f"host_{f}_size_in_bytes", 0) or 0) for f in FIELDS}
    return device, host


def memory_report(
    fn: Callable,
    *args: Any,
    target: "str | Target" = "cpu",
    in_memory: Any = None,
    out_memory: Any = None,
    donate_argnums: Sequence[int] = (),
    name: str | None = None,
    **kwargs: Any,
) -> MemoryReport:
    """Compile `fn(*args, **kwargs)` for `target` and report its memory per memory space.

    **Arguments:**

    - `fn`: an `ox.filter_jit` function (compiled from its plan: placements, output
        memories and donation as it would run), or any function or `jax.jit` object
        (compiled as given; see `in_memory`, `out_memory`, `donate_argnums`).
    - `*args`, `**kwargs`: the arguments; array leaves may be `jax.ShapeDtypeStruct`s.
    - `target`: a name in `offload_eqx._targets.TARGETS` (`"cpu"`, `"h100"`, `"h100-8"`,
        `"a100"`, `"tpu-v5p"`, `"tpu-v5p-4"`, `"tpu-v5e"`, `"tpu-v6e"`) or a `Target`.
    - `in_memory`: plain functions only: a pytree prefix of `args` of `"device"`,
        `"pinned_host"` or `None` (the leaf's own memory kind; `"device"` for a
        `ShapeDtypeStruct` without a sharding).
    - `out_memory`: plain functions only: a pytree prefix of the results, `None` meaning
        the traced memory space (what `jax.jit(..., out_shardings=...)` sets otherwise).
    - `donate_argnums`: plain functions only, as in `jax.jit`.
    - `name`: the report's label (the function's name by default).

    Arguments on a mesh are compiled on that mesh rebuilt on the target's devices (the
    target must have as many devices: `"h100-8"` for 8, `"tpu-v5p-4"` for 4), and the
    report is per device.

    **Returns:** an `ox.MemoryReport`; `print` it for a table.
    """
    resolved = get_target(target)
    if isinstance(fn, _JitWrapper):
        if in_memory is not None or out_memory is not None or tuple(donate_argnums):
            raise ValueError(
                f"ox.memory_report({fn.__name__}): an `ox.filter_jit` function is compiled "
                "from its plan, so `in_memory`, `out_memory` and `donate_argnums` do not "
                "apply. Declare memories with `ox.field(...)` or a strategy, and donation "
                "with `ox.filter_jit(donate=...)`."
            )
        program = _from_filter_jit(fn, args, kwargs)
    else:
        program = _from_function(fn, args, kwargs, in_memory, out_memory, donate_argnums)
    stats = _compile(program, resolved).memory_analysis()
    device, host = _stats_fields(stats)
    label = name or getattr(fn, "__name__", type(fn).__name__)
    mesh = None if program.mesh is None else dict(program.mesh.shape)
    return MemoryReport(name=label, target=resolved.name, device=device, host=host, mesh=mesh)


@dataclasses.dataclass(frozen=True)
class MemoryComparison:
    """Memory reports of several programs on one or more targets; `print` it for a table.

    `reports[(name, target)]` is each `MemoryReport`; the `vs first` column is each
    program's device total minus the first program's on the same target.
    """

    reports: Mapping[tuple[str, str], MemoryReport]

    def as_dict(self) -> list[dict[str, Any]]:
        return [report.as_dict() for report in self.reports.values()]

    def __str__(self) -> str:
        header = (
            "program",
            "target",
            "temp",
            "argument",
            "output",
            "alias",
            "total",
            "host temp",
            "host argument",
            "host output",
            "vs first",
        )
        meshes = any(r.mesh is not None for r in self.reports.values())
        if meshes:
            header = header[:2] + ("mesh",) + header[2:]
        first: dict[str, int] = {}
        rows = []
        for (name, target), r in self.reports.items():
            first.setdefault(target, r.total)
            mesh = (("-" if r.mesh is None else "x".join(map(str, r.mesh.values()))),)
            rows.append(
                (
                    name,
                    target,
                    *(mesh if meshes else ()),
                    *(format_bytes(r.device[f]) for f in ("temp", "argument", "output", "alias")),
                    format_bytes(r.total),
                    *(format_bytes(r.host[f]) for f in ("temp", "argument", "output")),
                    format_bytes(r.total - first[target]),
                )
            )
        return "Compiled memory per device (total = temp + argument + output - alias)\n" + _table(
            header, rows
        )

    __repr__ = __str__


def compare_memory(
    programs: Mapping[str, tuple], target: "str | Target | Sequence[str | Target]" = "cpu"
) -> MemoryComparison:
    """Memory reports of several programs side by side, on one target or several.

    `programs` maps a name to `(fn, args)` or `(fn, args, options)`: `args` is the tuple
    of positional arguments and `options` a dict of `ox.memory_report` keywords
    (`in_memory`, `out_memory`, `donate_argnums`). For example, the same model under two
    strategies:

    ```python
    ox.compare_memory(
        {"baseline": (ox.filter_jit(step, strategy="baseline"), (model, x)),
         "hybrid": (ox.filter_jit(step, strategy="hybrid"), (model, x))},
        target=["h100", "tpu-v5p"],
    )
    ```
    """
    targets = [target] if isinstance(target, (str, Target)) else list(target)
    resolved = [get_target(t) for t in targets]  # unknown names fail before any compile
    reports: dict[tuple[str, str], MemoryReport] = {}
    for t in resolved:
        for name, program in programs.items():
            if (
                not isinstance(program, tuple)
                or len(program) not in (2, 3)
                or not isinstance(program[1], tuple)
            ):
                raise TypeError(_BAD_PROGRAM.format(name=name, value=program))
            fn, args, *rest = program
            options = dict(rest[0]) if rest else {}
            reports[(name, t.name)] = memory_report(fn, *args, target=t, name=name, **options)
    return MemoryComparison(reports)
