"""The jaxpr walk: follow values through a traced step, record its transfers and breaches.

A transfer is a `device_put` whose input and output memory spaces differ. Its bytes are
multiplied by the trip count of every enclosing `scan`; a `cond` counts its largest
branch; a `while` loop, whose trip count is unknown, counts once. Values are followed
through the program (into and out of scan, remat and jit bodies) so that each transfer
is named by what it is, never by its shape: what it moves (a parameter or
optimizer-state leaf by its path, a named activation), the host leaf whose fetch it
transposes (a gradient: JAX keeps the fetch's traceback on its transpose, and the
library's fetches carry the leaf's path as a label), or the output leaf it is written
into (a new optimizer state or an updated weight sent back to host memory, found by
`destinations`). A host callback (`jax.pure_callback`, `io_callback`, `jax.debug.print`,
`jax.debug.callback`) is a transfer too: its operands go to the host and its results come
back on every call.

Forward or backward: JAX names the equations it derives by differentiation, and the
name stack survives in the jaxpr: `jvp(...)` for the forward (primal) pass and
`transpose(...)` for the backward pass, including the recomputation inside a
differentiated remat region. Equations outside both, after the backward pass, are the
`update` phase (the optimizer); a program without a gradient is all `forward`.

The contract checks that need the walk's view of each equation (a host leaf's device
copy kept as a residual, arithmetic on host-typed values outside `ox.host_compute()`,
host-typed gradients) are made on the same pass. Moving data within host memory
(slicing, indexing, concatenating, padding, transposing, selecting) is not arithmetic.
`ox.host_compute` lives here because it only marks equations for this walker. This module
knows nothing of arguments, plans or outputs: `audit` seeds the walk with the origin of
each input and reads the result.
"""

import dataclasses
from typing import Any

import jax
import jax.extend as jex
import numpy as np

from .._base.errors import Violation
from .._base.jax_private import without_dead_code
from .._base.primitives import (
    DATA_MOVEMENT,
    STRUCTURAL,
    VIEWS,
    callback_name,
    is_callback,
    is_var,
    phase_of,
)
from .._host.compute import NAME_SCOPE as HOST_NAME_SCOPE, is_host_computation
from .._plan.remat_policy import module_in
from .._sharding.memory_space import FETCH_SCOPE, is_host_aval as _is_host, label_in
from .destinations import destinations
from .transfer_report import HostComputation, Transfer
from .walk_checks import host_arithmetic_breaches, residual_breaches

HOST_COMPUTE_SCOPE = "ox_host_compute"


def host_compute():
    """A scope in which arithmetic on host-typed values is intended (the audit allows it):

    ```python
    with ox.host_compute():
        w = w * decay  # w stays in host memory, computed there on purpose
    ```
    """
    return jax.named_scope(HOST_COMPUTE_SCOPE)


@dataclasses.dataclass(frozen=True)
class _Origin:
    kind: str  # parameter, optimizer, input, activation, gradient
    what: str
    fetched_in: str | None = None  # phase in which a host leaf's device copy was made
    cast: bool = False  # the leaf in another dtype (a master cast to its parameter's)


def _is_device(aval) -> bool:
    return getattr(aval, "memory_space", None) == jax.memory.Space.Device


def _nbytes(aval) -> int:
    return int(np.prod(aval.shape, dtype=np.int64)) * aval.dtype.itemsize


def _is_drop(v) -> bool:
    return type(v).__name__ == "DropVar"


def _dce(jaxpr):
    """Drop dead equations (XLA would): a transfer nobody uses is not a transfer."""
    return without_dead_code(jaxpr)


def _open(jaxpr):
    return getattr(jaxpr, "jaxpr", jaxpr)


