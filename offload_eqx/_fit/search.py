"""The state of one `ox.fit` search: traces, compiles, what they taught, and every row.

A `Search` traces and compiles candidate plans (`Choice`s) once each. What a compile
teaches is kept per base *and* placement (where parameters and optimizer state live): a
plan that keeps on the device at least what a compiled plan of the same base and
placement kept (the same names saved, in at least as many layers), where that one did not
fit, does not fit either and is not compiled. A plan is also not compiled when what it
needs at least, its device arguments and the named values it saves, is over the budget;
and when `CRASHES_PER_PLACEMENT` plans of its placement crashed the compiler.
"""

import dataclasses
import functools
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from .._base.compiler_faults import CompilerFaultError
from .._base.errors import ContractError
from .._base.table import format_bytes
from .._declare.activations import LayerSplit
from .._inspect.memory_report import compiled_report
from .._jit.jit import FilterJit, filter_jit
from .._plan.plan import Plan
from .._planning.estimate import StepEstimate, estimate_from, simulate_compiled
from .._planning.traced_time import (
    Costs,
    Load,
    load_of,
    speeds_of,
    trace_costs,
)
from .._targets.deviceless import program_of_step
from .._targets.isolated import CompileAborted
from .._targets.targets import Speeds, Target
from .space import Candidate, Choice, NamedValue

# Moving a leaf off the device frees more than its bytes: its gradient, and the float32
# temporaries of its update (a bf16 parameter moved to the host freed 3.5 times its bytes
# on the planner tests' decoder). A plan of another placement is pruned by a compiled one
# that did not fit only if it would not fit with 8 times the moved bytes freed.
FREED_PER_BYTE = 8
# After this many compiler crashes among plans of one placement, the rest of that
# placement is not compiled: XLA:TPU crashes on every plan that keeps stacked parameters
# in host memory, whatever it saves (`Search.why_not_compiled`).
CRASHES_PER_PLACEMENT = 2
# A plan predicted within this share of the best plan that fits is not compiled, and a
# family between plans is searched only if its fast end gains more (`refine`).
MIN_GAIN = 0.005


def key_of(seconds: float, load: Load) -> tuple:
    """The order of plans: predicted time, then (equal to 6 significant digits) the plan
    that moves and recomputes least."""
    return (float(f"{seconds:.6g}"), load.moved, load.recompute_flops)


def is_out_of_memory(error: Exception) -> bool:
    text = str(error)
    return "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower()


# Plans compiled after the search only to check the jaxpr count's order by simulation.
CHECKS = 3


def _shard_shape(leaf: Any) -> tuple:
    """The shape of one device's shard of a planned leaf (its whole shape off a mesh)."""
    try:
        return tuple(leaf.sharding.shard_shape(tuple(leaf.shape)))
    except (AttributeError, ValueError):
        return tuple(leaf.shape)


def _share(policy: Any, wanted: str, layers: int) -> float:
    """The share of a name's layers in which its policy is `wanted`."""
    if isinstance(policy, LayerSplit):
        first = min(policy.layers, layers) / layers
        return (first if policy.first == wanted else 0.0) + (
            1.0 - first if policy.rest == wanted else 0.0
        )
    return 1.0 if policy == wanted else 0.0


