"""Remat regions and the names inside them: `ox.checkpoint`, `ox.scan`, `ox.name`.

A region is a `jax.checkpoint` with the plan's remat policy that fetches the module's
host-resident leaves to the device *inside* it. Inside is what matters: the fetched copy
is then recomputed (fetched again) in the backward pass instead of being kept alive as a
residual, so host-resident weights never occupy device memory for the whole step.

A name given to a region's *output* (a block's result) is not a residual of that region:
the next region saves its input whatever the policy. So the region that receives a named
value renames it at its boundary, inside, where the policy applies to it.
"""

from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from .._declare.activations import check_name
from .._plan.plan import Plan
from .._plan.remat_policy import OX_SCAN_SCOPE
from .._plan.walk import format_keys
from .._sharding.memory_space import is_host_typed, to_device
from .argument_writes import Snapshot, refuse_layer_writes, write_back
from .fetches import fetch_captured, fetched, labels_of
from .segments import segmented
from .state import (
    active_plan,
    argument_path,
    current,
    in_region,
    inside_region,
    name_of,
    note_name,
    record_name,
)

_AXIS_MISMATCH = (
    "ox.scan: the leaves of the stacked module disagree on the length of the layer axis "
    "{axis}: {lengths}. Every array leaf of a stacked module has the layers along axis "
    "{axis}; build it with `eqx.filter_vmap(make_layer)(keys)` or stack the leaves with "
    "`jax.tree.map(lambda *xs: jnp.stack(xs), *layers)`."
)
_HOST_AXIS = (
    "ox.scan(..., axis={axis}): `{path}` is host-resident, and host-resident leaves can "
    "only be scanned over axis 0 (scanning another axis makes XLA transpose the whole "
    "array before fetching it to the device, which is costly and unsupported on some "
    "platforms). Stack the layers along axis 0, or place `{path}` on the device."
)
_NOT_CALLABLE = (
    "{caller} was given {value!r} (a {kind}) as the module, which is not callable. Pass "
    "the module (or function) first and its inputs after it: `{caller}(block, x)`."
)


def name(x: Any, name: str) -> Any:
    """Name an activation so that the plan's policy can save, offload or recompute it.

    A thin layer over `jax.ad_checkpoint.checkpoint_name` that also records, while
    `ox.filter_jit` traces, that the name was produced and whether inside a region: a
    declared name that the program never produces is an error, not a silent no-op.

    **Returns:** `x`, named; its policy is declared with `ox.activations(name=...)`.
    """
    check_name(name, where="ox.name(x, name)")
    record_name(name)
    out = checkpoint_name(x, name)
    if inside_region():
        for leaf in jax.tree_util.tree_leaves(out):
            note_name(leaf, name)
    return out


def _plan_for(module: Any) -> Plan:
    plan = active_plan()
    return Plan([("module", module)]) if plan is None else plan


def _names_of(tree: Any) -> list[str | None]:
    """For each leaf of `tree`, the name `ox.name` gave it in this trace, if any."""
    return [name_of(x) for x in jax.tree_util.tree_leaves(tree)]


def _rename(tree: Any, names: list[str | None]) -> Any:
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    renamed = [x if n is None else name(x, n) for x, n in zip(leaves, names)]
    return jax.tree_util.tree_unflatten(treedef, renamed)


def _region(
    plan: Plan,
    has_host_leaves: bool,
    prevent_cse: bool,
    out_names: list,
    policy=None,
    labels: list = (),  # type: ignore[assignment]
    in_loop: bool = False,
) -> Callable:
    """A function `(module, args, kwargs, in_names) -> output` that runs in a region,
    with `policy` (by default the plan's, outside any scan); `labels` (see `labels_of`)
    name the module's leaves. The call runs on copies of `args` and `kwargs`; what it
    writes into their dicts and lists is written into the caller's (`argument_writes`),
    except `in_loop` (the body of `ox.scan`), where such a write is refused."""
    out_types: list = []
    writes: list = []

    def body(module, args, kwargs, in_names):
        module = fetched(module, list(labels))
        with in_region():
            args = _rename(args, in_names)
            snapshot = Snapshot((args, kwargs))
            out = module(*args, **kwargs)
            out_names[:] = _names_of(out)
            out_types[:] = [_type_of(x) for x in jax.tree_util.tree_leaves(out)]
            changes = snapshot.changes()
            if in_loop:
                refuse_layer_writes(snapshot, changes)
            writes[:] = [(index, kind) for index, kind, _ in changes]
            return out, [contents for _, _, contents in changes]

    run = body
    if not plan.saves_everything or has_host_leaves or plan.offloads_activations:
        # Else nothing to fetch and nothing to offload: a plain call, as without
        # offload_eqx. A name offloaded under `save` (`names={"h": "offload"}`) needs the
        # region: the policy that offloads it applies only inside one.
        run = eqx.filter_checkpoint(body, policy=policy or plan.policy, prevent_cse=prevent_cse)

    def region(module, args, kwargs, in_names):
        out, contents = run(module, args, kwargs, in_names)
        changes = [(index, kind, c) for (index, kind), c in zip(writes, contents)]
        write_back((args, kwargs), changes)
        return out if run is body else _as_returned(out, out_types)

    return region


