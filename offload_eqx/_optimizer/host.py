"""The optimizer update on the host (`ox.offload_optimizer(update_on="host")`, or any
whole-state `ox.offload_optimizer` under a strategy with `update="host"`).

The whole `optax` update (global transforms such as `clip_by_global_norm` included) is one
host computation (`_host.compute.on_host`). Its operands:

- the state, in host memory already: read and written there, never fetched;
- the gradients: sent to host memory once, explicitly (gradients of host-resident
  parameters are host-typed already and do not move);
- the parameters, only if the transformation reads them (`adamw`'s weight decay), and
  only those on the device are sent.

Its results are host-typed: the new state stays, and `ox.apply_updates` (called by
`ox.update_and_apply`) fetches the updates once for parameters on the device and adds
them on the host for parameters in host memory (`apply_on_host`), so that with
host-resident parameters nothing but the gradients crosses the link.

Where the host computation is a call of its own (XLA:GPU), an undelayed update is split
into one call per parameter, chained (`on_host(split=True)`), and the state is donated:
each call's results are copied into the state's buffers, so the host holds the state once
plus one parameter's results, where one call for everything held every result beside the
state (two copies). A global transform (`clip_by_global_norm`) reads every gradient for
every result, and the update stays one call. Under a plan with `update="host_sliced"`,
each parameter's call whose results exceed a slice's bytes is computed a slice at a
time, its results written over the state (`on_host(sliced=True, reuse=...)`): the host
holds nothing of the update beside it. A delayed update is always computed in slices
there (`_slice_all`): the scheduler that overlaps it would copy whole calls' results
after the last one, holding every result beside the state.

Global transforms run on the host with the rest: their reductions read every gradient
once, which costs the host's memory bandwidth, against keeping every gradient on the
device until the norm is known (and fetching the state to the device anyway).
"""

from typing import Any

import jax
import jax.numpy as jnp
import optax

from .._declare.strategy import HOST_UPDATES
from .._host.compute import host_inline, on_host, traced_platform
from .._sharding.memory_space import is_host_typed, labelled, to_device, to_host
from .._trace.state import active_plan
from .delayed import Delayed, as_pending, delayed_tx, when_ready, zeros
from .masters import value_writer
from .state import (
    NAME,
    call_update,
    check_matches,
    check_ours,
    eval_shape,
    flatten_transfers,
    host_mask,
    is_none,
    on_device,
    shapes,
    trainable,
)


def _split_calls(delayed: bool) -> bool:
    """Whether the update is one host computation per parameter (`on_host(split=True)`):
    where the host computation is a call of its own (XLA:GPU), so that the state is
    written into its donated buffers with one parameter's results held at a time. Not
    for a delayed update computed whole (`_whole_delayed`): XLA:GPU's latency-hiding
    scheduler, which lets it overlap the step (`compiler_options`), copies every result
    into the state after the last call, so all of them are held at once anyway, and
    calls per parameter only add copies on the device's stream."""
    return not host_inline(traced_platform()) and not (delayed and _whole_delayed())


def _whole_delayed() -> bool:
    """Whether the strategy in force asks for the update whole (`update="host"`, not
    `"host_sliced"`, nor the annotation): for a delayed update on XLA:GPU, one host call
    that overlaps the forward and backward passes but holds the state twice."""
    plan = active_plan()
    return plan is not None and plan.strategy.update == "host"


def _slice_all(delayed: bool) -> bool:
    """Whether every parameter's update is computed in slices written over the state: a
    delayed update on XLA:GPU, unless the strategy in force asks for it whole
    (`_whole_delayed`). Whole, the host holds two copies of the state (the experiments'
    tiny decoder, h100: 2.08 MiB of host temporaries for 2.08 MiB of state); in slices,
    written back in a loop one at a time, it holds it once, and the loop runs on the
    device's stream between or after the passes, not beside them. `ox.fit` compiles
    both and keeps the faster that fits."""
    return delayed and not host_inline(traced_platform()) and not _whole_delayed()


