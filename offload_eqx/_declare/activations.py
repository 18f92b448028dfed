"""Named activations and the per-name policy: keep on device, offload to host, or recompute."""

import dataclasses
import operator
from typing import Any, Literal, get_args

import equinox as eqx

Policy = Literal["save", "offload", "remat"]
POLICIES: tuple[str, ...] = get_args(Policy)


def check_name(name: object, *, where: str) -> None:
    if not isinstance(name, str) or not name:
        raise ValueError(
            f"{where} was given the activation name {name!r}; a name is a non-empty string, "
            "the one passed to `ox.name(x, name)` where the activation is computed."
        )


def check_policy(name: str, policy: object, *, where: str) -> None:
    check_name(name, where=where)
    if policy not in POLICIES:
        allowed = ", ".join(repr(p) for p in POLICIES)
        raise ValueError(
            f"{where} gives activation {name!r} the policy {policy!r}; expected one of "
            f"{allowed}: 'save' keeps it on the device for the backward pass, 'offload' "
            "moves it to host memory and back, 'remat' recomputes it."
        )


@dataclasses.dataclass(frozen=True)
class LayerSplit:
    """A name's policy in the first `layers` layers of every `ox.scan` (`first`) and in
    the layers after them (`rest`): `LayerSplit("save", 10, "offload")`, written
    `("save", 10, "offload")` in `ox.Strategy(names=...)`. The scan runs as consecutive
    segments, each with its own remat policy; regions outside a scan use `rest`."""

    first: Policy
    layers: int
    rest: Policy

    def policies(self) -> tuple[Policy, Policy]:
        return (self.first, self.rest)

    def at(self, layer: int) -> Policy:
        """The policy in layer `layer` (0-based) of a scan."""
        return self.first if layer < self.layers else self.rest

    def __str__(self) -> str:
        return f"{self.first}[:{self.layers}]+{self.rest}"


def policies_of(policy: "Policy | LayerSplit") -> tuple[Policy, ...]:
    """The policies a name has in some layer: one, or a split's two."""
    return policy.policies() if isinstance(policy, LayerSplit) else (policy,)


def _layer_count(value: object) -> int | None:
    """`value` as a Python int when it is an integer of any kind (`10`, `np.int64(10)`,
    as the planners give them), not a bool; None otherwise."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        return None


def check_layer_split(name: str, value: object, *, where: str) -> "Policy | LayerSplit":
    """A policy, or `(first, layers, rest)` as a `LayerSplit`, checked."""
    if isinstance(value, LayerSplit):
        value = (value.first, value.layers, value.rest)
    if isinstance(value, tuple):
        layers = _layer_count(value[1]) if len(value) == 3 else None
        if layers is None or layers < 0:
            raise ValueError(
                f"{where} gives activation {name!r} the policy {value!r}; a policy split by "
                "layers is `(policy in the first layers, how many layers (an integer, 0 or "
                "more), policy in the rest)`, e.g. `('save', 10, 'offload')`."
            )
        check_policy(name, value[0], where=where)
        check_policy(name, value[2], where=where)
        return LayerSplit(value[0], layers, value[2])
    check_policy(name, value, where=where)
    return value  # type: ignore[return-value]


class Activations:
    """Per-name policies for activations named with `ox.name`.

    `ox.Activations(x="offload", q="save", h="remat")`. Hashable and immutable, so it can
    be a static field of an `eqx.Module`; declare it with `ox.activations(...)`.
    """

    __slots__ = ("_items",)

    def __init__(self, **policies: str):
        for name, policy in policies.items():
            check_policy(name, policy, where="ox.Activations")
        object.__setattr__(self, "_items", tuple(sorted(policies.items())))

    def __setattr__(self, name, value):
        raise dataclasses.FrozenInstanceError(f"Activations is immutable; cannot set {name}")

    def items(self) -> tuple[tuple[str, Policy], ...]:
        return self._items

    def __eq__(self, other):
        return isinstance(other, Activations) and self._items == other._items

    def __hash__(self):
        return hash((Activations, self._items))

    def __repr__(self):
        inner = ", ".join(f"{name}={policy!r}" for name, policy in self._items)
        return f"Activations({inner})"

    # Copied and pickled by value through its constructor: the default protocol would
    # set `_items` on a bare instance, which `__setattr__` refuses. Being immutable, a
    # copy may be the object itself.
    def __reduce__(self):
        return (_from_items, (self._items,))

    def __copy__(self):
        return self

    def __deepcopy__(self, memo):
        return self


def _from_items(items: tuple) -> Activations:
    return Activations(**dict(items))


def activations(**policies: str) -> Any:
    """Declare a module's activation policies as a static field:

    ```python
    class Model(eqx.Module):
        activations: ox.Activations = ox.activations(x="offload")
    ```

    **Arguments:** `**policies`: each name given to `ox.name` with its policy,
    `"save"`, `"offload"` or `"remat"`. One name has one policy for the whole model; any
    module, at any depth, may declare names.

    **Returns:** an `eqx.field(static=True)` whose default is `ox.Activations(**policies)`.
    """
    return eqx.field(static=True, default=Activations(**policies))
