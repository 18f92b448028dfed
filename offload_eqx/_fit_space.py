"""The plans `ox.fit` searches: one `ox.Strategy` per choice, and what a trace says of names.

A candidate is
- a base: `"save"` (every value of a region kept on the device) or `"remat"` (every value
  not named recomputed);
- a policy for each searchable activation name: under `"remat"` one of save, offload,
  remat; under `"save"` save or offload (recomputing a named value whose producer is
  saved recomputes nothing);
- where managed parameters live, and where the optimizer state lives (device or
  pinned_host), offered only when the step has such leaves.

A name is not searchable when its value is a loop carry (the layer input of an `ox.scan`
body): the scan keeps every iteration's carry for the backward pass whatever the policy,
so offloading it would move bytes and free nothing, and saving or recomputing it changes
nothing. `named_values` finds them on the traced program.
"""

import dataclasses
import itertools
from collections.abc import Mapping, Sequence
from typing import Any

import jax.extend as jex
import numpy as np

from ._activations import Policy
from ._remat_policy import carried_names
from ._strategy import Strategy

_CARRY = (
    "Activation {name!r} is the carry of `{scan}` (the value each iteration passes to the "
    "next), which the scan keeps for the backward pass whatever its policy: offloading it "
    "would only add transfers, so it is left {policy!r} and not searched."
)


@dataclasses.dataclass(frozen=True)
class NamedValue:
    """An activation name as the forward pass produces it."""

    name: str
    bytes: int  # per step: the value's size times the trip counts of its enclosing scans
    carry: bool  # the carry of an enclosing scan
    layers: int = 1  # the trip count of its enclosing scans (its layers), at most


def named_values(jaxpr: Any) -> dict[str, NamedValue]:
    """Each name the forward pass of `jaxpr` produces (recomputation excluded), with its
    bytes per step and whether it is a scan's carry."""
    found: dict[str, NamedValue] = {}
    carried = carried_names(jaxpr)

    def walk(j: Any, count: int) -> None:
        for eqn in j.eqns:
            prim = eqn.primitive.name
            stack = str(eqn.source_info.name_stack)
            if prim == "name" and "rematted_computation" not in stack and "transpose(" not in stack:
                aval = eqn.outvars[0].aval
                size = int(np.prod(aval.shape, dtype=np.int64)) * aval.dtype.itemsize * count
                name = eqn.params["name"]
                previous = found.get(name)
                found[name] = NamedValue(
                    name,
                    size + (previous.bytes if previous else 0),
                    name in carried,
                    max(count, previous.layers if previous else 1),
                )
            length = eqn.params["length"] if prim == "scan" else 1
            for sub in jex.core.jaxprs_in_params(eqn.params):
                walk(getattr(sub, "jaxpr", sub), count * length)

    walk(jaxpr, 1)
    return found


def carry_note(name: str, policy: Policy) -> str:
    return _CARRY.format(name=name, scan="ox.scan", policy=policy)


@dataclasses.dataclass(frozen=True)
class Choice:
    """One candidate plan, before it is priced.

    `names` gives each searched name a policy, or a `LayerSplit` (a fraction of the
    layers); `params` and `optimizer` are a memory for every managed leaf ("device",
    "pinned_host"; the optimizer also "host": in host memory, updated there), or pairs
    of `(leaf-path pattern, memory)` for a subset of the leaves (unmatched: "device").
    """

    base: str  # "save" or "remat"
    names: tuple[tuple[str, Any], ...]
    params: Any
    optimizer: Any

    def strategy(self, fixed: Mapping[str, Policy]) -> Strategy:
        """The `ox.Strategy` of this choice; `fixed` are the policies of names not
        searched (loop carries), kept as they are."""
        names = dict(fixed) | dict(self.names)
        host = self.optimizer == "host"  # state in host memory, updated there
        return Strategy(
            self.label,
            params=_leafwise(self.params),
            optimizer=_leafwise("pinned_host" if host else self.optimizer),
            activations=self.base,  # type: ignore[arg-type]
            names=names,
            # Where the update runs is the search's choice, never the declaration's:
            # "device" and "pinned_host" state are updated on the device.
            update="host" if host else "device",
        )

    @property
    def placement(self) -> tuple:
        """Where parameters and optimizer state live: what XLA's additions depend on."""
        return (self.params, self.optimizer)

    @property
    def label(self) -> str:
        named = ",".join(f"{n}={p}" for n, p in self.names if p != self.base) or "-"
        return (
            f"{self.base}[{named}] params={_describe(self.params)} "
            f"optimizer={_describe(self.optimizer)}"
        )

    def with_(self, **changes: Any) -> "Choice":
        return dataclasses.replace(self, **changes)

    def with_policy(self, name: str, policy: Any) -> "Choice":
        return self.with_(names=tuple((n, policy if n == name else p) for n, p in self.names))


def _leafwise(mode: Any) -> Any:
    """A leaf subset as a strategy's patterns: the listed leaves as given, the rest on the
    device."""
    return mode if isinstance(mode, str) else (*mode, ("*", "device"))


def _describe(mode: Any) -> str:
    """`pinned_host[3 leaves: layers.w_gate,layers.w_up,layers.w_down]`: a leaf subset
    by the ends of its paths (the first three, and how many more)."""
    if isinstance(mode, str):
        return mode
    names = [pattern.lstrip("*").split(".", 1)[-1] for pattern, _ in mode]
    shown = ",".join(names[:3]) + (f",+{len(names) - 3} more" if len(names) > 3 else "")
    return f"pinned_host[{len(names)} leaves: {shown}]"


def choices(names: Sequence[str], params: Sequence[str], optimizer: Sequence[str]) -> list[Choice]:
    """Every candidate: both bases, each name's policies under them, each placement."""
    found = []
    for p, o in itertools.product(params, optimizer):
        for policies in itertools.product(("save", "offload", "remat"), repeat=len(names)):
            found.append(Choice("remat", tuple(zip(names, policies)), p, o))
        for policies in itertools.product(("save", "offload"), repeat=len(names)):
            found.append(Choice("save", tuple(zip(names, policies)), p, o))
    return found


def describe_part(part: tuple) -> str:
    kind, a, b = part
    if kind == "placement" and b == "host":
        return f"parameters in {a} with the optimizer updated on the host"
    if kind == "placement":
        return f"parameters in {a} with optimizer state in {b}"
    if kind == "base":
        return f"the base {a!r}"
    return f"{a!r} {b} under the base {kind!r}"
