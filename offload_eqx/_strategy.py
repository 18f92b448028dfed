"""Strategies: one argument that switches a whole model's placements and activation policy."""

import dataclasses
from collections.abc import Mapping
from typing import Any, Literal, get_args

from ._activations import Policy, check_policy

LeafMode = Literal["annotated", "device", "pinned_host"]
UpdateMode = Literal["annotated", "device", "host"]
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
    - `names`: per-name policies that override `activations` for those names:
        `{"q": "offload", "k": "save"}`. The values that are not named follow
        `activations` (kept under `"save"`, recomputed otherwise), so
        `Strategy("s", activations="save", names={"q": "offload"})` keeps everything but
        `q` on the device. Every name must be declared by some module (`ox.activations`),
        or the step raises naming it. Stored as sorted `(name, policy)` pairs: a strategy
        stays hashable.
    - `update`: where the update of `ox.offload_optimizer`'s state runs: `"annotated"`
        (as its `update_on=` says), `"device"`, or `"host"` (the state stays in host
        memory, scalars too, and only gradients and updates cross the link). `"host"`
        needs `optimizer` other than `"device"`.
    """

    name: str
    params: LeafMode = "annotated"
    optimizer: LeafMode = "annotated"
    activations: ActivationMode = "annotated"
    names: Any = ()  # Mapping[str, Policy] or (name, policy) pairs; stored as sorted pairs
    update: UpdateMode = "annotated"

    def __post_init__(self):
        for attr, allowed in (
            ("params", get_args(LeafMode)),
            ("optimizer", get_args(LeafMode)),
            ("activations", get_args(ActivationMode)),
            ("update", get_args(UpdateMode)),
        ):
            value = getattr(self, attr)
            if value not in allowed:
                raise ValueError(
                    f"Strategy {self.name!r} has {attr}={value!r}; expected one of "
                    + ", ".join(repr(a) for a in allowed)
                    + "."
                )
        names = self.names
        if isinstance(names, Mapping):
            names = tuple(names.items())
        try:
            pairs = tuple(sorted((str(n), p) for n, p in names))
        except (TypeError, ValueError):
            raise ValueError(
                f"Strategy {self.name!r} has names={self.names!r}; expected a mapping of "
                "activation names to policies, e.g. `names={'q': 'offload', 'k': 'save'}`."
            ) from None
        for name, policy in pairs:
            check_policy(name, policy, where=f"Strategy {self.name!r}")
        object.__setattr__(self, "names", pairs)
        if self.update == "host" and self.optimizer == "device":
            raise ValueError(
                f"Strategy {self.name!r} has update='host' and optimizer='device': an "
                "update on the host keeps the optimizer state in host memory. Use "
                "optimizer='pinned_host' (or 'annotated'), or update='device'."
            )

    def update_of(self, declared: str) -> str:
        """Where this strategy runs an optimizer update declared to run on `declared`."""
        return declared if self.update == "annotated" else self.update

    @property
    def name_policies(self) -> dict[str, Policy]:
        """The per-name overrides as a dict."""
        return dict(self.names)

    def policy_of(self, name: str, declared: Policy) -> Policy:
        """The policy this strategy gives activation `name`, declared `declared`."""
        for other, policy in self.names:
            if other == name:
                return policy
        return declared if self.activations == "annotated" else self.activations  # type: ignore[return-value]


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
            "`ox.Strategy(name, params=..., optimizer=..., activations=..., names=...)`."
        ) from None