class _Walker:
    def __init__(self, outputs: dict[Any, tuple[str, str]]):
        self.outputs = outputs  # top-level outvar -> (kind, what)
        self.transfers: list[Transfer] = []
        self.violations: list[Violation] = []
        self.names_seen: set[str] = set()
        self.host_computations: list[HostComputation] = []
        self.saw_backward = False
        self._seen_violations: set[tuple[str, str]] = set()
        # The leaves fetched in the forward pass, by the fetch equation's traceback (see
        # `_transposed_fetch`): id -> paths, in program order.
        self._fetched: dict[int, list[str]] = {}

    def _breaches(self, found: list[tuple[str, str, str]]) -> None:
        for rule, path, message in found:
            self.violate(rule, path, message)

    def violate(self, rule: str, path: str, message: str) -> None:
        if (rule, path) not in self._seen_violations:
            self._seen_violations.add((rule, path))
            self.violations.append(Violation(rule, path, message))

    def walk(
        self,
        jaxpr,
        env: dict,
        count: int,
        phase: str,
        where: tuple[str, ...],
        host_ok: bool,
        top: bool = False,
        outputs: list | None = None,
    ) -> None:
        """Walk `jaxpr`; `outputs`: what each of its outputs is, (kind, what) or None (the
        top level: the step's outputs)."""
        if top:
            outputs = [self.outputs.get(v) if is_var(v) else None for v in jaxpr.outvars]
        dests = destinations(jaxpr, outputs or [None] * len(jaxpr.outvars))
        seen_backward = False
        fetches: list[tuple[int, str]] = []  # host leaves fetched in this body: (traceback, path)
        outer = where
        for eqn in jaxpr.eqns:
            stack = str(eqn.source_info.name_stack)
            where = _in_module(outer, stack)
            eqn_phase = phase_of(stack, phase, seen_backward)
            if eqn_phase == "backward":
                seen_backward = self.saw_backward = True
            eqn_host_ok = host_ok or HOST_COMPUTE_SCOPE in stack
            prim = eqn.primitive.name
            if eqn_phase == "backward":
                self._breaches(residual_breaches(eqn, env))
            if prim == "device_put":
                self._device_put(eqn, env, count, eqn_phase, where, fetches, dests, stack)
            elif prim == "name":
                self.names_seen.add(eqn.params["name"])
                env[eqn.outvars[0]] = _Origin("activation", eqn.params["name"])
            elif is_callback(prim):
                self._callback(eqn, count, eqn_phase, where)
            elif prim in VIEWS or prim in DATA_MOVEMENT:
                arithmetic = prim not in DATA_MOVEMENT and prim not in STRUCTURAL
                if (
                    arithmetic
                    and not eqn_host_ok
                    and any(is_var(v) and _is_host(v.aval) for v in eqn.invars)
                ):
                    self._breaches(host_arithmetic_breaches(eqn, env, where))
                var = next((v for v in eqn.invars if is_var(v) and v in env), None)
                if var is not None:
                    source = env[var]
                    for out in eqn.outvars:
                        # Only a same-size view (a reshape, a cast, a transpose) is the
                        # leaf's device copy; a part of it (a slice) or values gathered
                        # from it (embedding rows, however many) are not.
                        whole = prim != "gather" and np.prod(out.aval.shape) == np.prod(
                            var.aval.shape
                        )
                        seen = source if whole else dataclasses.replace(source, fetched_in=None)
                        cast = seen.cast or out.aval.dtype != var.aval.dtype
                        env[out] = dataclasses.replace(seen, cast=cast)
            elif prim in STRUCTURAL or list(jex.core.jaxprs_in_params(eqn.params)):
                if prim == "compute_on" and is_host_computation(eqn):
                    self._host_computation(eqn, stack, count, eqn_phase, where)
                    eqn_host_ok = True
                before = self.saw_backward
                self._nested(eqn, env, count, eqn_phase, where, eqn_host_ok, dests)
                # A gradient computed inside a nested jit: what follows it is the update.
                seen_backward = seen_backward or (self.saw_backward and not before)
            elif prim == "add_any" and self._sums_gradients(eqn, env):
                # Differentiation adding up two host-typed gradients of one leaf (used in
                # two places, e.g. in regions and through `ox.fetch`): the sum is made in
                # host memory, where the plan keeps that leaf's gradient.
                self._gradient_sum(eqn, env, count, eqn_phase, where)
            elif not eqn_host_ok:
                if any(is_var(v) and _is_host(v.aval) for v in eqn.invars):
                    self._breaches(host_arithmetic_breaches(eqn, env, where))

    @staticmethod
    def _sums_gradients(eqn, env) -> bool:
        sources = [env.get(v) for v in eqn.invars if is_var(v)]
        return bool(sources) and all(
            _is_host(v.aval) and s is not None and s.kind == "gradient"
            for v, s in zip(eqn.invars, sources)
        )

    def _gradient_sum(self, eqn, env, count, phase, where) -> None:
        what = env[eqn.invars[0]].what
        env[eqn.outvars[0]] = _Origin("gradient", what)
        self.host_computations.append(
            HostComputation(
                name=f"gradient sum of {what}",
                phase=phase,
                count=count,
                operand_bytes=sum(_nbytes(v.aval) for v in eqn.invars) * count,
                result_bytes=_nbytes(eqn.outvars[0].aval) * count,
                where=" > ".join(where),
            )
        )

    def _host_computation(self, eqn, stack, count, phase, where) -> None:
        start = stack.rfind(HOST_NAME_SCOPE + "[")
        name = stack[start + len(HOST_NAME_SCOPE) + 1 :].split("]")[0] if start >= 0 else ""
        self.host_computations.append(
            HostComputation(
                name=name or "host computation",
                phase=phase,  # type: ignore[arg-type]
                count=count,
                operand_bytes=sum(_nbytes(v.aval) for v in eqn.invars if is_var(v)) * count,
                result_bytes=sum(_nbytes(v.aval) for v in eqn.outvars) * count,
                where=" > ".join(where),
            )
        )

    # -- transfers -------------------------------------------------------------------

    def _device_put(self, eqn, env, count, phase, where, fetches, dests, stack) -> None:
        label = label_in(stack)
        traceback = id(eqn.source_info.traceback) if eqn.source_info.traceback else None
        for invar, outvar in zip(eqn.invars, eqn.outvars):
            if not is_var(invar):
                continue
            source = env.get(invar)
            to_host = _is_device(invar.aval) and _is_host(outvar.aval)
            to_device = _is_host(invar.aval) and _is_device(outvar.aval)
            kept = FETCH_SCOPE in stack  # `ox.fetch`: kept where used, by request
            if source is not None:
                if to_device and source.kind in ("parameter", "optimizer", "input") and not kept:
                    env[outvar] = dataclasses.replace(source, fetched_in=phase)
                else:
                    env[outvar] = dataclasses.replace(source, fetched_in=None)
            if not (to_host or to_device) or _is_drop(outvar):
                continue
            if source is not None and to_device and source.kind in ("parameter", "input"):
                self._record_fetch(traceback, source.what, phase, fetches)
            kind, what = self._name(
                source, label, to_host, phase, traceback, fetches, dests, outvar
            )
            if to_host and phase == "backward" and kind == "parameter":
                # What the backward pass sends to a parameter's host memory is its
                # gradient (a loop's summed cotangent, or gradients returned as they are).
                kind = "gradient"
            if kind == "gradient" and to_host:
                env[outvar] = _Origin("gradient", what)
            self.transfers.append(
                Transfer(
                    direction="device-to-host" if to_host else "host-to-device",
                    kind=kind,
                    what=what,
                    shape=tuple(outvar.aval.shape),
                    dtype=str(outvar.aval.dtype),
                    count=count,
                    bytes=_nbytes(outvar.aval) * count,
                    phase=phase,
                    where=" > ".join(where),
                )
            )

    def _name(self, source, label, to_host, phase, traceback, fetches, dests, outvar):
        """What a transfer moves, by provenance: the value it moves (followed from the
        step's arguments), a label the library put on it, the host leaf whose fetch it
        transposes (a gradient), or the output it is written into (a new optimizer state,
        an updated weight)."""
        if label is not None and (source is None or source.cast):
            return label  # a leaf cast is another value: the library's word names it
        if source is not None:
            return source.kind, source.what
        if to_host and phase == "backward":
            fetched = self._transposed_fetch(traceback, fetches)
            if fetched is not None:
                return "gradient", fetched
        if outvar in dests:
            return dests[outvar]
        if to_host and phase == "backward":
            return "gradient", "a host-resident leaf"
        return "intermediate", "a computed value"

    def _record_fetch(self, traceback, path, phase, fetches) -> None:
        if traceback is None:
            return
        fetches.append((traceback, path))
        if phase == "forward":
            self._fetched.setdefault(traceback, []).append(path)

    def _callback(self, eqn, count, phase, where) -> None:
        """A host callback: each operand goes to the host, each result comes back."""
        name = callback_name(eqn)
        moves = [("device-to-host", v.aval) for v in eqn.invars] + [
            ("host-to-device", v.aval) for v in eqn.outvars if not _is_drop(v)
        ]
        for direction, aval in moves:
            if not hasattr(aval, "shape") or _is_host(aval):
                continue  # a token, or an operand already in host memory
            self.transfers.append(
                Transfer(
                    direction=direction,  # type: ignore[arg-type]
                    kind="callback",
                    what=name,
                    shape=tuple(aval.shape),
                    dtype=str(aval.dtype),
                    count=count,
                    bytes=_nbytes(aval) * count,
                    phase=phase,
                    where=" > ".join(where),
                )
            )

    def _transposed_fetch(self, traceback, fetches: list[tuple[int, str]]) -> str | None:
        """The host leaf whose fetch this cotangent's move to host memory transposes. JAX
        gives every equation it derives from another (the fetch's tangent, its copy
        recomputed in a remat region, the transpose of that tangent) the traceback
        object of the equation it derives from, when that equation was traced into a
        program first (the body of a scan, a remat region, a jit): the fetch and its
        transpose share it. The fetch made for this backward body (a remat region's
        recomputation) is the one it transposes; a leaf the backward pass does not fetch
        again (a bias: its gradient does not read it) was fetched in the forward pass.
        One fetch equation fetching several leaves (a jit body called twice) is
        transposed in reverse order, the latest first."""
        if traceback is None:
            return None
        for i in range(len(fetches) - 1, -1, -1):
            if fetches[i][0] == traceback:
                return fetches.pop(i)[1]
        paths = self._fetched.get(traceback, [])
        if len(set(paths)) > 1:
            return paths.pop()
        return paths[0] if paths else None

    # -- nested programs -------------------------------------------------------------

    def _nested(self, eqn, env, count, phase, where, host_ok, dests) -> None:
        prim, params = eqn.primitive.name, eqn.params
        invars, outvars = list(eqn.invars), list(eqn.outvars)
        if prim == "scan":
            body = _open(params["jaxpr"])
            label = f"scan[{params['length']}]"
            self._enter(
                body,
                invars,
                outvars,
                env,
                count * params["length"],
                phase,
                where + (label,),
                host_ok,
                dests,
            )
        elif prim == "cond":
            best = None
            for index, branch in enumerate(params["branches"]):
                sub = _Walker(self.outputs)
                sub.names_seen, sub._fetched = self.names_seen, self._fetched
                sub._enter(
                    _open(branch),
                    invars[1:],
                    outvars,
                    env,
                    count,
                    phase,
                    where + (f"cond branch {index}",),
                    host_ok,
                    dests,
                )
                for v in sub.violations:
                    self.violate(v.rule, v.path, v.message)
                if best is None or sum(t.bytes for t in sub.transfers) > sum(t.bytes for t in best):
                    best = sub.transfers
            self.transfers += best or []
        elif prim == "while":
            body = _open(params["body_jaxpr"])
            n_cond = params["cond_nconsts"]
            self._enter(
                body,
                invars[n_cond:],
                outvars,
                env,
                count,
                phase,
                where + ("while (trip count unknown, counted once)",),
                host_ok,
                dests,
            )
        else:
            subs = list(jex.core.jaxprs_in_params(params))
            label = {"remat2": "remat", "checkpoint": "remat"}.get(prim, prim)
            for sub in subs:
                sub = _open(sub)
                aligned = len(sub.invars) == len(invars)
                self._enter(
                    sub,
                    invars if aligned else [],
                    outvars if aligned else [],
                    env,
                    count,
                    phase,
                    where + (label,),
                    host_ok,
                    dests,
                )

    def _enter(self, body, invars, outvars, env, count, phase, where, host_ok, dests) -> None:
        inner: dict = {}
        for outer, var in zip(invars, body.invars):
            if is_var(outer) and outer in env:
                inner[var] = env[outer]
        aligned = len(outvars) == len(body.outvars)
        outputs = [dests.get(v) for v in outvars] if aligned else None
        self.walk(body, inner, count, phase, where, host_ok, outputs=outputs)
        if len(outvars) == len(body.outvars):
            for outer, var in zip(outvars, body.outvars):
                if is_var(var) and var in inner and not _is_drop(outer):
                    env[outer] = inner[var]


def _in_module(where: tuple[str, ...], stack: str) -> tuple[str, ...]:
    """`where`, with the annotated module whose region an equation was traced in (its
    path, from the name stack) when no enclosing body says it already."""
    module = module_in(stack)
    return where if module is None or module in where else (module, *where)
