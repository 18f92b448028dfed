"""Activation names under a strategy: each name's effective policy and the one remat policy.

A name's policy comes from the module that declares it, unless the strategy overrides
every name (`save`, `remat`, `offload`). The remat policy that regions compile is built
from the effective policies; the checks on what a trace produced live here too, so that
`ox.filter_jit` and `ox.audit` apply the same rules.
"""

from collections.abc import Callable, Mapping
from typing import Any

import jax.extend as jex
from jax import checkpoint_policies

from .._base.errors import ContractError, Violation
from .._base.primitives import VIEWS, is_var, scan_consts_and_carry
from .._declare.activations import LayerSplit, Policy, policies_of
from .._declare.strategy import Strategy

_NEVER_PRODUCED = (
    "Activation {name!r} is declared {policy!r} by `{module}`, but the program never "
    "produces it (names produced: {produced}). JAX would silently ignore it. Fix the "
    "spelling, call `ox.name(x, {name!r})` where the activation is computed, or remove "
    "the declaration."
)
_OUTSIDE_REGIONS = (
    "Activation {name!r} (declared {policy!r} by `{module}`) is only produced outside "
    "`ox.scan`/`ox.checkpoint` regions, where no remat policy applies, so it would be "
    "kept on the device whatever its policy. Call the module that names it through "
    "`ox.scan(...)` or `ox.checkpoint(...)`."
)


_UNDECLARED_OVERRIDE = (
    "Strategy {strategy!r} gives activation {name!r} a policy, but no module of this step "
    "declares it (declared: {declared}), so the policy would apply to nothing. Fix the "
    "spelling, or declare it with `ox.activations({name}=...)` on the module that calls "
    "`ox.name(x, {name!r})`."
)
_NOTHING_TO_OFFLOAD = (
    "Activation {name!r} is declared {policy!r} by `{module}` and offloaded under strategy "
    "{strategy!r}, but the backward pass never reads it, so the program saves nothing of it "
    "and there is nothing to offload (the derivatives of the operations that use it need "
    "other values, or none). Name the value the backward pass does read (often the input "
    "of the operation: `ox.name(x, {name!r})` before it), or declare {name!r} 'remat'."
)


_OX_SCAN_CARRY = (
    "Activation {name!r} is declared {policy!r} by `{module}` and offloaded under strategy "
    "{strategy!r}, but its value is the carry of `ox.scan` (each layer's input), and under "
    "this strategy nothing is rematerialised, so the layers run without a region and "
    "the scan keeps every carry for the backward pass whatever the policy: offloading it "
    "frees nothing. Use a strategy that rematerialises (`activations='remat'` or "
    "'offload'), or declare {name!r} 'save'."
)
_LOOP_CARRY = (
    "Activation {name!r} is declared {policy!r} by `{module}` and offloaded under strategy "
    "{strategy!r}, but its value is the carry of a scan (each layer's output is the next "
    "layer's input): the scan keeps every iteration's carry for the backward pass whatever "
    "the policy, so a loop carry cannot be offloaded. Apply the stacked layers with "
    "`ox.scan(layers, x)` instead of `jax.lax.scan`: it names the carry at each layer's "
    "boundary, inside the layer's region, where the policy applies; or name a value inside "
    "the layer; or declare {name!r} 'save' or 'remat'."
)


# The scope `ox.scan` runs its loop in, so that a carry name can say which scan it is.
OX_SCAN_SCOPE = "ox_scan"
# The scope an annotated module's region runs in, followed by the module's path, so that
# the audit says which module a transfer belongs to (and profiles show it).
MODULE_SCOPE = "ox_module:"


def module_in(stack: str) -> str | None:
    """The path of the innermost annotated module's region in a name stack (the string
    of an equation's `source_info.name_stack`), if any."""
    start = stack.rfind(MODULE_SCOPE)
    if start < 0:
        return None
    path = stack[start + len(MODULE_SCOPE) :]
    for end in ("/", ")"):
        path = path.split(end, 1)[0]
    return path or None


