"""Strategies: one argument that switches a whole model's placements and activation policy."""

import dataclasses
import fnmatch
from collections.abc import Mapping, Sequence
from typing import Any, Literal, get_args

from .activations import LayerSplit, Policy, check_layer_split

LeafMode = Literal["annotated", "device", "pinned_host"]
UpdateMode = Literal["annotated", "device", "host", "host_sliced"]
# The updates that run on the host, the state in host memory.
HOST_UPDATES: tuple[str, ...] = ("host", "host_sliced")
ActivationMode = Literal["annotated", "save", "remat", "offload"]


def _leaf_modes(name: str, attr: str, value: Any) -> Any:
    """A leaf mode as given, or `{pattern: memory}` (or pairs) as pairs in order."""
    allowed = get_args(LeafMode)
    if isinstance(value, str) and value in allowed:
        return value
    pairs = tuple(value.items()) if isinstance(value, Mapping) else value
    try:
        pairs = tuple((str(pattern), memory) for pattern, memory in pairs)
    except (TypeError, ValueError):
        pairs = None
    if not pairs or any(memory not in allowed for _, memory in pairs):
        raise ValueError(
            f"Strategy {name!r} has {attr}={value!r}; expected one of "
            + ", ".join(repr(a) for a in allowed)
            + ", or a mapping of leaf-path patterns to them, e.g. "
            f"`{attr}={{'*.mlp.*': 'pinned_host'}}`."
        )
    return pairs


_OFFLOADS_NOTHING = (
    "Strategy {strategy!r} offloads {what}, but {missing}, so it would offload nothing. {fix}"
)
_UNMATCHED_PATTERNS = (
    "Strategy {strategy!r} has {attr} patterns that match no managed {noun} leaf: "
    "{patterns}, so they place nothing. The managed {noun} leaves are {paths}. A pattern "
    "is a glob over the whole leaf path (`'*.w1'` matches `model.layers.w1`; an "
    "optimizer-state pattern may match the path of the parameter the leaf mirrors): fix "
    "the pattern, or drop it."
)


