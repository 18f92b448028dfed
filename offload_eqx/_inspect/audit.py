"""`ox.audit`: every transfer of a traced step, attributed, counted, and checked.

The audit traces the step (nothing runs, arguments may be `jax.ShapeDtypeStruct`s, any
backend) and walks its jaxpr. A transfer is a `device_put` whose input and output memory
spaces differ. Its bytes are multiplied by the trip count of every enclosing `scan`; a
`cond` counts its largest branch; a `while` loop, whose trip count is unknown, counts
once. Values are followed through the program (into and out of scan, remat and jit
bodies) so that each transfer is attributed to what it is: a parameter or
optimizer-state leaf by its path (what it moves, or what it is written into), a named
activation, the gradient of a host-resident parameter, or a function output.

The placement contract is checked on the same walk; each breach is a `Violation`
naming a path, and `ox.audit` raises a `ContractError` listing them all (the report is on
the error as `.report`).

The walk itself (transfer attribution, phases, the checks made per equation) is in
`jaxpr_walk`; the report types are in `transfer_report`; `program_audit` audits one
traced step (the planners call it with their `ox.filter_jit` step). This module wraps
what it is given in `ox.filter_jit` and hands it there. A host-resident leaf used where
it mixes memory spaces is found while tracing: `ox.filter_jit` raises `HostUseError` (a
`ContractError`) naming the leaves, and the audit lets it through.
"""

from collections.abc import Callable
from typing import Any

from .._base.errors import (
    ContractError as ContractError,
    Violation as Violation,
)
from .._jit.jit import step_of
from .jaxpr_walk import host_compute as host_compute
from .program_audit import audit_traced_for
from .transfer_report import Transfer as Transfer, TransferReport as TransferReport


def audit(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> TransferReport:
    """Every transfer of one call of `fn(*args, **kwargs)`, found on the traced program.

    **Arguments:**

    - `fn`: an `ox.filter_jit` function (its strategy, mesh and plan are used), or any
        callable, which is wrapped with `ox.filter_jit`.
    - `*args`, `**kwargs`: the call's arguments: arrays or `jax.ShapeDtypeStruct`s. Nothing
        is run and nothing is compiled, so any backend works.

    **Returns:** a `TransferReport`: each transfer's direction, what it belongs to (a
    parameter or optimizer-state leaf path, an activation name, a gradient, an output),
    shape, dtype, bytes per call (times the trip count of every enclosing scan; a cond
    counts its largest branch) and phase (`forward`, `backward`, `update`, or `call` for
    an argument copied before the program runs). `print(report)` shows a table;
    `report.to_json()`, `report.assert_only(...)`, `report.assert_no_implicit()`.

    **Raises:** `ContractError` (a `ValueError`) naming each leaf path that breaks the
    placement contract: a host-resident leaf fetched outside a region or used unfetched,
    arithmetic on host-typed values outside `ox.host_compute()`, host-typed gradients
    reaching the optimizer, an activation not saved/offloaded/recomputed as declared, an
    output returned in another memory than its argument's plan, an argument on another
    device. The report is attached as `error.report` when the program could be traced.
    """
    return audit_traced(fn, *args, **kwargs)[0]


def audit_traced(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[TransferReport, Any]:
    """`audit`, and the traced program it walked (a `jax.extend.core.Jaxpr`, dead code
    removed): `ox.estimate` counts the work of the same program."""
    report, jaxpr, _ = audit_traced_for(None, step_of(fn, "ox.audit"), args, kwargs)
    return report, jaxpr
