"""A step with an ordered host callback and arrays in host memory: refused before any work.

JAX 0.10.2 to 0.12.0.1 cannot compile a program that has both an ordered effect
(`jax.experimental.io_callback(..., ordered=True)`, `jax.debug.print(..., ordered=True)`)
and any memory kind other than the device's: its lowering adds the ordering token to the
results' memory kinds but not to the memory kinds it propagated from the program's types
(`mlir.lower_jaxpr_to_fun`), and fails with `safe_zip() argument 1 has length 9 but
argument 0 has length 8`, on every backend, at the first call or report. The error here
says which callback and which leaves, and what to do, before anything is lowered.
"""

from typing import Any

import jax.extend as jex

from .._base.jax_private import ordered_effects
from .._sharding.memory_space import is_host_aval

_ORDERED_WITH_HOST = (
    "{caller}: the step has an ordered host callback ({what}) and {host}. JAX (0.10.2 to "
    "0.12) cannot compile the two together: its lowering fails with `safe_zip() argument "
    "1 has length ...` on every backend. Nothing was compiled or run. Make the callback "
    "unordered (`io_callback(..., ordered=False)`, `jax.debug.print` without "
    "`ordered=True`: calls may then run in any order), or keep every array on the device "
    '(`strategy="baseline"`, no `ox.offload_optimizer`, no activation offloaded).'
)


def _is_ordered(effects: Any) -> bool:
    return any(ordered_effects.contains(effect) for effect in effects)


def _ordered_callback(jaxpr: Any) -> str | None:
    """The first equation with an ordered effect, at any depth, described."""
    for eqn in jaxpr.eqns:
        if not _is_ordered(eqn.effects):
            continue
        for sub in jex.core.jaxprs_in_params(eqn.params):
            found = _ordered_callback(getattr(sub, "jaxpr", sub))
            if found is not None:
                return found
        function = getattr(eqn.params.get("callback"), "callback_func", None)
        label = getattr(function, "__qualname__", None) or "a function"
        return f"`{eqn.primitive.name}` of {label}"
    return None


def _host_values(jaxpr: Any) -> bool:
    """Whether any value of the program, at any depth, is typed in host memory."""
    for eqn in jaxpr.eqns:
        if any(is_host_aval(v.aval) for v in eqn.outvars):
            return True
        for sub in jex.core.jaxprs_in_params(eqn.params):
            if _host_values(getattr(sub, "jaxpr", sub)):
                return True
    return False


def check_ordered_with_host(closed: Any, host_paths: list[str], caller: str) -> None:
    """Refuse a program with an ordered effect that uses host memory: `host_paths` are
    the arguments and outputs planned there (leaf paths)."""
    if not _is_ordered(closed.effects):
        return
    if host_paths:
        shown = ", ".join(f"`{p}`" for p in host_paths[:4])
        more = f" and {len(host_paths) - 4} more" if len(host_paths) > 4 else ""
        host = f"leaves in host memory ({shown}{more})"
    elif _host_values(closed.jaxpr):
        host = "values moved to host memory inside it (offloaded activations or a host computation)"
    else:
        return
    what = _ordered_callback(closed.jaxpr) or "an ordered effect"
    raise ValueError(_ORDERED_WITH_HOST.format(caller=caller, what=what, host=host))
