"""A stack a loop builds only to send it to host memory is sent a slice per trip.

`jax.grad` of a step that runs its layers in a scan returns each stacked parameter's
gradient as one output of the backward loop: every trip writes its layer's slice into
a stacked buffer in device memory, and the buffer is complete only when the loop ends.
A step that updates the parameters on the host then sends each stacked gradient to host
memory (`to_host`), after the loop. So the device holds every gradient of the model at
once (Llama-2-13B: 24 GiB, the size of the bfloat16 parameters) and the copies start only
after the last matmul.

Where a loop's stacked output is read by nothing but one such send, the send is moved
into the loop's body: each trip sends its own slice to host memory, and the loop builds
the stack there (XLA writes each slice into the host buffer as its trip ends, as it does
for an activation offloaded from a loop). The values are the same (a send is a copy);
the device holds one slice instead of the stack, and the copies run beside the next
trips' work. Measured deviceless (h100, jaxlib 0.10.2): Llama-2-13B with its bfloat16
parameters on the device, float32 masters and the update on the host, batch 6: 62.1 ->
39.7 GiB of device memory.

Only the step's own equations are rewritten (a `jax.lax.scan` at its top level, as
`jax.grad` leaves the backward loop, not unrolled), and only a send to host memory (`device_put` to
`jax.memory.Space.Host`) that is the stack's one reader, directly or through one reshape
(a host computation's operands are flattened before they are sent: the reshape then
reads the stack in host memory, as it does a host-resident parameter's gradient).
"""

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
from jax.core import eval_jaxpr
from jax.extend.core import ClosedJaxpr, Literal, Var, new_jaxpr_eqn

from .._base.primitives import scan_consts_and_carry

_LIST_PARAMS = ("devices", "srcs", "copy_semantics")  # one entry per operand of a send


@dataclasses.dataclass(frozen=True)
class _Sent:
    """How a scan's stacked output reaches host memory: operand `position` of the send
    `send` (an equation's index), through the reshape `reshape` (an index) or directly."""

    send: int
    position: int
    reshape: int | None = None


def _readers(jaxpr: Any) -> dict[Any, list[int]]:
    """For each variable, the equations that read it (-1: an output of the jaxpr)."""
    readers: dict[Any, list[int]] = {}
    for index, eqn in enumerate(jaxpr.eqns):
        for var in eqn.invars:
            if not isinstance(var, Literal):
                readers.setdefault(var, []).append(index)
    for var in jaxpr.outvars:
        if not isinstance(var, Literal):
            readers.setdefault(var, []).append(-1)
    return readers


def _only_reader(readers: dict, var: Any) -> int | None:
    users = readers.get(var, [])
    return users[0] if len(users) == 1 and users[0] >= 0 else None


def _sends_to_host(eqn: Any, var: Any) -> int | None:
    """The operand position of `var` in `eqn` when `eqn` sends it, once, to host memory."""
    if eqn.primitive.name != "device_put" or list(eqn.invars).count(var) != 1:
        return None
    position = list(eqn.invars).index(var)
    if eqn.params["devices"][position] != jax.memory.Space.Host:
        return None
    return position


def _how_sent(jaxpr: Any, var: Any, readers: dict) -> _Sent | None:
    """How the stack `var` reaches host memory, if that is all that reads it."""
    user = _only_reader(readers, var)
    if user is None:
        return None
    position = _sends_to_host(jaxpr.eqns[user], var)
    if position is not None:
        return _Sent(user, position)
    if jaxpr.eqns[user].primitive.name != "reshape":
        return None
    reshaped = jaxpr.eqns[user].outvars[0]
    send = _only_reader(readers, reshaped)
    if send is None:
        return None
    position = _sends_to_host(jaxpr.eqns[send], reshaped)
    return None if position is None else _Sent(send, position, user)


def _stacks_sent(jaxpr: Any, eqn: Any, readers: dict) -> dict[int, _Sent]:
    """For a scan `eqn`, its stacked outputs (by index among its outputs) that reach host
    memory and nothing else, and how."""
    _, carried = scan_consts_and_carry(eqn.params)
    found = {}
    for index, var in enumerate(eqn.outvars[carried:], carried):
        sent = _how_sent(jaxpr, var, readers)
        if sent is not None and not isinstance(eqn.params["jaxpr"].jaxpr.outvars[index], Literal):
            found[index] = sent
    return found