def reads_params(inner: Any, grads: Any, state: Any, extra_args: dict) -> bool:
    """Whether `inner.update` reads the parameters: optax raises (a `ValueError` from
    `add_decayed_weights`, or arithmetic on `None`) when a transformation that needs them
    is given `params=None`."""
    try:
        eval_shape(lambda g, s: call_update(inner, g, s, None, extra_args), grads, state)
    except (ValueError, TypeError, AttributeError):
        return True
    return False


def _to_host_labelled(x: Any, where: str) -> Any:
    if is_host_typed(x):
        return x
    with labelled("gradient", where):
        return to_host(x)


def _add(param: Any, update: Any) -> Any:
    return param if update is None else (param + update).astype(param.dtype)


def _split_by(host: Any, values: Any) -> tuple[Any, Any]:
    """`(values of the parameters in `host`, values of the others)`, each None elsewhere."""
    mine = jax.tree_util.tree_map(
        lambda p, v: None if p is None else v, host, values, is_leaf=is_none
    )
    others = jax.tree_util.tree_map(
        lambda p, v: v if p is None else None, host, values, is_leaf=is_none
    )
    return mine, others


def _placed_like(mask: Any, tree: Any) -> Any:
    """Each leaf of `tree` in host memory where `mask` says, on the device elsewhere."""
    return jax.tree_util.tree_map(
        lambda was_host, x: to_host(x) if was_host else to_device(x), mask, tree
    )


def apply_on_host(params: Any, updates: Any) -> Any:
    """`params + updates` where both are host-typed, in one host computation; other
    leaves are returned as they are (None where there is nothing to add)."""
    both = jax.tree_util.tree_map(
        lambda u, p: is_host_typed(p) and is_host_typed(u),
        updates,
        params,
        is_leaf=lambda x: x is None,
    )
    pick = lambda tree: jax.tree_util.tree_map(  # noqa: E731
        lambda keep, x: x if keep else None, both, tree, is_leaf=lambda x: x is None
    )
    host_params, host_updates = pick(params), pick(updates)
    if not jax.tree_util.tree_leaves(host_updates):
        return host_params
    return on_host(
        lambda p, u: jax.tree_util.tree_map(_add, p, u, is_leaf=lambda x: x is None),
        host_params,
        host_updates,
        flatten=flatten_transfers(),
        name="apply updates",
    )


def combine_results(model: Any, updates: Any, new_values: Any, values: bool = False) -> Any:
    """`model + updates` leaf by leaf, where `new_values` (the model's structure) holds the
    new value of each leaf already computed (summed on the host, written from a master),
    None elsewhere. With `values`, `updates` are new values too (host-typed, cast from
    masters on the host): fetched, not added."""

    def apply(path, update, param, new):
        if new is not None:
            return new
        if update is None:
            return param
        if values:
            with labelled("parameter", "params" + jax.tree_util.keystr(path)):
                return to_device(update)
        with labelled("update", "updates" + jax.tree_util.keystr(path)):
            fetched = to_device(update)
        if is_host_typed(param):
            return to_host((to_device(param) + fetched).astype(param.dtype))
        return (param + fetched).astype(param.dtype)

    return jax.tree_util.tree_map_with_path(
        apply, updates, model, new_values, is_leaf=lambda x: x is None
    )


