"""The audit of one traced step: its program walked (`jaxpr_walk`), seeded with where
each argument comes from and which argument each output is the new value of, then what
only the whole call shows: copies of arguments made before the program runs, outputs
returned in the wrong memory, declared activations not handled as declared, and
arguments on another device. `ox.audit` (`audit`) wraps the step it is given; the
planners (`traced_time`) pass their `ox.filter_jit` step here directly."""

from typing import Any

import jax
import numpy as np

from .._base.primitives import is_var
from .._base.table import format_bytes
from .._declare.activations import policies_of
from .._host.compute import traced_for
from .._jit.guard import device_offenders
from .._plan.plan import Plan
from .jaxpr_walk import (
    _dce,
    _nbytes,
    _Origin,
    _Walker,
)
from .transfer_report import Transfer, TransferReport

_ROLE_KIND: dict[str | None, str] = {"param": "parameter", "optimizer": "optimizer"}
_WRONG_MEMORY = (
    "Output `{out}` is returned in {got!r} memory, but it is the new value of `{path}`, "
    "which the plan puts in {want!r}: every next call would move it back (implicitly, "
    "{size}). Return it in {want!r}: update host-resident parameters with "
    "`ox.apply_updates`, or send it back with `jax.device_put(x, jax.memory.Space.{space})`."
)


def audit_traced_for(
    platform: str | None, wrapper: Any, args: tuple, kwargs: dict
) -> tuple[TransferReport, Any, dict]:
    """`audit_traced`, of the program traced for `platform` (a deviceless target's:
    "cuda" splits and slices the host update, and calls the GPU host's kernels, as the
    target's compile does), or for this machine where None; and the values of the
    constants that program closes over, by variable (a splash kernel's block mask)."""
    name = getattr(wrapper, "__name__", None) or type(wrapper).__name__
    # A host-resident leaf used outside a region fails this trace: `ox.filter_jit`
    # raises `HostUseError` naming it, which is the audit's answer too.
    entry, leaves = wrapper.compilation(*args, **kwargs)
    labelled = wrapper.arguments(*args, **kwargs)
    plan: Plan = entry.plan
    if platform is None or platform == plan.device.platform:
        closed = entry.jaxpr or jax.jit(entry.flat).trace(*entry.abstract(leaves)).jaxpr
    else:
        # The user's function traced anew (`entry.flat` evaluates this machine's trace).
        with traced_for(platform):
            flat = entry.remake(plan)
            closed = jax.jit(flat).trace(*entry.abstract(leaves)).jaxpr
    jaxpr = _dce(closed.jaxpr)

    matched = entry.output_arguments
    out_paths = entry.output_paths()
    outputs: dict[Any, tuple[str, str]] = {}
    for var, path, leaf in zip(jaxpr.outvars, out_paths, matched):
        if is_var(var):
            outputs[var] = (
                (_ROLE_KIND.get(leaf.role, "input"), leaf.path)
                if leaf is not None
                else ("output", path)
            )
    walker = _Walker(outputs)
    env = {
        var: _Origin(_ROLE_KIND.get(leaf.role, "input"), leaf.path)
        for var, leaf in zip(jaxpr.invars, plan.leaves)
    }
    walker.walk(jaxpr, env, 1, "forward", (), False, top=True)
    transfers = _argument_transfers(entry, leaves) + walker.transfers

    # Outputs land in the memory their argument is planned in.
    for path, leaf, memory, aval in zip(out_paths, matched, entry.out_memories, entry.out_avals):
        if leaf is not None and leaf.memory is not None and memory != leaf.memory:
            walker.violate(
                "output memory",
                path,
                _WRONG_MEMORY.format(
                    out=path,
                    got=memory,
                    path=leaf.path,
                    want=leaf.memory,
                    size=format_bytes(_nbytes(aval)),
                    space="Host" if leaf.memory == "pinned_host" else "Device",
                ),
            )
    _check_activations(plan, walker, transfers)
    _check_devices(labelled, walker)
    report = TransferReport(
        name, plan.strategy.name, transfers, walker.violations, walker.host_computations
    )
    return report.check(), jaxpr, dict(zip(closed.jaxpr.constvars, closed.consts))


def _argument_transfers(entry: Any, leaves: list) -> list[Transfer]:
    """Copies made before the program runs, on every call: NumPy arguments uploaded,
    arrays not in the memory the plan puts them in (moved by `ox.filter_jit`)."""
    found = []
    for leaf, leaf_plan, sharding in zip(leaves, entry.plan.leaves, entry.in_shardings):
        kind = _ROLE_KIND.get(leaf_plan.role, "input")
        direction = None
        if isinstance(leaf, (np.ndarray, np.generic)):
            direction = "host-to-device"
        elif isinstance(leaf, jax.Array) and sharding is not None:
            if leaf.sharding.memory_kind != sharding.memory_kind:
                direction = (
                    "device-to-host" if sharding.memory_kind == "pinned_host" else "host-to-device"
                )
        if direction is not None:
            found.append(
                Transfer(
                    direction=direction,
                    kind=kind,
                    what=leaf_plan.path,
                    shape=leaf_plan.shape,
                    dtype=str(leaf_plan.dtype),
                    count=1,
                    bytes=leaf_plan.nbytes,
                    phase="call",
                    where="argument",
                    implicit=True,
                )
            )
    return found


def _check_activations(plan: Plan, walker: _Walker, transfers: list[Transfer]) -> None:
    """What only the walk shows. A declared name never produced, or offloaded yet never
    moved, already failed the compilation (the plan's checks, shared with
    `ox.filter_jit`); here: a name moved although its policy says otherwise."""
    for name, policy in plan.activations.items():
        declared, module_path = plan.declared_activations[name]
        moved = [t for t in transfers if t.kind == "activation" and t.what == name]
        if "offload" not in policies_of(policy) and moved:
            walker.violate(
                "activation moved",
                name,
                f"Activation {name!r} is declared {policy!r} (effective policy) by "
                f"`{module_path}`, but the program moves it between memories "
                f"({format_bytes(sum(t.bytes for t in moved))} per call): a remat policy other "
                "than the plan's applies to it. Use the regions `ox.scan`/`ox.checkpoint`.",
            )


def _check_devices(labelled: list[tuple[str, Any]], walker: _Walker) -> None:
    offenders, majority = device_offenders(labelled)
    if majority is None:  # no offenders
        return
    for path, leaf in offenders:
        devices = ", ".join(str(d) for d in leaf.sharding.device_set)
        walker.violate(
            "argument on another device",
            path,
            f"Argument `{path}` is on {devices}, while the other arguments are on "
            f"{', '.join(map(str, majority))}: jit would copy it on every call (or refuse "
            "to run). Move it once, outside the step: `jax.device_put(x, device)`.",
        )
