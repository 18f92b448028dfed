"""`ox.fit`'s last step: plans between all and nothing, found by bisection over compiles.

When the fastest plans do not fit and the best plan that fits is slower, the amount in
between is searched: a name saved in the first `k` layers of each scan and offloaded (or
recomputed) in the rest, or the `h` largest parameters (or their optimizer state) in host
memory and the rest on the device. Each such family runs from a plan that fits (the
relaxed end) to a faster one that does not; memory grows about linearly along it, so a
bisection over compiles (as `ox.max_batch` does for the batch) finds the plan nearest the
fast end that fits, within the compiles left.
"""

import dataclasses
from collections.abc import Callable

from .._declare.activations import LayerSplit, Policy
from .._planning.traced_time import Load, predict
from .search import MIN_GAIN, Search
from .space import Choice

# Rows of plans shown not to fit without a measured size.
_SHOWN_OVER = ("does not fit", "not compiled: keeps", "not compiled: predicted to need")


@dataclasses.dataclass(frozen=True)
class Family:
    """Plans `member(t)` for `t` in `0..steps`: `member(0)` is the relaxed plan (less
    device memory), `member(steps)` the fast one that does not fit."""

    fast: Choice
    relaxed: Choice
    steps: int
    member: Callable[[int], Choice]
    what: str  # e.g. "layers saving 'q'"
    share: Callable[[int], float] | None = None  # of the way to `fast` (default t/steps)

    def toward_fast(self, t: int) -> float:
        return self.share(t) if self.share is not None else t / self.steps


def _name_families(search: Search, fast: Choice) -> list[Family]:
    families = []
    for name, policy in fast.names:
        value = search.produced.get(name)
        if policy != "save" or value is None or value.layers < 2:
            continue
        layers = value.layers
        relaxes: tuple[Policy, ...] = ("offload", "remat") if fast.base == "remat" else ("offload",)
        for relax in relaxes:
            relaxed = fast.with_policy(name, relax)

            def member(k: int, name=name, relax: Policy = relax, relaxed=relaxed) -> Choice:
                if k <= 0:
                    return relaxed
                if k >= layers:
                    return fast
                return fast.with_policy(name, LayerSplit("save", k, relax))

            families.append(Family(fast, relaxed, layers, member, f"layers saving {name!r}"))
    return families


def _leaf_families(search: Search, fast: Choice, fitting: list[Choice]) -> list[Family]:
    """From `fast` towards a plan that fits with the same base and names and more in host
    memory: the managed parameters moved one by one, largest first, with their optimizer
    state where the plan that fits keeps it on the host."""
    plan = search.wrapper(fast).plan(*search.args, **search.kwargs)
    leaves = sorted(
        (leaf for leaf in plan.leaves if leaf.role == "param" and leaf.memory is not None),
        key=lambda leaf: -leaf.nbytes,
    )
    count = len(leaves)
    families = []
    for relaxed in fitting:
        moves = {
            attr: getattr(relaxed, attr) == "pinned_host" and getattr(fast, attr) == "device"
            for attr in ("params", "optimizer")
        }
        same = relaxed.base == fast.base and relaxed.names == fast.names
        kept = all(
            getattr(relaxed, attr) == getattr(fast, attr)
            for attr, move in moves.items()
            if not move
        )
        if not (same and kept and any(moves.values())) or count < 2:
            continue

        def member(t: int, moves=moves, relaxed=relaxed) -> Choice:
            moved = count - t  # the `moved` largest in host memory
            if moved >= count:
                return relaxed
            if moved <= 0:
                return fast
            chosen = leaves[:moved]
            changes = {}
            if moves["params"]:
                changes["params"] = tuple((leaf.path, "pinned_host") for leaf in chosen)
            if moves["optimizer"]:
                patterns = ("*" + _below_root(leaf.path) for leaf in chosen)
                changes["optimizer"] = tuple((p, "pinned_host") for p in patterns)
            return fast.with_(**changes)

        total = sum(leaf.nbytes for leaf in leaves) or 1

        def share(t: int) -> float:  # the bytes still on the device, of all moved ones
            return sum(leaf.nbytes for leaf in leaves[count - t :]) / total

        families.append(Family(fast, relaxed, count, member, "leaves on the device", share))
    return families


def _below_root(path: str) -> str:
    """`.layers.w_up` of `model.layers.w_up`: what the path of its optimizer state ends
    with (`opt_state.inner[1][0].mu.layers.w_up`)."""
    cut = min((i for i in (path.find("."), path.find("[")) if i > 0), default=len(path))
    return path[cut:]


def _fits(search: Search, choice: Choice) -> bool | None:
    """Whether `choice` fits: from its row if it was compiled, its bound if that is over
    a budget, else by compiling it (None: no compile left, or it failed)."""
    row = search.rows.get(choice)
    if row is None or row.device_bytes is None:
        if search.why_not_compiled(choice) is not None:
            over = (
                search.bound(choice) > search.budget
                or search.host_bound(choice) > search.host_limit
            )
            return False if over else None
        row = search.compile(choice)
    if row.device_bytes is None:
        return False if row.status.startswith("does not fit") else None
    return row.device_bytes <= search.budget and (row.host_bytes or 0) <= search.host_limit