@dataclasses.dataclass(frozen=True)
class Strategy:
    """How the plan overrides the model's own annotations.

    - `params`: where managed model leaves (fields declared with `ox.field` or
        `ox.annotate`) live: `"annotated"` (as declared), `"device"`, `"pinned_host"`;
        or leaf by leaf, a mapping of glob patterns over leaf paths to memories, the
        first match deciding and unmatched leaves as declared:
        `{"*.mlp.*": "pinned_host"}`.
    - `optimizer`: where the (non-scalar) state of `ox.offload_optimizer` lives, with the
        same values; a pattern selects a state leaf when it matches the leaf's own path
        (Adam's `opt_state.inner[1][0].mu.layers.mlp.w_up`) or the path of the
        parameter the leaf mirrors (`model.layers.mlp.w_up`), so `"*.mlp.*"` selects the
        state of the parameters it selects, streamed or not.
    - `activations`: `"annotated"` (each declared name as declared, every other value in
        a region recomputed), `"save"` (no rematerialisation: everything is kept on the
        device), `"remat"` (every value in a region is recomputed), `"offload"` (every
        declared name offloaded, everything else in a region recomputed).
    - `names`: per-name policies that override `activations` for those names:
        `{"q": "offload", "k": "save"}`. The values that are not named follow
        `activations` (kept under `"save"`, recomputed otherwise), so
        `Strategy("s", activations="save", names={"q": "offload"})` keeps everything but
        `q` on the device. A policy can differ between layers: `("save", 10, "offload")`
        saves `q` in the first 10 layers of every `ox.scan` and offloads it in the rest
        (an `ox.LayerSplit`). Every name must be declared by some module
        (`ox.activations`), or the step raises naming it. Stored as sorted `(name,
        policy)` pairs: a strategy stays hashable.
    - `update`: where the update of `ox.offload_optimizer`'s state runs: `"annotated"`
        (as its `update_on=` says, except that `optimizer="device"` updates on the
        device), `"device"`, `"host"` (the state stays in host memory, scalars too,
        and only gradients and updates cross the link), or `"host_sliced"`: as
        `"host"`, and where the host computation is a call of its own (XLA:GPU), the
        update of every parameter whose new state and value exceed 1 GiB is computed a
        slice at a time, each slice's results written over the state, so the host holds
        the state once and nothing of the update beside it; each slice's results pass
        through device memory, so they cross the link twice (elementwise
        transformations only: Adam, AdamW, SGD, Lion; others are computed whole).
        `ox.fit` plans it where the update computed whole is over the host budget. Both
        need `optimizer` other than `"device"`. A delayed update (`delay=1`) on XLA:GPU
        is computed in slices unless the strategy says `"host"`: whole, it overlaps the
        step but holds the state twice.
    """

    name: str
    params: Any = "annotated"  # LeafMode, or {pattern: memory}; stored as pairs in order
    optimizer: Any = "annotated"
    activations: ActivationMode = "annotated"
    names: Any = ()  # Mapping[str, Policy] or (name, policy) pairs; stored as sorted pairs
    update: UpdateMode = "annotated"

    def __post_init__(self):
        for attr in ("params", "optimizer"):
            object.__setattr__(self, attr, _leaf_modes(self.name, attr, getattr(self, attr)))
        for attr, allowed in (
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
        pairs = tuple(
            (name, check_layer_split(name, policy, where=f"Strategy {self.name!r}"))
            for name, policy in pairs
        )
        object.__setattr__(self, "names", pairs)
        if self.update in HOST_UPDATES and self.optimizer == "device":
            raise ValueError(
                f"Strategy {self.name!r} has update={self.update!r} and optimizer='device': "
                "an update on the host keeps the optimizer state in host memory. Use "
                "optimizer='pinned_host' (or 'annotated'), or update='device'."
            )

    def update_of(self, declared: str) -> str:
        """Where this strategy runs an optimizer update declared to run on `declared`:
        as `update` says, or where the state lives when the strategy keeps all of it on
        the device (`"baseline"`, `optimizer="device"`: a host update would move the
        state to the host), else as declared."""
        if self.update != "annotated":
            return self.update
        return "device" if self.optimizer == "device" else declared

    @property
    def name_policies(self) -> dict[str, "Policy | LayerSplit"]:
        """The per-name overrides as a dict."""
        return dict(self.names)

    def policy_of(self, name: str, declared: Policy) -> "Policy | LayerSplit":
        """The policy this strategy gives activation `name`, declared `declared`."""
        for other, policy in self.names:
            if other == name:
                return policy
        return declared if self.activations == "annotated" else self.activations  # type: ignore[return-value]

    def memory_of(self, role: str, path: str, declared: str, mirrors: str | None = None) -> str:
        """Where this strategy puts a managed leaf of `role` ("param" or "optimizer") at
        `path`, declared in `declared`. An optimizer-state leaf that mirrors the parameter
        at `mirrors` is matched by a pattern matching either path (its own path ends with
        the parameter's in `optax`'s state, `inner[0].mu.layers.w1`, but not in a
        streamed one, `inner.leaves.layers.w1[0].mu`)."""
        mode = self.params if role == "param" else self.optimizer
        if isinstance(mode, str):
            return declared if mode == "annotated" else mode
        paths = (path,) if mirrors is None else (path, mirrors)
        for pattern, memory in mode:
            if any(fnmatch.fnmatchcase(p, pattern) for p in paths):
                return declared if memory == "annotated" else memory
        return declared

    def check_patterns(self, leaves: "Sequence[Any]") -> None:
        """Each leaf pattern matches some managed leaf of its role among `leaves` (a
        plan's `LeafPlan`s): a mistyped pattern would leave its leaves where they were
        declared, silently. A role with no leaves here is not checked (a strategy serves
        steps with and without an optimizer)."""
        for role, attr, noun in (
            ("param", "params", "parameter"),
            ("optimizer", "optimizer", "optimizer-state"),
        ):
            mode = self.params if role == "param" else self.optimizer
            mine = [leaf for leaf in leaves if leaf.role == role]
            if isinstance(mode, str) or not mine:
                continue
            paths = [p for leaf in mine for p in (leaf.path, leaf.mirrors) if p is not None]
            unmatched = [
                repr(pattern)
                for pattern, _ in mode
                if not any(fnmatch.fnmatchcase(p, pattern) for p in paths)
            ]
            if unmatched:
                shown = ", ".join(f"`{leaf.path}`" for leaf in mine[:4])
                more = f" and {len(mine) - 4} more" if len(mine) > 4 else ""
                raise ValueError(
                    _UNMATCHED_PATTERNS.format(
                        strategy=self.name,
                        attr=attr,
                        patterns=", ".join(unmatched),
                        noun=noun,
                        paths=shown + more,
                    )
                )

    def check_offloads_something(self, roles: set, names_declared: bool) -> None:
        """A strategy that asks for host memory must find something to put there: leaves
        of the `roles` it moves, or declared activation names."""
        asked = []
        if self.puts_on_host("param"):
            asked.append(
                (
                    "parameters",
                    "param" in roles,
                    "no array leaf is declared with `ox.field(...)` or `ox.annotate(...)`",
                    "Mark the fields that may live in host memory, e.g. "
                    "`w: jax.Array = ox.field(memory='device')`, or "
                    "`ox.annotate(model, lambda m: m.layers, memory='device')`.",
                )
            )
        if self.activations == "offload":
            asked.append(
                (
                    "activations",
                    names_declared,
                    "no module declares any activation names",
                    "Name activations with `ox.name(x, 'x')` and declare them with "
                    "`ox.activations(x='offload')`.",
                )
            )
        optimizer_found = self.puts_on_host("optimizer") and "optimizer" in roles
        if not asked or optimizer_found or any(found for _, found, _, _ in asked):
            return
        what, _, missing, fix = asked[0]
        if len(asked) > 1:
            what = " and ".join(a[0] for a in asked)
            missing = "; ".join(a[2] for a in asked)
            fix = " ".join(a[3] for a in asked)
        raise ValueError(
            _OFFLOADS_NOTHING.format(strategy=self.name, what=what, missing=missing, fix=fix)
        )

    def puts_on_host(self, role: str) -> bool:
        """Whether this strategy moves some managed leaves of `role` to host memory."""
        mode = self.params if role == "param" else self.optimizer
        if isinstance(mode, str):
            return mode == "pinned_host"
        return any(memory == "pinned_host" for _, memory in mode)

    def describe(self) -> str:
        """`hybrid`, or the strategy's fields where it is a composed one, one line."""
        parts = [f"activations={self.activations}"]
        for attr in ("params", "optimizer"):
            mode = getattr(self, attr)
            shown = mode if isinstance(mode, str) else ", ".join(f"{p}: {m}" for p, m in mode)
            parts.append(f"{attr}={shown}")
        if self.names:
            parts.append("names=" + ", ".join(f"{n}={p}" for n, p in self.names))
        if self.update != "annotated":
            parts.append(f"update={self.update}")
        return f"{self.name} (" + "; ".join(parts) + ")"


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
"""The preset strategies by name: `annotated` (the default: the model's own
annotations), `baseline`, `remat`, `offload_activations`, `offload_params`,
`offload_optimizer` and `hybrid`. `ox.filter_jit(..., strategy=name)` takes any of them."""


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
