"""The vocabulary of placements: where an array leaf lives, declared on `eqx.Module` fields."""

import dataclasses
from typing import Any, Literal, cast, get_args

import equinox as eqx
from jax.sharding import PartitionSpec

Memory = Literal["device", "pinned_host"]
MEMORIES: tuple[str, ...] = get_args(Memory)

Role = Literal["param", "optimizer"]

Update = Literal["device", "host"]
UPDATES: tuple[str, ...] = get_args(Update)

METADATA_KEY = "offload_eqx"


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where the array leaves under one field live.

    - `memory`: `"device"` or `"pinned_host"`.
    - `spec`: an optional `jax.sharding.PartitionSpec` over the axis names of the mesh
        given to `ox.filter_jit`/`ox.place`; `None` means replicated.
    - `role`: `"param"` for model leaves, `"optimizer"` for optimizer state. Strategies
        override placements by role.
    - `update`: optimizer state only: where its update runs, `"device"` or `"host"`
        (`ox.offload_optimizer(update_on=...)`). State updated on the host lives in
        host memory, all of it (scalars too).
    """

    memory: Memory = "device"  # validated in __post_init__ with a full message
    spec: PartitionSpec | None = None
    role: Role = "param"
    update: Update = "device"

    def __post_init__(self):
        check_memory(self.memory, where="Placement(memory=...)")
        if self.update not in UPDATES:
            raise ValueError(f"Placement(update={self.update!r}); expected 'device' or 'host'.")
        if self.spec is not None and not isinstance(self.spec, PartitionSpec):
            raise TypeError(
                f"Placement spec {self.spec!r} is a {type(self.spec).__name__}; expected "
                "a `jax.sharding.PartitionSpec` (e.g. `P('fsdp', None)`) or None."
            )


def check_memory(memory: object, *, where: str) -> None:
    if memory not in MEMORIES:
        allowed = ", ".join(repr(m) for m in MEMORIES)
        raise ValueError(
            f"{where} has memory {memory!r}; expected one of {allowed}. Use 'device' to "
            "keep the array in accelerator memory or 'pinned_host' to keep it in host "
            "memory between steps."
        )


def field(
    *,
    memory: str = "device",
    spec: PartitionSpec | None = None,
    **kwargs: Any,
) -> Any:
    """An `eqx.field` that also says where the field's arrays live.

    **Arguments:**

    - `memory`: `"device"` (accelerator memory) or `"pinned_host"` (host memory between
        steps; fetched to the device inside `ox.scan`/`ox.checkpoint` regions).
    - `spec`: optional `PartitionSpec` for sharding the field's arrays over a mesh.
    - `**kwargs`: everything `eqx.field` takes (`converter`, `default`, ...), except
        `static=True`: a static field holds no arrays, so it has no memory.

    A field declared with `ox.field` is *managed*: strategies such as
    `"offload_params"` may move it. The value of `memory` is its placement under the
    model's own annotations (the default strategy). Every array leaf under the field
    (the field may hold a sub-module or a container) gets this placement. A module under
    the field brings its own region, as one `ox.annotate` selects does (`ox.scan` over a
    stacked module there fetches one layer at a time); the declaring class's region
    fetches the arrays its fields hold directly.

    **Returns:** an `eqx.field` whose metadata carries an `ox.Placement`.
    """
    check_memory(memory, where="ox.field(memory=...)")
    if kwargs.get("static", False):
        raise ValueError(
            f"ox.field(memory={memory!r}, static=True): a static field is part of the "
            "pytree structure and holds no arrays, so it cannot be placed in memory. "
            "Drop `static=True`, or use `eqx.field(static=True)` without a memory."
        )
    metadata = dict(kwargs.pop("metadata", {}))
    metadata[METADATA_KEY] = Placement(memory=cast(Memory, memory), spec=spec)
    declared = eqx.field(metadata=metadata, **kwargs)
    declared.__class__ = _Field
    return declared


# Called with each class that declares a field with `ox.field`, when the class is made:
# the tracing layer registers here what such a class needs (a region for its `__call__`).
ON_DECLARING_CLASS: list = []


class _Field(dataclasses.Field):
    """A dataclass field that tells `ON_DECLARING_CLASS` which class declares it."""

    __slots__ = ()

    def __set_name__(self, owner: type, name: str) -> None:
        super().__set_name__(owner, name)
        for hook in ON_DECLARING_CLASS:
            hook(owner)


def field_placement(f: dataclasses.Field) -> Placement | None:
    """The placement declared on a dataclass field, if any."""
    return f.metadata.get(METADATA_KEY)
