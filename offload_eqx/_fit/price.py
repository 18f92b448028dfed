"""`ox.fit`'s first step: what to search, and every candidate priced without a compile.

`find_space` traces the plan that recomputes every name once, to find the searchable
names (a plain scan's loop carry is fixed, with a note) and the placements the step allows.
`price` then traces the plan that recomputes everything and the plan that saves
everything, each with one name changed at a time, and each other placement of parameters
and optimizer state: a candidate's load is its base's plus the difference each of its
choices made alone (names interact little: each is its own tensor). Up to
`EXHAUSTIVE_NAMES` names every combination is a candidate; past that, a frontier.
"""

import dataclasses
from typing import Any

from .._host.compute import host_inline, host_update_problem
from .._planning.traced_time import PHASES, Delta, Load, load_of, predict
from .search import Search
from .space import (
    EXHAUSTIVE_NAMES,
    Choice,
    Space,
    carry_note,
    choices,
    describe_part,
    frontier,
    named_values,
)

SLICED = "host_sliced"
_FRONTIER = (
    "{count} names are searched along a frontier, not every combination (more than "
    "{limit} names would make 3^n candidates): from every name saved, names switch one at "
    "a time to their cheaper way of leaving the device (offload or remat), in order of "
    "the time each adds per byte it frees."
)


def find_space(search: Search) -> Space:
    """The names and placements to search; loop-carry names fixed and noted."""
    wrapper = search.step
    plan = wrapper.plan(*search.args, **search.kwargs)
    roles = {leaf.role for leaf in plan.leaves}
    declared = sorted(plan.declared_activations)
    params = ("device", "pinned_host") if "param" in roles else ("device",)
    # "host": the state in host memory, updated there, where the target can compute;
    # "host_sliced" too, where a host computation is a call of its own (XLA:GPU).
    platform = search.target.platform
    host: tuple[str, ...] = ()
    if host_update_problem(platform) is None:
        host = ("host",) if host_inline(platform) else ("host", SLICED)
    optimizer = ("device", "pinned_host", *host) if "optimizer" in roles else ("device",)
    everything = Choice("remat", tuple((n, "remat") for n in declared), "device", "device")
    first = search.trace(everything)
    if isinstance(first, Exception):
        raise first
    search.produced = named_values(first.jaxpr)
    notes = []
    for name in declared:
        value = search.produced.get(name)
        if value is not None and value.carry:
            search.fixed[name] = "remat"
            notes.append(carry_note(name, "remat"))
    names = tuple(n for n in declared if n in search.produced and n not in search.fixed)
    return Space(names, params, optimizer, tuple(notes))


def price(search: Search, space: Space) -> tuple[dict[Choice, Load], list[str]]:
    """Every candidate's load (or why it cannot run), composed from the loads of the
    plans that differ from its base in one choice each."""
    names, params, optimizer = space.names, space.params, space.optimizer
    remat = Choice("remat", tuple((n, "remat") for n in names), "device", "device")
    save = Choice("save", tuple((n, "save") for n in names), "device", "device")
    base_loads: dict[str, Load | str] = {}
    deltas: dict[tuple, Delta | str] = {}
    for base in (remat, save):
        base_load = base_loads[base.base] = _load(search.trace(base))
        for name in names:
            for policy in ("save", "offload") if base is remat else ("offload",):
                variant = base.with_policy(name, policy)
                deltas[(base.base, name, policy)] = _delta(search.trace(variant), base_load)
    for p in params:
        for o in optimizer:
            if (p, o) != ("device", "device") and o != SLICED:
                variant = remat.with_(params=p, optimizer=o)
                deltas[("placement", p, o)] = _delta(search.trace(variant), base_loads["remat"])
        if SLICED in optimizer:
            whole = remat.with_(params=p, optimizer="host")
            crossing = search.argument_bytes(whole, "pinned_host")
            deltas[("placement", p, SLICED)] = _sliced(deltas[("placement", p, "host")], crossing)
    notes = [
        f"Not searched: {describe_part(part)}, which {reason}."
        for part, reason in [(("base", b, ""), v) for b, v in base_loads.items()]
        + list(deltas.items())
        if isinstance(reason, str)
    ]

    def compose(choice: Choice) -> Load | None:
        load = base_loads[choice.base]
        parts = [(choice.base, n, p) for n, p in choice.names if p != choice.base]
        if (choice.params, choice.optimizer) != ("device", "device"):
            parts.append(("placement", choice.params, choice.optimizer))
        for part in parts:
            delta = deltas[part]
            if isinstance(load, str) or isinstance(delta, str):
                return None
            load = load + delta
        return load if isinstance(load, Load) else None

    if len(names) <= EXHAUSTIVE_NAMES:
        candidates = choices(names, params, optimizer)
    else:

        def seconds(choice: Choice) -> float | None:
            load = compose(choice)
            return None if load is None else predict(load, search.speeds)[0]

        sizes = {n: search.produced[n].bytes for n in names}
        candidates = frontier(names, params, optimizer, seconds, sizes)
        notes.append(_FRONTIER.format(count=len(names), limit=EXHAUSTIVE_NAMES))
    loads = {c: load for c in candidates if (load := compose(c)) is not None}
    return loads, notes


def _sliced(whole: Delta | str, crossing: int) -> Delta | str:
    """The update computed in slices (`update="host_sliced"`) against whole: the same
    work, and its results through device memory, crossing the link both ways in the
    update phase (priced for the whole host-resident state: only parameters past a
    slice's bytes are sliced, which the compiled schedule then prices exactly)."""
    if isinstance(whole, str):
        return whole
    sums = whole.sums.copy()
    update = PHASES.index("update")
    sums[update, 2] += crossing  # host to device: each slice's results, from the host call
    sums[update, 3] += crossing  # and back, written over the state
    return dataclasses.replace(whole, sums=sums)


def _load(costs: Any) -> Load | str:
    if isinstance(costs, Exception):
        return "fails: " + _first_sentence(str(costs))
    return load_of(costs)


def _first_sentence(text: str, limit: int = 400) -> str:
    """The error's first sentence, whole (cut at a word, with an ellipsis, only if it is
    longer than `limit`)."""
    first = text.split(". ")[0].strip().removesuffix(".")
    if len(first) <= limit:
        return first
    return first[:limit].rsplit(" ", 1)[0] + " ..."


def _delta(costs: Any, base: Load | str) -> Delta | str:
    """What a variant changes from its base (or why the variant, or its base, fails)."""
    load = _load(costs)
    if isinstance(base, str):
        return base
    return load if isinstance(load, str) else load - base