def _device_bytes(search: Search, choice: Choice) -> int:
    """The device memory a plan was measured at, or at least needs (its bound)."""
    row = search.rows.get(choice)
    if row is not None and row.device_bytes is not None:
        return row.device_bytes
    over = row is not None and row.status.startswith(_SHOWN_OVER)
    return max(search.bound(choice), search.budget + 1 if over else 0)


def _guess(search: Search, family: Family, low: int, high: int) -> int:
    """The member between `low` (fits) and `high` (does not) where device memory,
    interpolated linearly between the two, reaches the budget; strictly between them."""
    at_low = _device_bytes(search, family.member(low))
    at_high = _device_bytes(search, family.member(high))
    share_low, share_high = family.toward_fast(low), family.toward_fast(high)
    if at_high > at_low:
        reach = (search.budget - at_low) / (at_high - at_low)
        share = share_low + (share_high - share_low) * min(max(reach, 0.0), 1.0)
    else:
        share = share_high
    inside = [t for t in range(low + 1, high) if family.toward_fast(t) <= share]
    return inside[-1] if inside else low + 1


def _predicted(search: Search, family: Family, loads: dict[Choice, Load], t: int) -> float:
    fast, relaxed = loads[family.fast], loads[family.relaxed]
    return predict(relaxed + (fast - relaxed) * family.toward_fast(t), search.speeds)[0]


def _bisect(search: Search, family: Family, loads: dict[Choice, Load]) -> None:
    """The plan of `family` nearest its fast end that fits, within the compiles left.

    Each probe is where memory, interpolated between the nearest members known to fit
    and not to fit, reaches the budget (regula falsi: memory grows about linearly towards
    the fast end), or their midpoint after two probes on one side. Each compile is
    recorded by the search, which keeps the best plan. Members predicted no faster than
    the best plan so far are not compiled, and the search stops if the first that could
    beat it does not fit."""
    assert search.best is not None
    target = search.best[2].seconds * (1 - MIN_GAIN)
    worth = [t for t in range(1, family.steps) if _predicted(search, family, loads, t) < target]
    if not worth:
        return
    low, high = 0, family.steps  # member(0) fits: it is the relaxed plan
    sides: list[bool] = []
    while high - low > 1 and search.compiles < search.max_compiles:
        probe = _guess(search, family, low, high)
        if len(sides) >= 2 and sides[-1] == sides[-2]:
            # Memory is not linear: two probes on one side. Halve instead (Illinois).
            probe = (low + high) // 2
        probe = max(probe, worth[0])
        if probe >= high:
            return
        fits = _fits(search, family.member(probe))
        if fits is None:
            return
        if not fits and probe == worth[0]:
            return  # no member that could beat the best fits
        low, high = (probe, high) if fits else (low, probe)
        sides.append(fits)


def expected_seconds(search: Search, family: Family, loads: dict[Choice, Load]) -> float:
    """The predicted time of the member where memory is expected to reach the budget:
    the order in which families are searched."""
    return _predicted(search, family, loads, _guess(search, family, 0, family.steps))


def refine(search: Search, loads: dict[Choice, Load], best_seconds: float) -> None:
    """Search the families between each faster plan that does not fit (compiled over a
    budget, or pruned as over it) and the plans that fit, fastest first, within the
    compiles left."""
    faster, fitting = [], []
    for choice, row in search.rows.items():
        if choice not in loads:
            continue
        if row.device_bytes is not None and row.status in ("fits", "best"):
            fitting.append(choice)
        elif row.seconds < best_seconds and (
            (row.device_bytes is not None and row.device_bytes > search.budget)
            or row.status.startswith(("not compiled: predicted", "not compiled: keeps"))
        ):
            faster.append((row.seconds, choice))
    families = []
    for _, fast in sorted(faster, key=lambda item: item[0]):
        for family in _name_families(search, fast) + _leaf_families(search, fast, fitting):
            relaxed_load = loads.get(family.relaxed)
            if relaxed_load is None:
                continue
            # Worth it only if one step from the fast end is predicted faster than the best
            # by more than splitting a scan costs (a few launches: `MIN_GAIN` of the time).
            toward = family.toward_fast(family.steps - 1)
            near = relaxed_load + (loads[fast] - relaxed_load) * toward
            seconds = predict(near, search.speeds)[0]
            if seconds < best_seconds * (1 - MIN_GAIN):
                families.append((expected_seconds(search, family, loads), family))
    for _, family in sorted(families, key=lambda item: item[0]):
        if search.compiles >= search.max_compiles:
            return
        _bisect(search, family, loads)