def carried_names(jaxpr: Any) -> dict[str, str]:
    """The names whose value is the carry of a scan, with the scan (`"ox.scan"` or
    `"jax.lax.scan"`): the value a body takes as its carry (an `ox.scan` layer's input)
    or returns as its carry (a block's output under a plain `jax.lax.scan`)."""
    found: dict[str, str] = {}

    def walk(j: Any, carry_in: set, carry_out: set, scan: str = "") -> None:
        for eqn in j.eqns:
            value = eqn.invars[0] if eqn.invars else None
            if eqn.primitive.name == "name" and (
                (is_var(value) and value in carry_in) or eqn.outvars[0] in carry_out
            ):
                found.setdefault(eqn.params["name"], scan)
            if eqn.primitive.name == "scan":
                body = eqn.params["jaxpr"].jaxpr
                start, n = scan_consts_and_carry(eqn.params)
                ours = OX_SCAN_SCOPE in str(eqn.source_info.name_stack)
                walk(
                    body,
                    set(body.invars[start : start + n]),
                    {v for v in body.outvars[:n] if is_var(v)},
                    "ox.scan" if ours else "jax.lax.scan",
                )
                continue
            for sub in jex.core.jaxprs_in_params(eqn.params):
                sub = getattr(sub, "jaxpr", sub)
                ins = zip(eqn.invars, sub.invars) if len(sub.invars) == len(eqn.invars) else ()
                outs = zip(eqn.outvars, sub.outvars) if len(sub.outvars) == len(eqn.outvars) else ()
                walk(
                    sub,
                    {inner for outer, inner in ins if is_var(outer) and outer in carry_in},
                    {inner for outer, inner in outs if is_var(inner) and outer in carry_out},
                    scan,
                )

    walk(jaxpr, set(), set())
    return found


def effective_policy(name: str, policy: Policy, strategy: Strategy) -> "Policy | LayerSplit":
    return strategy.policy_of(name, policy)


def _is_fetch(prim: Any, params: dict) -> bool:
    if prim.name != "device_put":
        return False
    return any(str(d).endswith("Device") for d in params.get("devices", ()))


_RECOMPUTED = VIEWS | {"broadcast_in_dim"}


def remat_policy(activations: Mapping[str, Policy], strategy: Strategy) -> Callable[..., Any]:
    """The policy of every region: named values as their policy says; everything else
    saved under a `save` strategy (views aside) and recomputed otherwise; a fetched copy
    of a host-resident leaf never saved (it is fetched again instead)."""
    saved = [n for n, p in activations.items() if p == "save"]
    offloaded = [n for n, p in activations.items() if p == "offload"]
    named = checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=saved,
        names_which_can_be_offloaded=offloaded,
        offload_src="device",
        offload_dst="pinned_host",
    )
    save_rest = strategy.activations == "save"

    def policy(prim, *avals, **params):
        if prim.name == "name":
            return named(prim, *avals, **params)
        # Under `save`, a view (a transpose, a cast, a reshape) or a broadcast is
        # recomputed from its operand rather than saved: the view of a fetched weight
        # (`w.T` or `u * D` inside a block's own `jax.checkpoint`, `w.astype(bf16)`) is a
        # device copy of the whole leaf, and its operand, the fetch, is fetched again
        # instead. Of an activation, its operand costs at most as much to keep.
        if save_rest and not _is_fetch(prim, params) and prim.name not in _RECOMPUTED:
            return True
        return named(prim, *avals, **params)

    return policy