def _type_of(x: Any) -> tuple | None:
    if not eqx.is_array(x):
        return None
    aval = jax.typeof(x)
    return aval.dtype, aval.weak_type


def _as_returned(out: Any, types: list) -> Any:
    """The region's outputs as the call returned them: a constant array output (BatchNorm's
    `jnp.array(False)` first-time flag) comes out of `jax.checkpoint` as a Python or NumPy
    scalar, which would change the structure of the state between steps. The user never
    asked for a region, so it is turned back into the array it was."""
    leaves, treedef = jax.tree_util.tree_flatten(out)
    if len(leaves) != len(types) or all(
        eqx.is_array(x) or t is None for x, t in zip(leaves, types)
    ):
        return out
    fixed = [
        x if t is None or eqx.is_array(x) else _array_like(x, *t) for x, t in zip(leaves, types)
    ]
    return jax.tree_util.tree_unflatten(treedef, fixed)


def _array_like(value: Any, dtype: Any, weak_type: bool) -> jax.Array:
    array = jnp.asarray(value)  # a Python scalar gives a weakly typed array
    if array.dtype != dtype or array.weak_type != weak_type:
        array = jnp.asarray(value, dtype=dtype)
    return array


_HIDDEN_ARRAYS = (
    "{caller}: the function given as the module ({fn}) wraps a module whose arrays it "
    "hides in a closure ({paths}), so the region cannot see its host-resident leaves to "
    "fetch them (a `jax.vmap(block)` or a lambda does that). Pass a module instead: "
    "`eqx.filter_vmap(block)` for a vmapped block, or the block itself."
)


def _check_not_hidden(fn: Callable, caller: str) -> None:
    """A function wrapping a module (`jax.vmap(block)`: `__wrapped__` is the block) hides
    its arrays from the region; refuse it when any of them is host-resident."""
    if isinstance(fn, eqx.Module):
        return
    wrapped = getattr(fn, "__wrapped__", None)
    hidden = jax.tree_util.tree_flatten_with_path(wrapped)[0] if wrapped is not None else []
    paths = [argument_path(x) or "module" + format_keys(p) for p, x in hidden if is_host_typed(x)]
    if paths:
        name = getattr(fn, "__name__", type(fn).__name__)
        raise TypeError(
            _HIDDEN_ARRAYS.format(
                caller=caller, fn=name, paths=", ".join(f"`{p}`" for p in paths[:3])
            )
        )


def _note_outputs(out: Any, names: list[str | None]) -> None:
    """Remember which outputs of a region carry a name, for the region that takes them."""
    for leaf, n in zip(jax.tree_util.tree_leaves(out), names):
        if n is not None:
            note_name(leaf, n)


def boundary_names(tree: Any, name: str | None, names: list[str | None]) -> list[str | None]:
    """`names` (one per leaf of `tree`) with `name` given to every floating-point array
    leaf: the names an annotated module gives its input or output (`ox.annotate(...,
    inputs=, outputs=)`). Integer inputs (tokens) and keys are not activations."""
    if name is None:
        return names
    leaves = jax.tree_util.tree_leaves(tree)
    return [name if eqx.is_inexact_array(x) else n for x, n in zip(leaves, names)]


def name_boundary(tree: Any, name: str | None) -> Any:
    """`tree` with its floating-point arrays named `name` (see `boundary_names`)."""
    names = boundary_names(tree, name, [None] * len(jax.tree_util.tree_leaves(tree)))
    return _rename(tree, names)


def checkpoint(module: Any, *args: Any, **kwargs: Any) -> Any:
    """Call `module(*args, **kwargs)` inside a remat region.

    The region applies the plan's activation policy to every value named with `ox.name`
    inside the call, and fetches the module's host-resident leaves to the device inside
    the region (again in the backward pass), so their device copies are never residuals.
    `module` is an `eqx.Module` (or a function of plain arrays): wrap a vmapped block
    with `eqx.filter_vmap(block)`, not `jax.vmap(block)`, which hides its arrays. What
    the call writes into a dict or list among its arguments reaches the caller's, as
    without the region.

    **Returns:** what `module(*args, **kwargs)` returns.
    """
    if not callable(module):
        raise TypeError(
            _NOT_CALLABLE.format(caller="ox.checkpoint", value=module, kind=type(module).__name__)
        )
    _check_not_hidden(module, "ox.checkpoint")
    return call_in_region(module, args, kwargs)


