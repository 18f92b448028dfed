"""Named activations and the per-name policy: keep on device, offload to host, or recompute."""

import dataclasses
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


def activations(**policies: str) -> Any:
    """Declare a module's activation policies as a static field:

    ```python
    class Model(eqx.Module):
        activations: ox.Activations = ox.activations(x="offload")
    ```
    """
    return eqx.field(static=True, default=Activations(**policies))
