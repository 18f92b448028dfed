"""The order in which `ox.fit` compiles candidates: by the jaxpr count's predicted time
(`compile_in_order`), each plan that does not fit followed by the most frugal of its
family; then the count's best plan of a few other families, to check its order against
the compiled schedules (`check_by_simulation`)."""

from .._planning.traced_time import Load, predict
from .search import CHECKS, MIN_GAIN, Search, key_of, simulated_seconds
from .space import Choice


def check_by_simulation(search: Search, loads: dict[Choice, Load]) -> None:
    """The jaxpr count misjudges most where plans differ in kind: it prices every value
    as written to memory (XLA fuses most away, and a saved attention matrix costs more
    traffic than its recomputation), and it sees no collective and no exposed copy. So
    the count's best plan of each other base and placement (`family`) that has no
    compiled plan fitting, and that may fit, is compiled too, up to `CHECKS` of them in
    the count's order: `ox.fit` then answers with the fastest simulated plan.

    Where the update runs is checked first: a host update overlaps the device's work in
    the compiled schedule (a delayed one beside both loops) and takes the optimizer's
    kernels off the device, which the count cannot see. So when no compiled plan that
    fits updates on the host (or none on the device), the count's best plan that does
    is the first checked, if the count prices it below the fastest simulated plan (an
    undelayed host update at scale, which the count prices about as the simulation does
    and several times slower, costs no compile)."""
    if not search.fitting:
        return
    compiled = {(c.base, c.placement) for c in search.fitting}
    priced = sorted(
        ((key_of(predict(load, search.speeds)[0], load), c) for c, load in loads.items()),
        key=lambda item: item[0],
    )
    fastest = search.fastest_simulated()
    assert fastest is not None
    updates = {_on_host(c) for c in search.fitting}
    other = [
        c
        for key, c in priced
        if _on_host(c) not in updates and key[0] < simulated_seconds(fastest[1])
    ]
    # The first of `other` is met twice: the second time it is skipped as compiled.
    order = other[:1] + [choice for _, choice in priced]
    checked = 0
    for choice in order:
        family = (choice.base, choice.placement)
        if checked >= CHECKS or search.compiles >= search.max_compiles:
            break
        if family in compiled or search.why_not_compiled(choice) is not None:
            continue
        row = search.rows.get(choice)
        if row is not None and not row.status.startswith("not compiled"):
            continue  # compiled already, and did not fit
        compiled.add(family)  # one try per family, whether it fits or not
        search.compile(choice)
        checked += 1


def _on_host(choice: Choice) -> bool:
    """Whether the plan updates on the host."""
    return choice.updates_on_host


def compile_in_order(search: Search, loads: dict[Choice, Load]) -> None:
    """Compile the candidates in order of predicted time until the rest are slower than
    the best plan that fits; a candidate bounded over a budget is not compiled."""
    priced = sorted(
        ((key_of(predict(load, search.speeds)[0], load), choice) for choice, load in loads.items()),
        key=lambda item: item[0],
    )
    for key, choice in priced:
        load = loads[choice]
        if choice in search.rows:
            continue  # compiled already, as a probe
        if search.best is not None and key > search.best[0]:
            why = "not compiled: predicted slower than the best plan that fits"
            search.skip(choice, key[0], load, why)
            continue
        if search.best is not None and key[0] > search.best[2].seconds * (1 - MIN_GAIN):
            # Near the best: a compile is better spent on the plans between (`refine`).
            why = "not compiled: predicted within 0.5% of the best plan that fits"
            search.skip(choice, key[0], load, why)
            continue
        why = search.why_not_compiled(choice)
        if why is not None:
            search.skip(choice, key[0], load, why)
            continue
        row = search.compile(choice)
        if row.device_bytes is None or row.device_bytes > search.budget:
            _probe_frugal(search, choice, loads)


def _probe_frugal(search: Search, over: Choice, loads: dict[Choice, Load]) -> None:
    """After a plan does not fit, the plan of its base and placement that keeps no named
    value on the device: if that does not fit either, no plan of the family does, and
    none is compiled."""
    relaxed = "remat" if over.base == "remat" else "offload"
    frugal = over.with_(names=tuple((n, relaxed) for n, _ in over.names))
    if frugal != over and frugal not in search.rows and frugal in loads:
        if search.why_not_compiled(frugal) is None:
            search.compile(frugal)