def check_names(
    declared: Mapping[str, tuple[Policy, str]],
    effective: Mapping[str, "Policy | LayerSplit"],
    saves_everything: bool,
    inside_regions: set[str],
    outside_regions: set[str],
    regions: int,
    overrides: Mapping[str, "Policy | LayerSplit"] = {},
    strategy_name: str = "",
) -> None:
    """After a trace: every declared name must be produced, inside a region unless the
    strategy keeps everything. A program that enters no region and produces no declared
    name (an optimizer step, an init) does not run the model, and is not checked."""
    produced = inside_regions | outside_regions
    if regions == 0 and not produced & declared.keys():
        return
    for name in overrides:
        if name not in declared:
            raise ValueError(
                _UNDECLARED_OVERRIDE.format(
                    strategy=strategy_name, name=name, declared=sorted(declared) or "none"
                )
            )
    for name, (policy, module) in declared.items():
        if name in inside_regions:
            continue
        if name in outside_regions:
            if set(policies_of(effective[name])) == {"save"} and saves_everything:
                continue
            raise ValueError(_OUTSIDE_REGIONS.format(name=name, policy=policy, module=module))
        raise ValueError(
            _NEVER_PRODUCED.format(
                name=name, policy=policy, module=module, produced=sorted(produced) or "none"
            )
        )


def _scan_offloads(jaxpr: Any, offloaded: set[str], stacks: list[str]) -> None:
    named: dict[Any, str] = {}
    for eqn in jaxpr.eqns:
        stacks.append(str(eqn.source_info.name_stack))
        if eqn.primitive.name == "name":
            named[eqn.outvars[0]] = eqn.params["name"]
        elif eqn.primitive.name == "device_put" and any(
            str(d).endswith("Host") for d in eqn.params.get("devices", ())
        ):
            # A literal operand (`to_host(jnp.asarray(True))`) is no name, and unhashable.
            offloaded.update(
                named[v] for v in eqn.invars if not isinstance(v, jex.core.Literal) and v in named
            )
        for sub in jex.core.jaxprs_in_params(eqn.params):
            _scan_offloads(sub, offloaded, stacks)


def _name_layers(jaxpr: Any) -> dict[str, int]:
    """For each name, the trip count of the scans around where the program produces it."""
    found: dict[str, int] = {}

    def walk(j: Any, count: int) -> None:
        for eqn in j.eqns:
            if eqn.primitive.name == "name":
                found[eqn.params["name"]] = max(found.get(eqn.params["name"], 1), count)
            length = eqn.params["length"] if eqn.primitive.name == "scan" else 1
            for sub in jex.core.jaxprs_in_params(eqn.params):
                walk(getattr(sub, "jaxpr", sub), count * length)

    walk(jaxpr, 1)
    return found


def _offloads_somewhere(policy: "Policy | LayerSplit", layers: int) -> bool:
    """Whether a policy offloads in some of a scan's `layers` (a split may offload only
    past a scan's end)."""
    if isinstance(policy, LayerSplit):
        first = min(policy.layers, layers)
        return (policy.first == "offload" and first > 0) or (
            policy.rest == "offload" and first < layers
        )
    return policy == "offload"


def check_offloads(
    declared: Mapping[str, tuple[Policy, str]],
    effective: Mapping[str, "Policy | LayerSplit"],
    strategy: Strategy,
    jaxpr: Any,
) -> None:
    """In a differentiated program every name whose effective policy is "offload" must
    be moved to host memory: otherwise the backward pass never needed it, and the
    declaration does nothing. The audit reaches the same verdict through this check."""
    layers = _name_layers(jaxpr)
    wanted = [n for n, p in effective.items() if _offloads_somewhere(p, layers.get(n, 1))]
    if not wanted:
        return
    offloaded: set[str] = set()
    stacks: list[str] = []
    _scan_offloads(jaxpr, offloaded, stacks)
    if not any("transpose(" in s for s in stacks):
        return  # no backward pass: nothing is saved, nothing to offload
    missing = [n for n in wanted if n not in offloaded]
    if not missing:
        return
    carried = carried_names(jaxpr)
    templates = {"ox.scan": _OX_SCAN_CARRY, "jax.lax.scan": _LOOP_CARRY}
    messages = [
        templates.get(carried.get(n, ""), _NOTHING_TO_OFFLOAD).format(
            name=n, policy=declared[n][0], module=declared[n][1], strategy=strategy.name
        )
        for n in missing
    ]
    raise ContractError(
        " ".join(messages),
        [Violation("nothing to offload", n, m) for n, m in zip(missing, messages)],
    )
