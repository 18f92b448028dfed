"""Memory reports: what a step needs in each memory space, compiled for a chosen target.

`ox.memory_report(fn, *args, target="h100")` compiles `fn` for the target (this CPU, or an
H100/TPU without the hardware: `_targets.deviceless`, `_targets.targets`) and reads XLA's
`memory_analysis()`: temp, argument, output and alias bytes, in device and in host memory.
The device total is the one JAX's host-offloading tutorial prints: temp + argument +
output - alias, and the report says whether it fits in the target's device memory.

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

Arguments on a mesh are compiled on the same mesh rebuilt on the target's devices, so the
target must have as many devices as the mesh (`"h100-8"` for a (2, 4) mesh, `"tpu-v5p-4"`
for (1, 4) or (4,)). XLA analyses an SPMD program per device, so every byte reported, and
the capacity it is compared with, is one device's.
"""

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from .._base.table import format_bytes, format_table
from .._jit.aot import refuse_ahead_of_time
from .._jit.jit import FilterJit
from .._targets.compiler_faults import faults_of
from .._targets.deviceless import (
    FIELDS,
    Program,
    compile_for,
    memory_fields,
    program_of_function,
    program_of_step,
)
from .._targets.devices import require_compiler
from .._targets.targets import TARGETS, Target, get_target
from .recomputed import Recomputed, describe, recomputed
from .workspaces import unsized_workspaces, workspace_note

