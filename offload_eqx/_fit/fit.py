"""`ox.fit`: the fastest plan whose compiled memory fits the device and the host.

The search, step by step as `fit` below calls them (each step's module in brackets):

1. **Price by composition** (`price`, over the candidates of `space`). A handful of
   traces, no compile: the plan that recomputes every value (every name `remat`,
   everything on the device); that plan with one name saved, and with one name
   offloaded, for each searchable name; the plan that saves everything, and it with one
   name offloaded; and the first plan with each other placement of parameters and
   optimizer state. Each candidate's load (`estimate.Load`) is its base's plus the
   difference each of its choices made alone, and the time model prices it. Names
   interact little (each is its own tensor), so the composed price is close; the plans
   that matter are then traced exactly.
2. **Bound the memory** (`search`). A candidate needs at least its device-resident
   arguments and the named values it saves; one that keeps at least what a compiled plan
   of its base and placement kept, where that one did not fit, does not fit either.
   Neither is compiled; after a plan does not fit, the plan of its family that keeps no
   named value is compiled next, to rule out the whole family at once.
3. **Compile in order of predicted time** (`search`; ties: fewer bytes moved, then fewer
   FLOPs recomputed): each candidate is traced exactly and compiled for the target; the
   compile decides whether it fits, and what does not fit prunes its family. The loop
   stops at the first candidate predicted slower than the best plan that fits, or after
   `max_compiles` compiles.
4. **Refine** (`refine`): between the best plan that fits and each faster plan that
   does not, the amount in between (a name saved in `k` of `L` layers, the `h` largest
   leaves on the host) is found by bisection over compiles.
5. **Check by simulation** (`search`): every compiled plan that fits has its
   compiled program's schedule simulated; up to `CHECKS` more plans that the jaxpr count
   ranked behind the best, but below the fastest simulated time, are compiled too (first
   one that updates where no compiled plan that fits does, on the host or on the device,
   if the count prices it below that time), and the plan returned is the fastest
   simulated one. The count cannot see collectives, exposed copies, fusion or a host
   update overlapping the loops; the simulation can.
6. **Explain** (`result`): the result, or an error saying what was shown: that no plan
   fits (the least memory found, by the most frugal plan), or which plans that might fit
   were left untried when the compiles ran out, and which compiles crashed.
"""

import time
from collections.abc import Callable
from typing import Any

from .._base.options import checks_options
from .._base.progress import reporting
from .._jit.jit import step_of
from .._targets.devices import require_compiler
from .._targets.isolated import isolating
from .._targets.targets import get_target
from .order import check_by_simulation, compile_in_order
from .price import find_space, price
from .refine import refine
from .result import FitResult, explain, result_of
from .search import Search

_NO_BUDGET = "ox.fit: target {target!r} has no known device memory; pass `device_budget=` in bytes."


@checks_options
def fit(
    step: Callable[..., Any],
    *args: Any,
    target: "str | Any",
    device_budget: int | None = None,
    host_budget: int | None = None,
    max_compiles: int = 12,
    progress: Callable[[str], Any] | bool | None = None,
    **kwargs: Any,
) -> FitResult:
    """The plan with the least predicted step time whose compiled memory fits.

    **Arguments:**

    - `step`: an `ox.filter_jit` training step (its function, donation and mesh are kept;
        its strategy is what the search replaces).
    - `*args`, `**kwargs`: its arguments at the batch to plan for (arrays or
        `jax.ShapeDtypeStruct`s).
    - `target`: a name in `ox.TARGETS` or a `Target`.
    - `device_budget`: bytes of device memory per device (default: the target's capacity).
    - `host_budget`: bytes of host memory per device, 0 for none (default: the target's
        `speeds.host_memory`).
    - `max_compiles`: at most this many compiles (each candidate that is priced exactly
        is compiled once).
    - `progress`: called with one line after every trace and compile (e.g. `print`);
        by default a status line on stderr when it is a terminal (none under pytest or
        with `CI` set); `True` always shows it, `False` never.

    Searched: each declared activation name's policy (save, offload, remat) over a base
    that saves or recomputes everything else, and where managed parameters and optimizer
    state live (device, pinned_host, or updated on the host); then, between the best plan
    that fits and faster ones that do not, a name's policy in a number of layers
    (`("save", k, "offload")`) and the largest leaves on the host. A name that is a plain
    `jax.lax.scan`'s loop carry is not searched (`FitResult.notes` says why); an `ox.scan`
    layer's input is.

    How: every candidate is priced by the jaxpr count from a few traces (no compile),
    candidates are compiled in order of that time until the rest are predicted slower
    than the best plan that fits, and a plan that keeps at least what an over-budget plan
    of the same base and placement kept is not compiled. Each compiled plan that fits is
    priced again by simulating its compiled schedule (collectives, exposed copies, a host
    update overlapping the loops), a few plans the count ranked just behind are compiled
    to check its order (first, one that updates on the host if only device updates were
    compiled, or the reverse, when the count prices it below the fastest simulated
    plan), and the plan returned is the fastest simulated one. The planning guide of the
    documentation site ("Planning: estimate, fit, max_batch") has an example.

    **Returns:** an `ox.FitResult`: `.strategy` (an `ox.Strategy` for `ox.filter_jit`),
    `.estimate`, `.candidates`.

    **Raises:** `ValueError` when no plan fits, saying what was shown: the memory of the
    most frugal plan, or the plans left untried when the compiles ran out; and the
    compiles that failed. Before any work: `TypeError`/`ValueError` for a budget or
    `max_compiles` that is not a positive int of any integer type (the host budget may
    be 0).
    """
    resolved = get_target(target)
    require_compiler(resolved)  # a missing extra (cuDNN), before any trace
    budget = device_budget if device_budget is not None else resolved.capacity
    if budget is None:
        raise ValueError(_NO_BUDGET.format(target=resolved.name))
    wrapper = step_of(step, "ox.fit")
    started = time.perf_counter()
    # Each plan not compiled before is compiled in a child process: an XLA abort on one
    # is that plan's answer, not the end of this process (`isolated`).
    with reporting("ox.fit", progress) as report, isolating(resolved):
        search = Search(wrapper, args, kwargs, resolved, budget, 0, max_compiles, report)
        # 1. The candidates, priced by composition from a few traces (`price`). The first
        #    trace checks the call, before the CPU's speeds are measured.
        space = find_space(search)
        search.host_limit = host_budget if host_budget is not None else search.speeds.host_memory
        loads, not_searched = price(search, space)
        # 2-3. Compiled in order of predicted time; memory bounds prune (`search`).
        compile_in_order(search, loads)
        # 4. Between the best plan that fits and faster ones that do not (`refine`).
        if search.best is not None:
            refine(search, loads, search.best[2].seconds)
            # 4b. The count's order checked by simulation on a few more plans (`search`).
            check_by_simulation(search, loads)
        # 6. The answer, or what was shown (`result`): with nothing fitting, the most frugal
        #    plan is compiled if it was not, since it may fit and shows the least memory.
        frugal = search.rows.get(space.frugal())
        measured = frugal is not None and frugal.device_bytes is not None
        if search.best is None and not measured and search.compiles < max_compiles:
            search.compile(space.frugal())
        if search.best is None:
            raise explain(search, space)
        return result_of(search, [*space.notes, *not_searched], started)
