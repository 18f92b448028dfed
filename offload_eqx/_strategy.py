"""Strategies: one argument that switches a whole model's placements and activation policy."""

import dataclasses
from typing import Literal, get_args

LeafMode = Literal["annotated", "device", "pinned_host"]
ActivationMode = Literal["annotated", "save", "remat", "offload"]


@dataclasses.dataclass(frozen=True)
class Strategy:
    """How the plan overrides the model's own annotations.

    - `params`: where managed model leaves (fields declared with `ox.field` or
        `ox.annotate`) live: `"annotated"` (as declared), `"device"`, `"pinned_host"`.
    - `optimizer`: where the (non-scalar) state of `ox.offload_optimizer` lives, with the
        same values.
    - `activations`: `"annotated"` (each declared name as declared, every other value in
        a region recomputed), `"save"` (no rematerialisation: everything is kept on the
        device), `"remat"` (every value in a region is recomputed), `"offload"` (every
        declared name offloaded, everything else in a region recomputed).
    """

    name: str
    params: LeafMode = "annotated"
    optimizer: LeafMode = "annotated"
    activations: ActivationMode = "annotated"

    def __post_init__(self):
        for attr, allowed in (
            ("params", get_args(LeafMode)),
            ("optimizer", get_args(LeafMode)),
            ("activations", get_args(ActivationMode)),
        ):
            value = getattr(self, attr)
            if value not in allowed:
                raise ValueError(
                    f"Strategy {self.name!r} has {attr}={value!r}; expected one of "
                    + ", ".join(repr(a) for a in allowed)
                    + "."
                )


STRATEGIES: dict[str, Strategy] = {
    s.name: s
    for s in (
        Strategy("annotated"),
        Strategy("baseline", "device", "device", "save"),
        Strategy("remat", "device", "device", "remat"),
        Strategy("offload_activations", "device", "device", "offload"),
        Strategy("offload_params", "pinned_host", "device", "save"),
        Strategy("offload_optimizer", "device", "pinned_host", "save"),
        Strategy("hybrid", "pinned_host", "pinned_host", "offload"),
    )
}


def resolve_strategy(strategy: "str | Strategy | None") -> Strategy:
    if strategy is None:
        return STRATEGIES["annotated"]
    if isinstance(strategy, Strategy):
        return strategy
    try:
        return STRATEGIES[strategy]
    except (KeyError, TypeError):
        allowed = ", ".join(repr(s) for s in STRATEGIES)
        raise ValueError(
            f"Unknown strategy {strategy!r}; expected one of {allowed}, or an "
            "`ox.Strategy(name, params=..., optimizer=..., activations=...)`."
        ) from None