_BAD_PROGRAM = (
    "ox.compare_memory: program {name!r} is {value!r}; expected a tuple `(fn, args)` or "
    "`(fn, args, options)`, where `args` is a tuple of arguments and `options` a dict of "
    "`ox.memory_report` keywords (`in_memory`, `out_memory`, `donate_argnums`)."
)
_NOT_FROM_PLAN = (
    "ox.memory_report({name}): an `ox.filter_jit` function is compiled from its plan, so "
    "`in_memory`, `out_memory` and `donate_argnums` do not apply. Declare memories with "
    "`ox.field(...)` or a strategy, and donation with `ox.filter_jit(donate=...)`."
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

    `capacity` is the device memory of one device of the target (`Target.capacity`, None
    when unknown, as for this machine's CPU); `fits` says whether `total` is within it.

    `compiler_log` holds XLA's log lines while compiling, kept off the terminal (for a
    program over the capacity, "Can't reduce memory use below ..." and the like).
    `notes` says what the bytes leave out: the workspace of cuDNN kernels (fused
    attention) compiled without a GPU, which cuDNN sizes only on one.
    `compiler_faults` names the known faults of the installed XLA in this program, a
    sentence each (empty when none): the figures stay right, but a GPU run of it would
    not be (openxla/xla#46231 on jaxlib 0.10.2 and 0.11.0), and `ox.filter_jit` refuses it.
    `recomputed` lists the work XLA recomputed on its own to stay under the memory limit
    it computed (its rematerialization's clones, `Recomputed`: name, op, FLOPs a
    step): empty for a program that fits with room to spare.
    `print` a report for a table; `as_dict()` for JSON.
    """

    name: str
    target: str
    device: Mapping[str, int]
    host: Mapping[str, int]
    mesh: Mapping[str, int] | None = None
    capacity: int | None = None
    # XLA's log lines while compiling (`compiler_log`), kept off the terminal: for a
    # program over the capacity, "Can't reduce memory use below ..." and the like.
    compiler_log: tuple[str, ...] = ()
    # What the bytes leave out (`workspaces.py`: cuDNN workspaces a deviceless compile
    # does not size), a sentence each; printed under the table.
    notes: tuple[str, ...] = ()
    # Known faults of the installed XLA in this program (`_targets/compiler_faults`).
    compiler_faults: tuple[str, ...] = ()
    # XLA's rematerialized clones (`recomputed.py`); printed under the table.
    recomputed: tuple[Recomputed, ...] = ()

    @property
    def devices(self) -> int:
        """How many devices run the program (each needs the bytes reported)."""
        return int(np.prod(list(self.mesh.values()), dtype=np.int64)) if self.mesh else 1

    @property
    def total(self) -> int:
        """Device bytes: temp + argument + output - alias."""
        return _total(self.device)

    @property
    def host_total(self) -> int:
        """Host bytes: temp + argument + output - alias in host memory."""
        return _total(self.host)

    @property
    def fits(self) -> bool | None:
        """Whether the device total is within the target's device memory (None: the
        target's capacity is unknown)."""
        return None if self.capacity is None else self.total <= self.capacity

    def fit_line(self) -> str:
        """One sentence: whether the program fits the target's device memory."""
        chip = f"the {self.target}" + (" (each device)" if self.mesh else "")
        if self.capacity is None:
            return f"fit not checked: the device memory of {self.target!r} is unknown"
        needs, has = format_bytes(self.total), format_bytes(self.capacity)
        if self.fits:
            return f"fits: needs {needs} of the {has} {chip} has"
        short = format_bytes(self.total - self.capacity)
        return f"does not fit: needs {needs}, {chip} has {has} ({short} too much)"

    def as_dict(self) -> dict[str, Any]:
        """The report as plain values, for JSON."""
        return {
            "name": self.name,
            "target": self.target,
            "device": dict(self.device),
            "host": dict(self.host),
            "total": self.total,
            "host_total": self.host_total,
            "mesh": None if self.mesh is None else dict(self.mesh),
            "capacity": self.capacity,
            "fits": self.fits,
            "notes": list(self.notes),
            "compiler_faults": list(self.compiler_faults),
            "recomputed": [clone.as_dict() for clone in self.recomputed],
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
        table = format_table(header, rows, numeric=True)
        clones = describe(self.recomputed)
        lines = [title, table, self.fit_line(), *(f"Note: {n}" for n in self.notes)]
        return "\n".join(lines + ([f"Note: {clones}"] if clones else []))

    __repr__ = __str__


def _describe(mesh: Mapping[str, int]) -> str:
    return "{" + ", ".join(f"{name!r}: {size}" for name, size in mesh.items()) + "}"


def _total(fields: Mapping[str, int]) -> int:
    return fields["temp"] + fields["argument"] + fields["output"] - fields["alias"]


def _name_of(fn: Any) -> str:
    return getattr(fn, "__name__", None) or type(fn).__name__


def memory_report(
    fn: Callable,
    *args: Any,
    target: "str | Target" = "cpu",
    in_memory: Any = None,
    out_memory: Any = None,
    donate_argnums: int | Sequence[int] = (),
    name: str | None = None,
    **kwargs: Any,
) -> MemoryReport:
    """Compile `fn(*args, **kwargs)` for `target` and report its memory per memory space.

    **Arguments:**

    - `fn`: an `ox.filter_jit` function (compiled from its plan: placements, output
        memories and donation as it would run), or any function or `jax.jit` object
        (compiled as given; see `in_memory`, `out_memory`, `donate_argnums`).
    - `*args`, `**kwargs`: the arguments; array leaves may be `jax.ShapeDtypeStruct`s.
    - `target`: a name in `ox.TARGETS` (`"cpu"`, `"h100"`, `"h100-8"`,
        `"a100"`, `"tpu-v5p"`, `"tpu-v5p-4"`, `"tpu-v5e"`, `"tpu-v6e"`) or a `Target`.
    - `in_memory`: plain functions only: a pytree prefix of `args` of `"device"`,
        `"pinned_host"` or `None` (the leaf's own memory kind; `"device"` for a
        `ShapeDtypeStruct` without a sharding).
    - `out_memory`: plain functions only: a pytree prefix of the results, `None` meaning
        the traced memory space (what `jax.jit(..., out_shardings=...)` sets otherwise).
    - `donate_argnums`: plain functions only, as in `jax.jit` (an index or a sequence).
    - `name`: the report's label (the function's name by default).

    Arguments on a mesh are compiled on that mesh rebuilt on the target's devices (the
    target must have as many devices: `"h100-8"` for 8, `"tpu-v5p-4"` for 4), and the
    report is per device.

    **Returns:** an `ox.MemoryReport`; `print` it for a table.
    """
    refuse_ahead_of_time(fn, "ox.memory_report")
    resolved = get_target(target)  # an unknown target is refused before any trace
    require_compiler(resolved)  # so is a missing extra (cuDNN), which a trace may need
    if isinstance(donate_argnums, int):
        donate_argnums = (donate_argnums,)
    if isinstance(fn, FilterJit):
        if in_memory is not None or out_memory is not None or tuple(donate_argnums):
            raise ValueError(_NOT_FROM_PLAN.format(name=_name_of(fn)))
        program = program_of_step(fn, args, kwargs)
    else:
        program = program_of_function(fn, args, kwargs, in_memory, out_memory, donate_argnums)
    return compiled_report(program, resolved, name or _name_of(fn))[0]


def compiled_report(program: Program, target: Target, name: str) -> tuple[MemoryReport, Any]:
    """Compile `program` for `target`: its memory report, and the compiled program
    (`jax.stages.Compiled`, whose `as_text()` `ox.estimate` prices)."""
    log: list[str] = []
    compiled = compile_for(program, target, log)
    device, host = memory_fields(compiled.memory_analysis())
    report = MemoryReport(
        name=name,
        target=target.name,
        device=device,
        host=host,
        mesh=None if program.mesh is None else dict(program.mesh.shape),
        capacity=target.capacity,
        compiler_log=tuple(log),
        notes=_notes(compiled, target),
        compiler_faults=faults_of(compiled, target),
        recomputed=recomputed(compiled.as_text() or ""),
    )
    return report, compiled


def _notes(compiled: Any, target: Target) -> tuple[str, ...]:
    if target.platform != "cuda":  # cuDNN kernels are XLA:GPU's only
        return ()
    note = workspace_note(unsized_workspaces(compiled.as_text() or ""))
    return () if note is None else (note,)


@dataclasses.dataclass(frozen=True)
class MemoryComparison:
    """Memory reports of several programs on one or more targets; `print` it for a table.

    `reports[(name, target)]` is each `MemoryReport`; the `vs first` column is each
    program's device total minus the first program's on the same target; `fits` says
    whether the total is within the target's device memory (`-`: unknown), and every
    program that does not fit gets a line under the table.
    """

    reports: Mapping[tuple[str, str], MemoryReport]

    def as_dict(self) -> list[dict[str, Any]]:
        """Each report's `as_dict()`, in the table's order."""
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
            "fits",
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
                    {True: "yes", False: "no", None: "-"}[r.fits],
                )
            )
        title = "Compiled memory per device (total = temp + argument + output - alias)"
        misfits = [f"{n}: {r.fit_line()}" for (n, _), r in self.reports.items() if r.fits is False]
        notes = [
            f"Note ({n}, {t}): {note}" for (n, t), r in self.reports.items() for note in r.notes
        ]
        return "\n".join([title, format_table(header, rows, numeric=True), *misfits, *notes])

    __repr__ = __str__


_NOT_TARGETS = (
    "ox.compare_memory(target={value!r}): expected a target name ({known}), an `ox.Target`, "
    "or a list of them; got {kind}. {fix}"
)


def _targets(value: Any) -> list:
    """`compare_memory`'s targets: a list or tuple of names and `Target`s. A mapping (of
    labels to targets?) is refused: each column is labelled by its target's name."""
    if isinstance(value, (list, tuple)):
        return list(value)
    if isinstance(value, Mapping):
        fix = (
            "A dict is not read as labels for targets: each column is labelled by its "
            f"target's name. Pass `target={list(value.values())!r}`; to label a target "
            "otherwise, pass it renamed: `dataclasses.replace(ox.TARGETS['h100'], "
            "name='label')`."
        )
    else:
        fix = "Pass e.g. `target='h100'` or `target=['h100', 'tpu-v5p']`."
    known = ", ".join(repr(t) for t in TARGETS)
    kind = f"{'an' if type(value).__name__[0] in 'aeiou' else 'a'} {type(value).__name__}"
    raise TypeError(_NOT_TARGETS.format(value=value, known=known, kind=kind, fix=fix))


def compare_memory(
    programs: Mapping[str, tuple],
    # A name, a `Target` or a list of them: checked below, with a message that says what
    # was meant (a dict of labels to targets, say).
    target: Any = "cpu",
) -> MemoryComparison:
    """Memory reports of several programs side by side, on one target or several.

    **Arguments:**

    - `programs`: maps a name (the table's `program` column) to `(fn, args)` or
        `(fn, args, options)`: `fn` is what `ox.memory_report` takes (an `ox.filter_jit`
        step, or any function), `args` the tuple of its positional arguments (arrays or
        `jax.ShapeDtypeStruct`s) and `options` a dict of `ox.memory_report` keywords
        (`in_memory`, `out_memory`, `donate_argnums`).
    - `target`: a target name or `ox.Target` (see `ox.memory_report`), or a list of
        them: every program is compiled for every target, and each column is labelled by
        its target's name. Unknown names fail before any compile.

    **Returns:** an `ox.MemoryComparison`; `print` it for a table with a `vs first` and a
    `fits` column, and a line under it for every program that does not fit.

    **Raises:** `TypeError` for a program that is not such a tuple, or a `target` that
    is not a name, a `Target` or a list of them (a dict is refused); what
    `ox.memory_report` raises for a program that does not compile.

    For example, the same model under two strategies:

    ```python
    ox.compare_memory(
        {"baseline": (ox.filter_jit(step, strategy="baseline"), (model, x)),
         "hybrid": (ox.filter_jit(step, strategy="hybrid"), (model, x))},
        target=["h100", "tpu-v5p"],
    )
    ```
    """
    targets = [target] if isinstance(target, (str, Target)) else _targets(target)
    resolved = [get_target(t) for t in targets]  # unknown names fail before any compile
    for t in resolved:
        require_compiler(t)
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