class HostUpdate:
    """The `update` of a whole-state `ox.offload_optimizer`: on the host or on the device,
    as `where(state)` says (the plan in force, else the state's declaration);
    `device_update` is the device path. A streamed optimizer under a plan with
    `update="host"` uses it too (`streamed=True`, `inner` its whole-leaves form), and
    `ox.update_and_apply` calls `update_and_apply` (update and sum in one computation)."""

    def __init__(
        self,
        inner: optax.GradientTransformation,
        device_update: Any,
        where: Any,
        streamed: bool = False,
    ):
        self.inner = inner
        self.device_update = device_update
        self.where = where
        self.streamed = streamed  # the state of a streamed optimizer (`stream`)

    def on_host(self, state: Any) -> bool:
        return self.where(state) in HOST_UPDATES

    def _sliced(self, state: Any) -> bool:
        """Whether the plan computes large parameters' updates a slice at a time
        (`update="host_sliced"`)."""
        return self.where(state) == "host_sliced"

    def _form(self, state: Any) -> dict[str, bool]:
        """How `on_host` lays out the update: per parameter (`split`), a slice at a time
        (`sliced`: the plan's `"host_sliced"`, or any delayed update on XLA:GPU not asked
        whole), every group in slices (`slice_all`)."""
        delayed = delayed_tx(self.inner) is not None
        slice_all = _slice_all(delayed)
        return {
            "split": _split_calls(delayed),
            "sliced": self._sliced(state) or slice_all,
            "slice_all": slice_all,
        }

    def __call__(self, updates: Any, state: Any, params: Any = None, **extra_args: Any) -> Any:
        if not self.on_host(state):
            return self.device_update(updates, state, params, **extra_args)
        grads, given = self._operands(updates, state, params, extra_args)
        tx, applied, inner_state, ready = self._split(grads, state)

        def update(grads, inner_state, params, extra_args, ready):
            def full():
                return call_update(tx, grads, inner_state, params, extra_args)

            labels = ("updates", "opt_state.inner.state")
            return when_ready(ready, full, lambda shapes: (zeros(shapes[0]), inner_state), labels)

        new_updates, new_inner = on_host(
            update,
            applied,
            inner_state,
            given,
            extra_args,
            ready,
            flatten=flatten_transfers(),
            **self._form(state),
            reuse={1: 1},  # the new state replaces the state
            name=self._name("optimizer update"),
            labels=(("gradient", "grads"), ("optimizer", "opt_state"), ("parameter", "params")),
        )
        return new_updates, self._stored(state, new_inner, grads)

    def update_and_apply(self, grads: Any, state: Any, params: Any, **extra_args: Any) -> Any:
        """The host update and the sum for host-resident parameters in one host
        computation: `(new host parameters, updates of the others, new state)`.

        The updates of host-resident parameters never leave that computation: passed from
        one host computation to another (`update` then `apply_on_host`), XLA:GPU places
        them in *device* memory in between (a scanned 8 x 1024^2 model: 8.25P of device
        memory against 7.25P for the layer-streamed device update).

        Delayed (`delay=1`), the computation applies the *pending* gradients and reads
        nothing the step computes, so it overlaps the step's forward and backward
        passes; the step's own gradients are sent to host memory as the new pending ones.

        With masters (`writes_values`), the second result holds the new *values* of the
        parameters on the device (cast from their masters on the host: they cross in
        the parameters' dtype), not updates."""
        grads, given = self._operands(grads, state, params, extra_args)
        tx, applied, inner_state, ready = self._split(grads, state)
        host = jax.tree_util.tree_map(lambda p: p if is_host_typed(p) else None, trainable(params))

        writer = value_writer(tx)
        likes = shapes(trainable(params))  # the parameters' dtypes, for their new values

        def update(grads, inner_state, given, host, extra_args, ready):
            def full():
                if writer is not None:  # masters: every parameter written from its own
                    new_values, new_inner = writer.values(grads, inner_state, extra_args, likes)
                    return (*_split_by(host, new_values), new_inner)
                updates, new_inner = call_update(tx, grads, inner_state, given, extra_args)
                new_host = jax.tree_util.tree_map(
                    lambda p, u: None if p is None else _add(p, u), host, updates, is_leaf=is_none
                )
                others = jax.tree_util.tree_map(
                    lambda p, u: u if p is None else None, host, updates, is_leaf=is_none
                )
                return new_host, others, new_inner

            def kept(shapes):
                if writer is not None:
                    current = writer.current(inner_state, likes)
                    return (*_split_by(host, current), inner_state)
                return host, zeros(shapes[1]), inner_state

            labels = ("params", "updates", "opt_state.inner.state")
            return when_ready(ready, full, kept, labels)

        new_host, others, new_inner = on_host(
            update,
            applied,
            inner_state,
            given,
            host,
            extra_args,
            ready,
            flatten=flatten_transfers(),
            **self._form(state),
            reuse={0: 3, 2: 1},  # the new host parameters and state replace the old
            name=self._name("optimizer update and apply"),
            labels=(
                ("gradient", "grads"),
                ("optimizer", "opt_state"),
                ("parameter", "params"),
                ("parameter", "params"),
            ),
        )
        return new_host, others, self._stored(state, new_inner, grads)

    @property
    def writes_values(self) -> bool:
        """Whether the update writes the parameters' new values (masters) rather than
        updates to add."""
        return value_writer(delayed_tx(self.inner) or self.inner) is not None

    def device_update_and_apply(
        self, grads: Any, state: Any, params: Any, **extra_args: Any
    ) -> tuple[Any, Any]:
        """For an optimizer with masters, on the device: the state fetched whole (as the
        device update does), every trained parameter written from its new master and
        put back in its memory. Returns `(new values, new state)`, the values in the
        parameters' structure (None where nothing is trained)."""
        grads, _ = self._operands(grads, state, params, extra_args)
        tx, applied, inner_state, ready = self._split(grads, state)
        writer = value_writer(tx)
        mask = host_mask(state.inner)
        inner_state, applied = on_device(inner_state), on_device(applied)
        ready = None if ready is None else to_device(ready)

        likes = trainable(params)  # their dtypes only

        def full():
            return writer.values(applied, inner_state, extra_args, likes)

        def kept(shapes):
            return writer.current(inner_state, likes), inner_state

        new_values, new_inner = when_ready(ready, full, kept, ("params", "opt_state.inner.state"))
        if delayed_tx(self.inner) is not None:
            pending = as_pending(grads, state.inner.pending)
            new_inner = Delayed(new_inner, pending, jnp.asarray(True))
        placed = jax.tree_util.tree_map(
            lambda v, p: to_host(v) if is_host_typed(p) else v,
            new_values,
            trainable(params),
        )
        return placed, type(state)(_placed_like(mask, new_inner))

    def _name(self, name: str) -> str:
        """The host computation's name: `delayed ...` for a delayed update (which the
        work counter prices beside the backward pass)."""
        return name if delayed_tx(self.inner) is None else f"delayed {name}"

    def _split(self, grads: Any, state: Any) -> tuple:
        """`(transformation, gradients it applies, its state, ready)`: the step's
        gradients and the whole state, or, delayed, the pending gradients, the wrapped
        transformation's state and the flag saying they are pending."""
        tx = delayed_tx(self.inner)
        if tx is None:
            return self.inner, grads, state.inner, None
        inner = state.inner
        return tx, inner.pending, inner.state, inner.ready

    def _stored(self, state: Any, new_inner: Any, grads: Any) -> Any:
        """The new state: delayed, the transformation's new state, the step's gradients
        in host memory (pending) and `ready`; otherwise the new state as it is."""
        if delayed_tx(self.inner) is None:
            return type(state)(new_inner)
        pending = jax.tree_util.tree_map_with_path(
            lambda path, g: _to_host_labelled(g, "grads" + jax.tree_util.keystr(path)),
            as_pending(grads, state.inner.pending),
        )
        return type(state)(Delayed(new_inner, pending, to_host(jnp.asarray(True))))

    def _operands(self, updates: Any, state: Any, params: Any, extra_args: dict) -> tuple:
        """The gradients and, if the transformation reads them, the parameters, checked
        against the state."""
        check_ours(state, streamed=self.streamed, name=NAME)
        grads = trainable(updates)
        inner = self.inner
        check_matches(type(state)(eval_shape(inner.init, shapes(grads))), state, name=NAME)
        needs_params = reads_params(inner, grads, state.inner, extra_args)
        if needs_params and params is None:
            raise ValueError(
                f"{NAME}: the transformation reads the parameters (weight decay, a mask "
                "of the parameters, ...), but `update` was called without them. Call "
                "`opt.update(grads, opt_state, params)`."
            )
        return grads, trainable(params) if needs_params else None
