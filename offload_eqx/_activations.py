"""Named activations and the per-name policy: keep on device, offload to host, or recompute."""

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator
from typing import Any, Literal, get_args

import equinox as eqx
from jax.ad_checkpoint import checkpoint_name

Policy = Literal["save", "offload", "remat"]
POLICIES: tuple[str, ...] = get_args(Policy)


def check_policy(name: str, policy: object, *, where: str) -> None:
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


@dataclasses.dataclass
class _TraceRecord:
    """What one `ox.filter_jit` trace saw, for checks after the trace."""

    inside_regions: set[str] = dataclasses.field(default_factory=set)
    outside_regions: set[str] = dataclasses.field(default_factory=set)
    regions: int = 0


_RECORD: contextvars.ContextVar[_TraceRecord | None] = contextvars.ContextVar(
    "offload_eqx_record", default=None
)
_REGION_DEPTH: contextvars.ContextVar[int] = contextvars.ContextVar(
    "offload_eqx_region_depth", default=0
)


@contextlib.contextmanager
def recording() -> Iterator[_TraceRecord]:
    record = _TraceRecord()
    token = _RECORD.set(record)
    try:
        yield record
    finally:
        _RECORD.reset(token)


@contextlib.contextmanager
def in_region() -> Iterator[None]:
    record = _RECORD.get()
    if record is not None:
        record.regions += 1
    token = _REGION_DEPTH.set(_REGION_DEPTH.get() + 1)
    try:
        yield
    finally:
        _REGION_DEPTH.reset(token)


def name(x: Any, name: str) -> Any:
    """Name an activation so that the plan's policy can save, offload or recompute it.

    A thin layer over `jax.ad_checkpoint.checkpoint_name` that also records, while
    `ox.filter_jit` traces, that the name was produced and whether inside a region: a
    declared name that the program never produces is an error, not a silent no-op.
    """
    if not isinstance(name, str) or not name:
        raise TypeError(f"ox.name(x, {name!r}): the name must be a non-empty string.")
    record = _RECORD.get()
    if record is not None:
        if _REGION_DEPTH.get() > 0:
            record.inside_regions.add(name)
        else:
            record.outside_regions.add(name)
    return checkpoint_name(x, name)