@dataclasses.dataclass
class Search:
    step: Any  # `ox.filter_jit` step (Any: type checkers read a Module's `__get__` as a method)
    args: tuple
    kwargs: dict
    target: Target
    budget: int
    host_limit: int
    max_compiles: int
    progress: Callable[[str], None]
    produced: Mapping[str, NamedValue] = dataclasses.field(default_factory=dict)
    fixed: dict[str, Any] = dataclasses.field(default_factory=dict)
    costs: dict = dataclasses.field(default_factory=dict)
    wrappers: dict = dataclasses.field(default_factory=dict)
    plans: dict = dataclasses.field(default_factory=dict)  # Choice -> Plan
    traces: int = 0
    compiles: int = 0
    # Compiled plans that did not fit (or that the compiler refused for memory), with the
    # device bytes they needed, by (base, placement): see `dominated`.
    over: dict = dataclasses.field(default_factory=dict)
    rows: dict = dataclasses.field(default_factory=dict)  # Choice -> Candidate
    crashed: dict = dataclasses.field(default_factory=dict)  # placement -> [first lines]
    # Known compiler faults compiled plans met (`ox.CompilerFaultError`): where every
    # compiled plan met one, no compile budget helps, and `ox.fit` raises the fault.
    faults: list = dataclasses.field(default_factory=list)
    best: tuple | None = None  # (key, choice, estimate) of the best plan that fits
    # Every compiled plan that fits: its count's key and its estimate (schedule simulated).
    fitting: dict = dataclasses.field(default_factory=dict)  # Choice -> (key, StepEstimate)
    least: tuple | None = None  # (device bytes, host bytes, label) of the least memory seen
    # placement -> the least host bytes a compiled plan of it needed beyond `host_bound`
    host_extra: dict = dataclasses.field(default_factory=dict)
    # (base, placement) -> the least device bytes a compiled plan of it needed beyond its
    # arguments and saved names: what the placement adds (a device update of state in
    # host memory fetches all of it), learned from the first compile of each
    device_extra: dict = dataclasses.field(default_factory=dict)

    @functools.cached_property
    def speeds(self) -> Speeds:
        """The target's speeds, read when first priced: after the first trace, which
        checks the call (the CPU's are measured, a second or more)."""
        return speeds_of(self.target)

    # -- tracing -------------------------------------------------------------------------

    def wrapper(self, choice: Choice) -> FilterJit:
        # One wrapper per plan: its trace, plan and compile are asked for several times.
        if choice not in self.wrappers:
            self.wrappers[choice] = filter_jit(
                self.step.fn,
                strategy=choice.strategy(self.fixed),
                donate=self.step.donate,
                mesh=self.step.mesh,
            )
        return self.wrappers[choice]

    def trace(self, choice: Choice) -> Costs | Exception:
        if choice not in self.costs:
            try:
                self.costs[choice] = trace_costs(
                    self.wrapper(choice), self.args, self.kwargs, self.target
                )
            except ContractError as error:  # e.g. a name with nothing to offload
                self.costs[choice] = error
            except ValueError as error:  # a streamed optimizer cannot update on the host
                if not choice.updates_on_host:
                    raise
                self.costs[choice] = error
            self.traces += 1
            self.report()
        return self.costs[choice]

    def report(self) -> None:
        best = "none yet" if self.best is None else self._best_label()
        self.progress(
            f"ox.fit {self.target.name}: {self.traces} traced, {self.compiles} compiled, "
            f"best so far: {best}"
        )

    def _best_label(self) -> str:
        assert self.best is not None
        _, choice, estimate = self.best
        return f"{choice.label} ({estimate.seconds * 1e3:.3f} ms)"

    # -- bounds --------------------------------------------------------------------------

    def argument_bytes(self, choice: Choice, memory: str) -> int:
        """Bytes of the arguments a plan puts in `memory` on each device ("device" counts
        unmanaged leaves too: they stay where they are, on the device); over a mesh, each
        leaf's shard."""
        plan = self.plan(choice)
        memories = (None, "device") if memory == "device" else (memory,)
        # `dtype.itemsize`, not NumPy's: a typed PRNG key (`jax.random.key`) is no NumPy
        # dtype, and its itemsize is its key data's bytes (8 for 'threefry'), as compiled.
        return sum(
            int(np.prod(_shard_shape(leaf), dtype=np.int64)) * leaf.dtype.itemsize
            for leaf in plan.leaves
            if leaf.memory in memories
        )

    def plan(self, choice: Choice) -> Plan:
        """The plan of `choice` for the step's arguments: the bounds ask for it hundreds of
        times over a search (3,872 plans, 39 s, in one search of the planner tests' decoder),
        so it is made once."""
        if choice not in self.plans:
            self.plans[choice] = self.wrapper(choice).plan(*self.args, **self.kwargs)
        return self.plans[choice]

    def devices(self, choice: Choice) -> int:
        """How many devices a plan runs on (its mesh's)."""
        return self.plan(choice).devices

    def named(self, choice: Choice, policy: str) -> int:
        """Bytes of the named values a plan gives `policy` (in the share of the layers
        where it does), on each device: over a mesh, split over every device at best (a
        lower bound). Under the save base the names saved are not counted: it keeps
        whatever XLA's residuals are."""
        if policy == "save" and choice.base == "save":
            return 0
        total = 0.0
        for name, value in choice.names:
            produced = self.produced.get(name)
            if produced is not None:
                total += produced.bytes * _share(value, policy, produced.layers)
        return int(total / self.devices(choice))

    def bound(self, choice: Choice) -> int:
        """The device memory a plan needs at least: its device arguments, the named
        values it saves (alive together when the backward pass starts), and the least
        that compiled plans of its base and placement needed beyond those."""
        return self._device_floor(choice) + self.device_extra.get(_family(choice), 0)

    def _device_floor(self, choice: Choice) -> int:
        return (
            self.argument_bytes(choice, "device")
            + self.named(choice, "save")
            + self._inputs_recomputed(choice)
        )

    def _inputs_recomputed(self, choice: Choice) -> int:
        """Bytes of the `ox.scan` layers' inputs a plan recomputes, on each device: the
        carry is still the layer's residual, kept on the device (without them, what a
        plan keeping them needed beyond its floor was learned as its family's extra, and
        the same family's plan that offloads them was predicted to need as much)."""
        policies = dict(choice.names)
        total = 0.0
        for name, value in self.produced.items():
            if value.layer_input:
                policy = policies.get(name, choice.base)
                total += value.bytes * _share(policy, "remat", value.layers)
        return int(total / self.devices(choice))

    def kept(self, choice: Choice) -> dict[str, float]:
        """The share of its layers in which each name is kept on the device: saved, or,
        for an `ox.scan` layer's input, not offloaded (recomputed, the carry is still the
        layer's residual; a name the plan does not list follows its base)."""
        policies = dict(choice.names)
        inputs = [n for n, value in self.produced.items() if value.layer_input]
        shares = {}
        for name in [*policies, *(n for n in inputs if n not in policies)]:
            value = self.produced.get(name)
            layers = getattr(value, "layers", 1)
            policy = policies.get(name, choice.base)
            shares[name] = _share(policy, "save", layers)
            if value is not None and value.layer_input:
                shares[name] += _share(policy, "remat", layers)
        return shares

    def dominated(self, choice: Choice) -> Choice | None:
        """A compiled plan of the same base that did not fit, keeps no more named values
        than `choice` keeps, and would still not fit with `FREED_PER_BYTE` times the
        argument bytes `choice` moves off the device taken from it, if there is one (of
        the same placement: it needed at least as much). Only a plan that updates where
        `choice` does (on the host, or on the device) dominates it: a device update
        fetches the state, a host update leaves it where it is, with the same arguments
        (a 33B decoder on a GH200: 175 GiB against 17)."""
        kept = self.kept(choice)
        arguments = self.argument_bytes(choice, "device")
        for (base, _), compiled in self.over.items():
            for other, needed in compiled if base == choice.base else ():
                if other.updates_on_host != choice.updates_on_host:
                    continue
                theirs = self.kept(other)
                if not all(kept.get(n, 0.0) >= share for n, share in theirs.items()):
                    continue
                moved = max(0, self.argument_bytes(other, "device") - arguments)
                if needed - FREED_PER_BYTE * moved > self.budget:
                    return other
        return None

    def host_bound(self, choice: Choice) -> int:
        needed = self.argument_bytes(choice, "pinned_host") + self.named(choice, "offload")
        return needed + self.host_extra.get(choice.placement, 0)

    def why_not_compiled(self, choice: Choice) -> str | None:
        """Why a plan is not worth compiling: over a budget by its bound, or out of
        compiles; None to compile it."""
        bound = self.bound(choice)
        if bound > self.budget:
            learned = self._device_floor(choice) <= self.budget  # over by what was learned
            how = ", as a compiled plan of its base and placement needed" if learned else ""
            return f"not compiled: predicted to need {format_bytes(bound)} of device memory{how}"
        heavier = self.dominated(choice)
        if heavier is not None:
            return f"not compiled: keeps at least what {heavier.label} kept, which did not fit"
        host = self.host_bound(choice)
        if host > self.host_limit:
            return f"not compiled: needs at least {format_bytes(host)} of host memory"
        crashes = self.crashed.get(choice.placement, [])
        if len(crashes) >= CRASHES_PER_PLACEMENT:
            return (
                f"not compiled: {len(crashes)} plans of its placement crashed the compiler "
                f"({crashes[0]})"
            )
        if self.compiles >= self.max_compiles:
            return f"not compiled: the {self.max_compiles} compiles allowed were used"
        return None

    # -- compiling -----------------------------------------------------------------------

    def compile(self, choice: Choice) -> Candidate:
        """Trace `choice` exactly, compile it for the target, record its row (a plan
        that does not fit is remembered for `dominated`), and keep it as the best if it
        fits and is faster."""
        label = choice.label
        costs = self.trace(choice)
        if isinstance(costs, Exception):
            return self._row(
                choice, Candidate(label, None, 0.0, 0.0, 0.0, None, None, str(costs)[:120])
            )
        exact = estimate_from(
            self.wrapper(choice), self.args, self.kwargs, self.target, costs, compile=False
        )
        self.compiles += 1
        moved = exact.h2d_bytes + exact.d2h_bytes

        def row(device=None, host=None, status="fits", simulated=None) -> Candidate:
            seconds, flops = exact.seconds, exact.recompute_flops
            return Candidate(label, None, seconds, moved, flops, device, host, status, simulated)

        try:
            program = program_of_step(self.wrapper(choice), self.args, dict(self.kwargs))
            report, compiled = compiled_report(program, self.target, label)
        except CompileAborted as error:  # XLA ended the child that compiled it
            self.crashed.setdefault(choice.placement, []).append("XLA aborted")
            return self._row(choice, row(status=str(error)))
        except Exception as error:
            if isinstance(error, CompilerFaultError):
                self.faults.append(error)
            if not is_out_of_memory(error):
                # A compiler crash on one plan (XLA:TPU crashes on some host-resident
                # layouts) is that plan's answer, shown in its row, not the search's end.
                text = str(error).strip()
                first = text.splitlines()[0][:160] if text else ""
                self.crashed.setdefault(choice.placement, []).append(first[:80])
                return self._row(
                    choice, row(status=f"compile failed: {type(error).__name__}: {first}")
                )
            unknown = (choice, self.budget + 1)  # refused: more than the budget, at least
            self.over.setdefault((choice.base, choice.placement), []).append(unknown)
            return self._row(
                choice, row(status="does not fit: the compiler ran out of device memory")
            )
        device, host = report.total, report.host_total
        extra = max(0, host - self.host_bound(choice) + self.host_extra.get(choice.placement, 0))
        self.host_extra[choice.placement] = min(extra, self.host_extra.get(choice.placement, extra))
        extra = max(0, device - self._device_floor(choice))
        self.device_extra[_family(choice)] = min(
            extra, self.device_extra.get(_family(choice), extra)
        )
        if device > self.budget:
            self.over.setdefault((choice.base, choice.placement), []).append((choice, device))
        if self.least is None or device < self.least[0]:
            self.least = (device, host, label)
        fits = device <= self.budget and host <= self.host_limit
        status = (
            "fits"
            if fits
            else f"over the device budget by {format_bytes(device - self.budget)}"
            if device > self.budget
            else f"over the host budget by {format_bytes(host - self.host_limit)}"
        )
        if not fits:
            return self._row(choice, row(device, host, status))
        # Searched by the jaxpr count (every candidate priced alike); each plan that fits
        # also carries its compiled program's simulation, which `ox.fit` chooses by.
        simulated = dataclasses.replace(
            exact,
            device_bytes=device,
            host_bytes=host,
            simulation=simulate_compiled(compiled, report, self.speeds, costs),
        )
        exact_key = key_of(exact.seconds, load_of(costs))
        self.fitting[choice] = (exact_key, simulated)
        if self.best is None or exact_key < self.best[0]:
            self.best = (exact_key, choice, simulated)
        return self._row(choice, row(device, host, status, simulated_seconds(simulated)))

    def fastest_simulated(self) -> tuple[Choice, StepEstimate] | None:
        """The compiled plan that fits with the least simulated step time; among those
        within `MIN_GAIN` of it, the one the count ranks first (it moves and recomputes
        least where the count ties)."""
        if not self.fitting:
            return None
        fastest = min(simulated_seconds(estimate) for _, estimate in self.fitting.values())
        near = [
            (key, choice, estimate)
            for choice, (key, estimate) in self.fitting.items()
            if simulated_seconds(estimate) <= fastest * (1 + MIN_GAIN)
        ]
        _, choice, estimate = min(near, key=lambda item: item[0])
        return choice, estimate

    def _row(self, choice: Choice, candidate: Candidate) -> Candidate:
        self.rows[choice] = candidate
        self.report()
        return candidate

    def skip(self, choice: Choice, seconds: float, load: Load, why: str) -> None:
        label = choice.label
        self.rows[choice] = Candidate(
            label, None, seconds, load.moved, load.recompute_flops, None, None, why
        )

    @property
    def best_estimate(self) -> StepEstimate | None:
        return None if self.best is None else self.best[2]


def simulated_seconds(estimate: StepEstimate) -> float:
    assert estimate.simulation is not None
    return estimate.simulation.seconds


def _family(choice: Choice) -> tuple:
    return (choice.base, choice.placement)
