"""What each jaxpr primitive means to the audit: structure, a view, data movement, a callback.

The walk (`_inspect.jaxpr_walk`) treats equations by kind: structural ones (control flow, nested
programs, transfers, names) are entered or followed; views and pure data movement carry
their operand's attribution and are not arithmetic even on host-typed values; host
callbacks are transfers; everything else is computation.
"""

from typing import Any

import jax.extend as jex


def is_var(v: Any) -> bool:
    """Whether a jaxpr atom is a variable (not a literal constant)."""
    return isinstance(v, jex.core.Var) and not isinstance(v, jex.core.Literal)


# Equations that move or structure values rather than compute on them: host-typed
# operands are fine here (a scan slicing host-resident layers, a region receiving them).
STRUCTURAL = frozenset(
    {
        "device_put",
        "scan",
        "while",
        "cond",
        "pjit",
        "jit",
        "closed_call",
        "core_call",
        "remat2",
        "checkpoint",
        "custom_jvp_call",
        "custom_vjp_call",
        "custom_vjp_call_jaxpr",
        "name",
        "optimization_barrier",
        "sharding_constraint",
        "reshard",
        "mesh_cast",
        "pvary",
    }
)
# Equations whose output is a view of their only input: the attribution follows them.
VIEWS = frozenset(
    {
        "reshape",
        "squeeze",
        "expand_dims",
        "copy",
        "copy_p",
        "convert_element_type",
        "transpose",
        "reshard",
        "sharding_constraint",
        "mesh_cast",
        "pvary",
        "name",
    }
)
# Pure data movement: slicing, indexing, concatenating, padding, reordering or selecting
# elements computes nothing, and XLA runs it on host-resident buffers as well (the
# layer-streamed optimizer slices its state on the host and writes each layer back with
# `dynamic_update_slice`). Host-typed operands are fine here; the output is attributed to
# the first operand that has an origin (a slice of `opt_state.mu` is still `opt_state.mu`).
DATA_MOVEMENT = frozenset(
    {
        "slice",
        "dynamic_slice",
        "dynamic_update_slice",
        "gather",
        "scatter",
        "concatenate",
        "pad",
        "transpose",
        "reshape",
        "squeeze",
        "expand_dims",
        "broadcast_in_dim",
        "rev",
        "copy",
        "copy_p",
        "select_n",
        "split",
    }
)
# Host callbacks: the runtime copies their operands to the host and their results back
# to the device on every call, a transfer no `device_put` shows.
_DEBUG_PRINT = "debug_print"


def is_callback(prim: str) -> bool:
    return prim == _DEBUG_PRINT or prim.endswith("callback")


def callback_name(eqn) -> str:
    """What the table calls a callback: the user's function, or the format string."""
    prim = eqn.primitive.name
    if prim == _DEBUG_PRINT:
        return f"jax.debug.print({eqn.params.get('fmt', '')!r})"
    callback = eqn.params.get("callback")
    function = getattr(callback, "callback_func", None)  # pure_callback, io_callback
    if function is None and callback is not None:
        # jax.debug.callback wraps the user's function in a closure over `callback`.
        names = getattr(callback, "__code__", None)
        cells = getattr(callback, "__closure__", None) or ()
        if names is not None:
            free = dict(zip(names.co_freevars, cells))
            if "callback" in free:
                function = free["callback"].cell_contents
    label = {
        "pure_callback": "jax.pure_callback",
        "io_callback": "io_callback",
        "debug_callback": "jax.debug.callback",
    }.get(prim) or prim
    name = getattr(function, "__qualname__", None) or getattr(function, "__name__", None)
    return f"{label}({name})" if name else label


def phase_of(stack: str, phase: str, seen_backward: bool) -> str:
    """The phase of an equation with name stack `stack`, in a body whose phase is `phase`,
    after (`seen_backward`) or before a backward equation at its level: `transpose(...)`
    is the backward pass, `jvp(...)` the forward pass, what follows the backward pass the
    `update`. The audit's walk and the work counter both use this rule."""
    if phase == "backward" or "transpose(" in stack:
        return "backward"
    if "jvp(" in stack:
        return "forward"
    return "update" if seen_backward else phase


def scan_consts_and_carry(params: dict) -> tuple[int, int]:
    """How many of a scan's inputs are constants and how many its carry. jax 0.10 names
    them `num_consts` and `num_carry`; jax 0.11 packs the inputs' groups into `ft_in`
    (constants, carry, scanned), each as long as its inputs."""
    if "num_consts" in params:
        return params["num_consts"], params["num_carry"]
    consts, carry, _ = params["ft_in"].unpack()
    return len(consts), len(carry)