def _in_host(aval: Any, like: Any) -> Any:
    """`aval` in the memory space of `like` (host memory)."""
    return aval.update(memory_space=like.memory_space)


def _one_send(send: Any, position: int, operand: Any, result: Any) -> Any:
    """An equation sending `operand` to `result` as operand `position` of `send` is sent."""
    params = {k: (v[position],) if k in _LIST_PARAMS else v for k, v in send.params.items()}
    return new_jaxpr_eqn(
        [operand], [result], send.primitive, params, send.effects, send.source_info
    )


def _without(send: Any, positions: set[int]) -> Any | None:
    """`send` less its operands at `positions`; None where none is left."""
    keep = [i for i in range(len(send.invars)) if i not in positions]
    if not keep:
        return None
    params = {
        k: tuple(v[i] for i in keep) if k in _LIST_PARAMS else v for k, v in send.params.items()
    }
    return send.replace(
        invars=[send.invars[i] for i in keep],
        outvars=[send.outvars[i] for i in keep],
        params=params,
    )


def _sending_body(body: ClosedJaxpr, sends: dict[int, tuple[Any, int]]) -> ClosedJaxpr:
    """The scan's body with output `index` sent to host memory as `send` does, for each
    `index -> (send, position)` of `sends`."""
    outvars = list(body.jaxpr.outvars)
    added = []
    for index, (send, position) in sends.items():
        sent = Var(_in_host(outvars[index].aval, send.outvars[position].aval))
        added.append(_one_send(send, position, outvars[index], sent))
        outvars[index] = sent
    jaxpr = body.jaxpr.replace(eqns=[*body.jaxpr.eqns, *added], outvars=outvars)
    return ClosedJaxpr(jaxpr, body.consts)


def sent_per_trip(closed: ClosedJaxpr) -> ClosedJaxpr:
    """`closed` with every top-level scan's stacked output that only a send to host memory
    reads sent a slice per trip (the module docstring); `closed` itself where none is."""
    jaxpr = closed.jaxpr
    readers = _readers(jaxpr)
    eqns: list[Any] = list(jaxpr.eqns)
    moved: dict[int, set[int]] = {}  # a send's equation -> its operands moved into loops
    for index, eqn in enumerate(jaxpr.eqns):
        # An unrolled scan stacks its trips' slices in groups, which XLA:GPU fails to
        # write into host memory ("INTERNAL: during context [end-of-post-layout_
        # assignment]", 13B's backward loop unrolled by 2): it keeps its send after.
        if eqn.primitive.name != "scan" or eqn.params.get("unroll", 1) not in (1, False):
            continue
        found = _stacks_sent(jaxpr, eqn, readers)
        if not found:
            continue
        outvars = list(eqn.outvars)
        for out, how in found.items():
            send = jaxpr.eqns[how.send]
            if how.reshape is None:
                outvars[out] = send.outvars[how.position]
                continue
            # The stack arrives in host memory, and the reshape reads it there.
            outvars[out] = Var(_in_host(eqn.outvars[out].aval, send.outvars[how.position].aval))
            reshape = jaxpr.eqns[how.reshape]
            eqns[how.reshape] = reshape.replace(
                invars=[outvars[out]], outvars=[send.outvars[how.position]]
            )
        sends = {out: (jaxpr.eqns[how.send], how.position) for out, how in found.items()}
        body = _sending_body(eqn.params["jaxpr"], sends)
        eqns[index] = eqn.replace(outvars=outvars, params={**eqn.params, "jaxpr": body})
        for how in found.values():
            moved.setdefault(how.send, set()).add(how.position)
    if not moved:
        return closed
    for user, positions in moved.items():
        eqns[user] = _without(jaxpr.eqns[user], positions)
    kept = [eqn for eqn in eqns if eqn is not None]
    return ClosedJaxpr(jaxpr.replace(eqns=kept), closed.consts)


def evaluated_sending(flat: Callable[..., list]) -> Callable[..., list]:
    """`flat` traced, its stacks sent a slice per trip (`sent_per_trip`), and evaluated:
    the program `ox.filter_jit` compiles from its one trace, for a caller that traces the
    step again (a deviceless compile, `ox.audit`)."""

    def evaluated(*dynamic):
        closed = sent_per_trip(jax.make_jaxpr(flat)(*dynamic))
        return eval_jaxpr(closed.jaxpr, closed.consts, *dynamic)

    return evaluated
