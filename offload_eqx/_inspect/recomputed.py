"""Work XLA recomputed on its own: the clones its rematerialization pass left in a
compiled program.

XLA's `HloRematerialization` runs when the program it scheduled exceeds the memory limit
it computed (on XLA:GPU, `remat_limit` in `_host` explains that limit). It clones an
instruction whose result it frees early and names the clone after it: `<name>.remat`,
`<name>.remat2`, ... No plan asked for that work, and a step that fits with room to
spare should hold none. `MemoryReport.recomputed` lists them, each with the FLOPs it
adds in one step (a clone inside a loop's body counts once per trip).

Reading a compiled module and pricing its instructions is the planning layer's
(`_planning/hlo.py`, `_planning/kernels.py`), which imports this layer: it hands its
reader over here when it is imported (`_planning/recomputed.py`), as `import offload_eqx`
does, so that the memory reports and the estimates name the same clones with the same
FLOPs.
"""

import dataclasses
from collections.abc import Callable

REMAT_MARK = ".remat"  # XLA's suffix for a rematerialized clone


@dataclasses.dataclass(frozen=True)
class Recomputed:
    """One clone XLA's rematerialization added: the instruction's name in the compiled
    program, its opcode (`fusion` for a fused kernel, the kind of fusion after the
    name's stem: `gemm_fusion_dot.4.remat2` is a matmul), the FLOPs it computes in one
    step, and how many times it runs in one step (its loops' trip counts)."""

    instruction: str
    op: str
    flops: float
    runs: int = 1

    def as_dict(self) -> dict[str, object]:
        return dataclasses.asdict(self)


_readers: list[Callable[[str], tuple[Recomputed, ...]]] = []


def read_clones_with(reader: Callable[[str], tuple[Recomputed, ...]]) -> None:
    """Use `reader(hlo_text)` to list a compiled program's clones (the planning layer's)."""
    _readers[:] = [reader]


def recomputed(text: str) -> tuple[Recomputed, ...]:
    """The clones in `text` (a compiled program's `as_text()`), with their FLOPs; () when
    the text names none."""
    if REMAT_MARK not in text:
        return ()
    if not _readers:  # the planning layer not imported: names only
        return tuple(Recomputed(name, "", 0.0) for name in _clone_names(text))
    return _readers[0](text)


def _clone_names(text: str) -> list[str]:
    names = []
    for line in text.splitlines():
        head = line.strip().removeprefix("ROOT ").split(" = ", 1)
        if len(head) == 2 and REMAT_MARK in head[0]:
            names.append(head[0].lstrip("%"))
    return names


def _flops(flops: float) -> str:
    for unit, scale in (("PFLOP", 1e15), ("TFLOP", 1e12), ("GFLOP", 1e9)):
        if flops >= scale:
            return f"{flops / scale:.3g} {unit}"
    return f"{flops:.3g} FLOP"


def describe(clones: tuple[Recomputed, ...]) -> str | None:
    """A sentence for a report: how much XLA recomputed on its own, and where."""
    if not clones:
        return None
    flops = sum(c.flops for c in clones)
    ops: dict[str, int] = {}
    for clone in clones:
        ops[clone.op or "?"] = ops.get(clone.op or "?", 0) + 1
    kinds = ", ".join(f"{n} {op}" for op, n in sorted(ops.items(), key=lambda kv: -kv[1]))
    largest = max(clones, key=lambda c: c.flops)
    count = f"{len(clones)} instruction{'s' if len(clones) > 1 else ''}"
    return (
        f"XLA recomputed {count} on its own ({kinds}; {_flops(flops)} a step, "
        f"the most in {largest.instruction!r}), "
        "rematerializing to stay under the memory limit it computed; no plan asked for "
        "this work."
    )
