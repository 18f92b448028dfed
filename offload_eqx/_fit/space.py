"""The plans `ox.fit` searches: one `ox.Strategy` per choice, and what a trace says of names.

A candidate is
- a base: `"save"` (every value of a region kept on the device) or `"remat"` (every value
  not named recomputed);
- a policy for each searchable activation name: under `"remat"` one of save, offload,
  remat; under `"save"` save or offload (recomputing a named value whose producer is
  saved recomputes nothing);
- where managed parameters live, and where the optimizer state lives (device or
  pinned_host), offered only when the step has such leaves.

A name is not searchable when its value is the loop carry of a plain `jax.lax.scan` (a
block's output returned as the carry): that scan keeps every iteration's carry for the
backward pass whatever the policy, so offloading it would move bytes and free nothing.
The layer input of an `ox.scan` is searched: `ox.scan` names it inside each layer's
region, where an offloaded copy replaces the carry as the layer's residual (the inputs of
the layers leave the device: MaxText's `decoder_layer_input=offload`). `named_values`
finds the carries on the traced program.
"""

import dataclasses
import itertools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax.extend as jex
import numpy as np

from .._declare.activations import Policy
from .._declare.strategy import HOST_UPDATES, Strategy
from .._plan.remat_policy import carried_names

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
    carry: bool  # the carry of an enclosing `jax.lax.scan`, kept whatever its policy
    layers: int = 1  # the trip count of its enclosing scans (its layers), at most
    # An `ox.scan` layer's input: recomputed ("remat"), it is still kept on the device
    # (the carry is the layer's residual); only offloading it frees the device.
    layer_input: bool = False


def named_values(jaxpr: Any) -> dict[str, NamedValue]:
    """Each name the forward pass of `jaxpr` produces (recomputation excluded), with its
    bytes per step and whether it is the carry of a plain `jax.lax.scan`.

    A value recomputed for the backward pass sits under `rematted_computation`; so does
    the forward pass of a region that is itself rematerialised whole (an
    `ox.checkpoint` at the top of the step, under the `"remat"` base), whose names then
    appear nowhere else: those are taken from there."""
    strict: dict[str, NamedValue] = {}
    rematted: dict[str, NamedValue] = {}
    carries = carried_names(jaxpr)
    carried = {n for n, scan in carries.items() if scan == "jax.lax.scan"}
    inputs = {n for n, scan in carries.items() if scan == "ox.scan"}

    def walk(j: Any, count: int) -> None:
        for eqn in j.eqns:
            prim = eqn.primitive.name
            stack = str(eqn.source_info.name_stack)
            if prim == "name" and "transpose(" not in stack:
                found = rematted if "rematted_computation" in stack else strict
                aval = eqn.outvars[0].aval
                size = int(np.prod(aval.shape, dtype=np.int64)) * aval.dtype.itemsize * count
                name = eqn.params["name"]
                previous = found.get(name)
                found[name] = NamedValue(
                    name,
                    size + (previous.bytes if previous else 0),
                    name in carried,
                    max(count, previous.layers if previous else 1),
                    name in inputs,
                )
            length = eqn.params["length"] if prim == "scan" else 1
            for sub in jex.core.jaxprs_in_params(eqn.params):
                walk(getattr(sub, "jaxpr", sub), count * length)

    walk(jaxpr, 1)
    return rematted | strict


def carry_note(name: str, policy: Policy) -> str:
    return _CARRY.format(name=name, scan="jax.lax.scan", policy=policy)