def call_in_region(
    module: Any, args: tuple, kwargs: dict, inputs: str | None = None, outputs: str | None = None
) -> Any:
    """`ox.checkpoint(module, *args, **kwargs)`, the floating-point arrays of the first
    argument named `inputs` at the region's boundary, inside it (where the policy
    applies), and those of the output named `outputs` for the region that takes them."""
    module = fetch_captured(module)
    in_names = _names_of(args)
    if args:
        first = len(jax.tree_util.tree_leaves(args[0]))
        in_names[:first] = boundary_names(args[0], inputs, in_names[:first])
    has_host = any(is_host_typed(x) for x in jax.tree_util.tree_leaves(module))
    out_names: list = []
    region = _region(_plan_for(module), has_host, True, out_names, labels=labels_of(module))
    out = region(module, args, kwargs, in_names)
    _note_outputs(out, boundary_names(out, outputs, out_names))
    return out


def _layer_lengths(with_paths: list, axis: int) -> dict[int, list[str]]:
    lengths: dict[int, list[str]] = {}
    for path, leaf in with_paths:
        where = argument_path(leaf) or "stacked" + format_keys(path)
        if axis != 0 and is_host_typed(leaf):
            raise ValueError(_HOST_AXIS.format(axis=axis, path=where))
        if jnp.ndim(leaf) <= axis:
            lengths.setdefault(-1, []).append(f"`{where}` (shape {tuple(jnp.shape(leaf))})")
        else:
            lengths.setdefault(jnp.shape(leaf)[axis], []).append(f"`{where}`")
    return lengths


