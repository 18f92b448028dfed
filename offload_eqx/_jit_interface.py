"""What the inspection layer asks of `ox.filter_jit`, in one place.

The audit and the memory reports need, for one call of a step: its cache entry (flat
function, plan, shardings, output types), the call's arguments labelled by parameter
name, which argument leaf each output is the new value of, and the flat function with
the plan's mesh replaced by a target's. `_jit` provides each of these (`FilterJit`,
`FilterJit.arguments`, `Compilation.output_arguments`, `Compilation.flat_on`); this module
only forwards to them.

TRANSITION: while `_jit` is being rewritten, each function falls back to what the
previous `_jit` offered. Once `_jit` has the names above, every function here is one line
and the module can be inlined by its two users (`_audit`, `_deviceless`).
"""

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from . import _jit
from ._plan import LeafPlan

FilterJit: type = getattr(_jit, "FilterJit", None) or _jit._JitWrapper


def is_filter_jit(fn: Any) -> bool:
    return isinstance(fn, FilterJit)


def arguments(wrapper: Any, args: tuple, kwargs: dict) -> list[tuple[str, Any]]:
    """`[(label, tree), ...]`: each argument named after the function's parameters."""
    if hasattr(wrapper, "arguments"):
        return wrapper.arguments(*args, **kwargs)
    return _jit._labels(wrapper.fn, args, kwargs)


def output_arguments(entry: Any, roots: Sequence[str]) -> list[LeafPlan | None]:
    """For each array output, the argument leaf it is the new value of (or None)."""
    if hasattr(entry, "output_arguments"):
        return list(entry.output_arguments)
    return _match_outputs(entry, roots)


def flat_on(entry: Any, mesh: Any) -> Callable[..., list]:
    """The entry's flat function, with `ox.shard` inside it reading `mesh` as the plan's
    mesh (compiling for a target rebuilds the mesh on the target's devices)."""
    if hasattr(entry, "flat_on"):
        return entry.flat_on(mesh)
    plan = entry.plan

    def flat(*leaves):
        with _plan_mesh(plan, mesh):
            return entry.flat(*leaves)

    return flat


@contextlib.contextmanager
def _plan_mesh(plan: Any, mesh: Any) -> Iterator[None]:
    if plan is None or plan.mesh is None:
        yield
        return
    original = plan.mesh
    plan.mesh = mesh
    try:
        yield
    finally:
        plan.mesh = original


def _split_output(path: str) -> tuple[str, str]:
    rest = path[len("output") :]
    if rest.startswith("["):
        end = rest.index("]") + 1
        return "output" + rest[:end], rest[end:]
    return "output", rest


def _match_outputs(entry: Any, roots: Sequence[str]) -> list[Any]:
    """An output subtree matches an argument whose leaves have the same paths and types."""
    out_paths = entry.output_paths()
    groups: dict[str, dict[str, int]] = {}
    for i, path in enumerate(out_paths):
        group, suffix = _split_output(path)
        groups.setdefault(group, {})[suffix] = i
    inputs: dict[str, dict[str, Any]] = {}
    for leaf in entry.plan.leaves:
        root = next(
            (
                r
                for r in roots
                if leaf.path == r or leaf.path.startswith(r + ".") or leaf.path.startswith(r + "[")
            ),
            None,
        )
        if root is not None:
            inputs.setdefault(root, {})[leaf.path[len(root) :]] = leaf
    matched: list[Any] = [None] * len(out_paths)
    used: set[str] = set()
    for members in groups.values():
        for root, leaves in inputs.items():
            if root in used or set(leaves) != set(members):
                continue
            if all(
                tuple(entry.out_avals[i].shape) == leaves[s].shape
                and np.dtype(entry.out_avals[i].dtype) == leaves[s].dtype
                for s, i in members.items()
            ):
                used.add(root)
                for suffix, i in members.items():
                    matched[i] = leaves[suffix]
                break
    return matched