@dataclasses.dataclass(frozen=True)
class Choice:
    """One candidate plan, before it is priced.

    `names` gives each searched name a policy, or a `LayerSplit` (a fraction of the
    layers); `params` and `optimizer` are a memory for every managed leaf ("device",
    "pinned_host"; the optimizer also "host": in host memory, updated there, and
    "host_sliced": so, each large parameter's update a slice at a time), or pairs
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
        host = self.updates_on_host  # state in host memory, updated there
        return Strategy(
            self.label,
            params=_leafwise(self.params),
            optimizer=_leafwise("pinned_host" if host else self.optimizer),
            activations=self.base,  # type: ignore[arg-type]
            names=names,
            # Where the update runs is the search's choice, never the declaration's:
            # "device" and "pinned_host" state are updated on the device.
            update=self.optimizer if host else "device",
        )

    @property
    def updates_on_host(self) -> bool:
        """Whether the plan updates on the host ("host", or "host_sliced")."""
        return self.optimizer in HOST_UPDATES

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


# Up to this many searchable names every combination of policies is a candidate (3^n
# under the remat base); past it, `frontier`.
EXHAUSTIVE_NAMES = 5


def frontier(
    names: Sequence[str],
    params: Sequence[str],
    optimizer: Sequence[str],
    seconds: Callable[[Choice], float | None],
    sizes: Mapping[str, int],
) -> list[Choice]:
    """Candidates that grow with the names, not as 3^n: for each base and placement, the
    plan that saves every name, then the plans that switch names one at a time to their
    cheaper frugal policy (offload or, under `"remat"`, remat: whichever `seconds` prices
    lower when that name alone changes), in order of the seconds each adds per byte it
    frees from the device; and the plan where every name is recomputed (or offloaded).
    The composed price makes the order: names interact little, so the plans between
    lie close to the fastest plan for each amount freed."""
    found: list[Choice] = []
    for p, o in itertools.product(params, optimizer):
        for base, frugal in (("remat", ("offload", "remat")), ("save", ("offload",))):
            saved = Choice(base, tuple((n, "save") for n in names), p, o)
            start = seconds(saved)
            steps = []
            for name in names:
                times = {policy: seconds(saved.with_policy(name, policy)) for policy in frugal}
                priced = [
                    (t - start, policy)
                    for policy, t in times.items()
                    if t is not None and start is not None
                ]
                if priced:
                    added, policy = min(priced)
                    steps.append((added / max(sizes.get(name, 1), 1), name, policy))
            current = saved
            found.append(current)
            for _, name, policy in sorted(steps):
                current = current.with_policy(name, policy)
                found.append(current)
            found.append(saved.with_(names=tuple((n, frugal[-1]) for n in names)))
    return list(dict.fromkeys(found))


def describe_part(part: tuple) -> str:
    kind, a, b = part
    if kind == "placement" and b == "host":
        return f"parameters in {a} with the optimizer updated on the host"
    if kind == "placement":
        return f"parameters in {a} with optimizer state in {b}"
    if kind == "base":
        return f"the base {a!r}"
    return f"{a!r} {b} under the base {kind!r}"


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One plan `ox.fit` considered: its predicted time and, if compiled, its memory.

    - `label`: the plan in one line (`remat[h=save] params=device optimizer=pinned_host`).
    - `strategy`: the `ox.Strategy` that compiles it.
    - `seconds`: the predicted step time (from an exact trace when compiled, composed
        from the traces of its parts otherwise).
    - `moved`: bytes across the host link per step, both ways.
    - `recompute_flops`: the FLOPs of the recomputation.
    - `device_bytes`, `host_bytes`: the compiled memory per device (None: not compiled).
    - `status`: `"best"`, `"fits"`, or why it was not chosen (`"over the device budget
        by 2.05 GiB"`, `"not compiled: predicted slower than the best plan that fits"`).
    - `simulated_seconds`: for a compiled plan that fits, its compiled program's schedule
        simulated (what `ox.fit` chooses by); None otherwise.
    """

    label: str
    strategy: Any  # ox.Strategy
    seconds: float  # predicted (exact trace when compiled, composed otherwise)
    moved: float  # bytes across the host link per step
    recompute_flops: float
    device_bytes: int | None  # compiled (None: not compiled)
    host_bytes: int | None
    status: str  # "fits", "best", or why not
    simulated_seconds: float | None = None  # compiled and fits: the schedule simulated

    def as_dict(self) -> dict[str, Any]:
        """Every field but `strategy` as plain values, for JSON."""
        return {k: v for k, v in dataclasses.asdict(self).items() if k != "strategy"}


@dataclasses.dataclass(frozen=True)
class Space:
    """What the search ranges over, found on the step's first trace."""

    names: tuple[str, ...]  # searchable names (not loop carries)
    params: tuple[str, ...]
    optimizer: tuple[str, ...]
    notes: tuple[str, ...]

    @property
    def host_allowed(self) -> tuple[str, ...]:
        return tuple(
            attr for attr in ("params", "optimizer") if "pinned_host" in getattr(self, attr)
        )

    def frugal(self) -> Choice:
        """The plan that keeps least on the device: everything recomputed, parameters and
        state on the host (updated there, where the target can)."""
        optimizer = "host" if "host" in self.optimizer else self.optimizer[-1]
        names = tuple((n, "remat") for n in self.names)
        return Choice("remat", names, self.params[-1], optimizer)