def scan(
    stacked: Any,
    carry: Any,
    *args: Any,
    axis: Any = 0,  # an int; checked below with a message naming the fix
    unroll: int | bool = 1,
    **kwargs: Any,
) -> Any:
    """Apply a stacked module layer after layer: `carry = layer_i(carry, *args, **kwargs)`.

    **Arguments:**

    - `stacked`: a module whose array leaves all have a leading layer axis (for example
        built with `eqx.filter_vmap`). Non-array fields are shared by every layer.
    - `carry`: the input of the first layer; each layer returns the input of the next.
    - `*args`, `**kwargs`: passed unchanged to every layer (masks, positions, ...); a
        layer writing into a dict or list among them is refused (carry it instead).
    - `axis`: the layer axis of the leaves (0 by default; host-resident leaves must use 0).
    - `unroll`: passed to `jax.lax.scan`.

    Each layer runs in its own remat region (see `ox.checkpoint`). A name a layer gives
    its output applies at the next layer's boundary, where the carry is saved.

    **Returns:** the carry after the last layer.
    """
    if not callable(stacked):
        raise TypeError(
            _NOT_CALLABLE.format(caller="ox.scan", value=stacked, kind=type(stacked).__name__)
        )
    if not isinstance(axis, int) or isinstance(axis, bool) or axis < 0:
        raise TypeError(
            f"ox.scan(..., axis={axis!r}): the layer axis is a non-negative int (0 for "
            "leaves stacked along their first dimension)."
        )
    dynamic, static = eqx.partition(fetch_captured(stacked), eqx.is_array)
    with_paths = jax.tree_util.tree_flatten_with_path(dynamic)[0]
    if not with_paths:
        raise ValueError(
            "ox.scan: the stacked module has no array leaves, so there is no layer axis "
            "to scan over. Pass a module whose leaves are stacked along axis 0."
        )
    label_tree = jax.tree_util.tree_map(lambda x: argument_path(x) or "", dynamic)
    lengths = _layer_lengths(with_paths, axis)
    if len(lengths) > 1 or -1 in lengths:
        described = "; ".join(
            ("no such axis: " if n == -1 else f"length {n}: ") + ", ".join(paths)
            for n, paths in sorted(lengths.items())
        )
        raise ValueError(_AXIS_MISMATCH.format(axis=axis, lengths=described))
    if 0 in lengths:
        return carry  # no layers: as `jax.lax.scan` of length 0, the carry unchanged
    if axis != 0:
        dynamic = jax.tree_util.tree_map(lambda x: jnp.moveaxis(x, axis, 0), dynamic)
    plan = _plan_for(stacked)
    has_host = any(is_host_typed(x) for x in jax.tree_util.tree_leaves(dynamic))
    out_names: list = []
    carry_names = _carry_names(dynamic, static, carry, args, kwargs, plan)

    segments = plan.segments(next(iter(lengths)))
    # Each layer's leaves are slices of the stacked argument leaves: the same labels.
    labels = jax.tree_util.tree_leaves(eqx.combine(label_tree, static))

    def layer_step(policy):
        region = _region(plan, has_host, False, out_names, policy, labels, in_loop=True)

        def step(carry, layer_dynamic, args, kwargs):
            layer = eqx.combine(layer_dynamic, static)
            return region(layer, (carry, *args), kwargs, carry_names)

        return step

    def run(carry, dynamic, args, kwargs):
        if len(segments) == 1:
            call = layer_step(segments[0][2])
            with jax.named_scope(OX_SCAN_SCOPE):
                return jax.lax.scan(
                    lambda c, layer: (call(c, layer, args, kwargs), None),
                    carry,
                    dynamic,
                    unroll=unroll,
                )[0]
        # One scan per segment of layers with its own policy (a name's policy split by
        # layers), the stacked leaves' gradient written in place (`segmented`).
        leaves, tree = jax.tree_util.tree_flatten(dynamic)
        arrays, others = eqx.partition((args, kwargs), eqx.is_array)
        const_leaves, const_tree = jax.tree_util.tree_flatten(arrays)
        steps = {id(policy): layer_step(policy) for _, _, policy in segments}

        def call_segment(carry, layer_leaves, consts, policy):
            layer_dynamic = jax.tree_util.tree_unflatten(tree, layer_leaves)
            call_args, call_kwargs = eqx.combine(
                jax.tree_util.tree_unflatten(const_tree, consts), others
            )
            return steps[id(policy)](carry, layer_dynamic, call_args, call_kwargs)

        return segmented(call_segment, carry, leaves, const_leaves, segments, unroll)

    if plan.offloads_activations and _explicit_mesh(carry):
        # XLA cannot compile an offloaded residual that the partitioner reshards under
        # Explicit axes (tests/test_explicit_axes.py); traced under Auto axes it compiles
        # exactly as on an Auto mesh. Every array the layers read goes through
        # `auto_axes` as an argument (an Explicit-typed closure fails in an Auto context).
        arrays, others = eqx.partition((args, kwargs), eqx.is_array)

        def run_auto(carry, dynamic, arrays):
            call_args, call_kwargs = eqx.combine(arrays, others)
            return run(carry, dynamic, call_args, call_kwargs)

        out_sharding = jax.tree_util.tree_map(lambda c: jax.typeof(c).sharding, carry)
        auto: Any = jax.sharding.auto_axes(run_auto, out_sharding=out_sharding)
        carry = auto(carry, dynamic, arrays)
    else:
        carry = run(carry, dynamic, args, kwargs)
    _note_outputs(carry, out_names)
    return carry


def _explicit_mesh(tree: Any) -> bool:
    """Whether a leaf's type is sharded over a mesh with Explicit axes (read from the
    type: a compile for a target may have no context mesh)."""
    for leaf in jax.tree_util.tree_leaves(tree):
        mesh = getattr(getattr(jax.typeof(leaf), "sharding", None), "mesh", None)
        if mesh is not None and not mesh.empty and mesh.explicit_axes:
            return True
    return False


def _carry_names(dynamic, static, carry, args, kwargs, plan: Plan) -> list:
    """The names the layers give their output carry (found by tracing one layer's
    shapes), so that each layer renames its input carry and the policy applies to it;
    the first layer takes the name of the incoming value, if it has one."""
    incoming = _names_of((carry, *args))
    n_carry = len(jax.tree_util.tree_leaves(carry))
    if current() is None or not plan.activations:
        return incoming
    out_names: list = []

    def one_layer(layer_dynamic, carry):
        layer = jax.tree_util.tree_map(to_device, eqx.combine(layer_dynamic, static))
        # Copies of the containers: a layer that writes into one must not leave this
        # shape-only trace's values in the caller's (the scan refuses such a write).
        call_args, call_kwargs = jax.tree_util.tree_map(lambda x: x, (args, kwargs))
        with in_region():
            out = layer(carry, *call_args, **call_kwargs)
        out_names[:] = _names_of(out)
        return out

    first = jax.tree_util.tree_map(lambda x: x[0], dynamic)
    jax.eval_shape(one_layer, first, carry)
    names = [n if n is not None else m for n, m in zip(out_names, incoming)]
    return names + incoming[n_carry:]
