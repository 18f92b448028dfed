"""`ox.audit`: every transfer of a traced step, attributed, counted, and checked.

The audit traces the step (nothing runs, arguments may be `jax.ShapeDtypeStruct`s, any
backend) and walks its jaxpr. A transfer is a `device_put` whose input and output memory
spaces differ. Its bytes are multiplied by the trip count of every enclosing `scan`; a
`cond` counts its largest branch; a `while` loop, whose trip count is unknown, counts
once. Values are followed through the program (into and out of scan, remat and jit
bodies) so that each transfer is attributed to what it moves: a parameter or
optimizer-state leaf by its path, a named activation, the gradient of a host-resident
parameter, or a function output.

Forward or backward: JAX names the equations it derives by differentiation, and the
name stack survives in the jaxpr: `jvp(...)` for the forward (primal) pass and
`transpose(...)` for the backward pass, including the recomputation inside a
differentiated remat region. Equations outside both, after the backward pass, are the
`update` phase (the optimizer); a program without a gradient is all `forward`.

The placement contract is checked on the same walk; each breach is a `Violation`
naming a path, and `ox.audit` raises a `ContractError` listing them all (the report is on
the error as `.report`).
"""

import dataclasses
import fnmatch
import json
from collections.abc import Callable, Sequence
from typing import Any, Literal

import jax
import jax.extend as jex
import numpy as np

from ._jit import Compilation, _JitWrapper, _labels, filter_jit
from ._plan import Plan, _format_bytes

Direction = Literal["host-to-device", "device-to-host"]
Phase = Literal["forward", "backward", "update", "call"]

HOST_COMPUTE_SCOPE = "ox_host_compute"

_DIRECTIONS = {
    "host-to-device": "host-to-device",
    "h2d": "host-to-device",
    "device-to-host": "device-to-host",
    "d2h": "device-to-host",
}

# Equations that move or structure values rather than compute on them: host-typed
# operands are fine here (a scan slicing host-resident layers, a region receiving them).
_STRUCTURAL = frozenset(
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
_VIEWS = frozenset(
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


class ContractError(ValueError):
    """The audited program breaks the placement contract; `.violations` lists each
    breach and `.report` is the full `TransferReport`."""

    def __init__(self, message: str, violations: Sequence["Violation"] = (), report=None):
        super().__init__(message)
        self.violations = tuple(violations)
        self.report = report


@dataclasses.dataclass(frozen=True)
class Transfer:
    """One transfer of the program, per call of the step."""

    direction: Direction
    kind: str  # parameter, optimizer, activation, gradient, output, input, intermediate
    what: str  # a leaf path, an activation name, or a description
    shape: tuple[int, ...]
    dtype: str
    count: int  # product of the trip counts of the enclosing scans
    bytes: int  # total per call: size x itemsize x count
    phase: Phase
    where: str  # enclosing bodies, e.g. "scan[10] > remat"
    implicit: bool = False  # not asked for: JAX (or the caller) copies it behind your back

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self) | {"shape": list(self.shape)}


@dataclasses.dataclass(frozen=True)
class Violation:
    """One breach of the placement contract."""

    rule: str
    path: str
    message: str


def _mib(n: int) -> str:
    return _format_bytes(n) if n else "0 B"


@dataclasses.dataclass
class TransferReport:
    """What `ox.audit` found: the transfers of one call of a step, and contract breaches."""

    name: str
    strategy: str
    transfers: list[Transfer]
    violations: list[Violation]

    # -- queries ---------------------------------------------------------------------

    def select(
        self,
        direction: str | None = None,
        what: str | None = None,
        *,
        kind: str | None = None,
        phase: str | None = None,
    ) -> list[Transfer]:
        """The transfers matching every given filter (`what` is a glob pattern)."""
        direction = _direction(direction) if direction is not None else None
        return [
            t
            for t in self.transfers
            if (direction is None or t.direction == direction)
            and (what is None or fnmatch.fnmatchcase(t.what, what))
            and (kind is None or t.kind == kind)
            and (phase is None or t.phase == phase)
        ]

    def total(self, direction: str | None = None, what: str | None = None, **filters) -> int:
        """Bytes per call of the matching transfers."""
        return sum(t.bytes for t in self.select(direction, what, **filters))

    @property
    def totals(self) -> dict[str, int]:
        return {d: self.total(d) for d in ("device-to-host", "host-to-device")}

    @property
    def implicit(self) -> list[Transfer]:
        return [t for t in self.transfers if t.implicit]

    # -- assertions ------------------------------------------------------------------

    def check(self) -> "TransferReport":
        """Raise a `ContractError` listing every violation; return the report otherwise."""
        if self.violations:
            lines = "\n".join(f"  - {v.message}" for v in self.violations)
            raise ContractError(
                f"ox.audit({self.name}): the program breaks the placement contract in "
                f"{len(self.violations)} place(s):\n{lines}",
                self.violations,
                self,
            )
        return self

    def assert_no_implicit(self) -> "TransferReport":
        """Fail if any transfer is implicit (an argument uploaded or copied per call)."""
        if self.implicit:
            rows = "\n".join(f"  - {_describe(t)}" for t in self.implicit)
            raise AssertionError(
                f"ox.audit({self.name}): {len(self.implicit)} implicit transfer(s) per "
                f"call:\n{rows}\nMove each argument where the plan puts it once, outside "
                "the step (`jax.device_put`, `ox.place`)."
            )
        return self

    def assert_only(self, *expected: tuple) -> "TransferReport":
        """Pin the exact transfers of a step.

        Each expectation is `(direction, what)` or `(direction, what, bytes)` or
        `(direction, what, bytes, phase)`: `direction` is `"device-to-host"`/`"d2h"` or
        `"host-to-device"`/`"h2d"`, `what` a glob over the transfer's `what`, `bytes` the
        total per call of the transfers it matches (None: any). Every transfer must match
        an expectation, and every expectation must match a transfer.
        """
        problems = []
        claimed: set[int] = set()
        for item in expected:
            if not 2 <= len(item) <= 4:
                raise TypeError(
                    f"assert_only: expectation {item!r} should be (direction, what[, bytes"
                    "[, phase]]), e.g. ('d2h', 'x', 2.5 * 2**20)."
                )
            direction, what, *rest = item
            nbytes, phase = (*rest, None, None)[:2]
            matched = self.select(direction, what, phase=phase)
            claimed.update(id(t) for t in matched)
            label = f"{_direction(direction)} {what!r}" + (f" ({phase})" if phase else "")
            if not matched:
                problems.append(f"expected {label}, but no transfer matches it")
            elif nbytes is not None and sum(t.bytes for t in matched) != nbytes:
                got = sum(t.bytes for t in matched)
                problems.append(
                    f"expected {label} to move {_mib(int(nbytes))} ({int(nbytes)} bytes), "
                    f"but it moves {_mib(got)} ({got} bytes) in {len(matched)} transfer(s)"
                )
        for t in self.transfers:
            if id(t) not in claimed:
                problems.append(f"unexpected transfer: {_describe(t)}")
        if problems:
            raise AssertionError(
                f"ox.audit({self.name}): the transfers differ from the expected ones:\n"
                + "\n".join(f"  - {p}" for p in problems)
                + "\n\n"
                + self.table()
            )
        return self

    # -- output ----------------------------------------------------------------------

    def table(self) -> str:
        header = ("direction", "kind", "what", "shape", "dtype", "count", "bytes", "phase", "where")
        rows = [
            (
                t.direction + (" (implicit)" if t.implicit else ""),
                t.kind,
                t.what,
                "x".join(map(str, t.shape)) or "()",
                t.dtype,
                str(t.count),
                _mib(t.bytes),
                t.phase,
                t.where or "-",
            )
            for t in self.transfers
        ]
        widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
        lines = [f"Transfers per call of {self.name} (strategy {self.strategy!r})"]
        lines.append("  ".join(h.ljust(w) for h, w in zip(header, widths)))
        lines.append("  ".join("-" * w for w in widths))
        lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
        if not rows:
            lines.append("(no transfers)")
        for direction in ("device-to-host", "host-to-device"):
            phases = {}
            for t in self.select(direction):
                phases[t.phase] = phases.get(t.phase, 0) + t.bytes
            detail = ", ".join(f"{p} {_mib(b)}" for p, b in phases.items())
            lines.append(
                f"total {direction}: {_mib(self.total(direction))}"
                + (f" ({detail})" if detail else "")
            )
        if self.violations:
            lines.append(f"violations ({len(self.violations)}):")
            lines += [f"  - {v.message}" for v in self.violations]
        return "\n".join(lines)

    __str__ = table

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "strategy": self.strategy,
            "transfers": [t.as_dict() for t in self.transfers],
            "totals": self.totals,
            "violations": [dataclasses.asdict(v) for v in self.violations],
        }

    def to_json(self, **kwargs: Any) -> str:
        options: dict[str, Any] = {"indent": 2} | kwargs
        return json.dumps(self.as_dict(), **options)


def _direction(direction: str) -> str:
    try:
        return _DIRECTIONS[direction]
    except KeyError:
        raise ValueError(
            f"Transfer direction {direction!r}; expected one of "
            + ", ".join(repr(d) for d in _DIRECTIONS)
            + "."
        ) from None


def _describe(t: Transfer) -> str:
    shape = "x".join(map(str, t.shape)) or "()"
    return (
        f"{t.direction} of {t.kind} `{t.what}` ({t.dtype}[{shape}] x {t.count} = "
        f"{_mib(t.bytes)}, {t.phase}{', in ' + t.where if t.where else ''})"
    )


def host_compute():
    """A scope in which arithmetic on host-typed values is intended (the audit allows it):

    ```python
    with ox.host_compute():
        w = w * decay  # w stays in host memory, computed there on purpose
    ```
    """
    return jax.named_scope(HOST_COMPUTE_SCOPE)


# -- the walk --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Origin:
    kind: str  # parameter, optimizer, input, activation, gradient
    what: str
    fetched_in: str | None = None  # phase in which a host leaf's device copy was made


def _is_host(aval) -> bool:
    return getattr(aval, "memory_space", None) == jax.memory.Space.Host


def _is_device(aval) -> bool:
    return getattr(aval, "memory_space", None) == jax.memory.Space.Device


def _nbytes(aval) -> int:
    return int(np.prod(aval.shape, dtype=np.int64)) * np.dtype(aval.dtype).itemsize


def _is_var(v) -> bool:
    return isinstance(v, jex.core.Var) and not isinstance(v, jex.core.Literal)


def _is_drop(v) -> bool:
    return type(v).__name__ == "DropVar"


def _dce(jaxpr):
    """Drop dead equations (XLA would): a transfer nobody uses is not a transfer."""
    try:
        from jax._src.interpreters import partial_eval as pe

        return pe.dce_jaxpr(jaxpr, [True] * len(jaxpr.outvars), instantiate=True)[0]
    except Exception:  # private API: without it, only dropped outputs are skipped
        return jaxpr


def _open(jaxpr):
    return getattr(jaxpr, "jaxpr", jaxpr)


class _Walker:
    def __init__(self, outputs: dict[Any, tuple[str, str]]):
        self.outputs = outputs  # top-level outvar -> (kind, what)
        self.transfers: list[Transfer] = []
        self.violations: list[Violation] = []
        self.names_seen: set[str] = set()
        self.saw_backward = False
        self._seen_violations: set[tuple[str, str]] = set()

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
    ) -> None:
        seen_backward = False
        fetches: list[tuple[str, Any]] = []  # host leaves fetched in this body: (path, aval)
        for eqn in jaxpr.eqns:
            stack = str(eqn.source_info.name_stack)
            if phase == "backward" or "transpose(" in stack:
                eqn_phase = "backward"
                seen_backward = self.saw_backward = True
            elif "jvp(" in stack:
                eqn_phase = "forward"
            elif seen_backward:
                eqn_phase = "update"
            else:
                eqn_phase = phase
            eqn_host_ok = host_ok or HOST_COMPUTE_SCOPE in stack
            prim = eqn.primitive.name
            if eqn_phase == "backward":
                self._check_residuals(eqn, env)
            if prim == "device_put":
                self._device_put(eqn, env, count, eqn_phase, where, fetches, top)
            elif prim == "name":
                self.names_seen.add(eqn.params["name"])
                env[eqn.outvars[0]] = _Origin("activation", eqn.params["name"])
            elif (
                prim in _VIEWS
                and len(eqn.invars) == 1
                and _is_var(eqn.invars[0])
                and eqn.invars[0] in env
            ):
                if not eqn_host_ok and _is_host(eqn.invars[0].aval) and prim not in _STRUCTURAL:
                    self._host_arithmetic(eqn, env, where)
                env[eqn.outvars[0]] = env[eqn.invars[0]]
            elif prim in _STRUCTURAL or list(jex.core.jaxprs_in_params(eqn.params)):
                before = self.saw_backward
                self._nested(eqn, env, count, eqn_phase, where, eqn_host_ok)
                # A gradient computed inside a nested jit: what follows it is the update.
                seen_backward = seen_backward or (self.saw_backward and not before)
            elif not eqn_host_ok:
                if any(_is_var(v) and _is_host(v.aval) for v in eqn.invars):
                    self._host_arithmetic(eqn, env, where)

    # -- transfers -------------------------------------------------------------------

    def _device_put(self, eqn, env, count, phase, where, fetches, top) -> None:
        for invar, outvar in zip(eqn.invars, eqn.outvars):
            if not _is_var(invar):
                continue
            source = env.get(invar)
            to_host = _is_device(invar.aval) and _is_host(outvar.aval)
            to_device = _is_host(invar.aval) and _is_device(outvar.aval)
            if source is not None:
                if to_device and source.kind in ("parameter", "optimizer", "input"):
                    env[outvar] = dataclasses.replace(source, fetched_in=phase)
                else:
                    env[outvar] = dataclasses.replace(source, fetched_in=None)
            if not (to_host or to_device) or _is_drop(outvar):
                continue
            if source is not None:
                kind, what = source.kind, source.what
                if to_device and kind == "parameter":
                    fetches.append((what, invar.aval))
            elif top and outvar in self.outputs:
                kind, what = self.outputs[outvar]
            elif to_host and phase == "backward":
                kind, what = "gradient", self._gradient_of(outvar.aval, fetches)
                env[outvar] = _Origin("gradient", what)
            else:
                kind, what = "intermediate", "a computed value"
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

    @staticmethod
    def _gradient_of(aval, fetches: list[tuple[str, Any]]) -> str:
        """The host leaf whose fetch this cotangent transposes: JAX transposes in
        reverse order, so the latest fetch of the same type not yet paired."""
        for i in range(len(fetches) - 1, -1, -1):
            path, fetched = fetches[i]
            if tuple(fetched.shape) == tuple(aval.shape) and fetched.dtype == aval.dtype:
                del fetches[i]
                return path
        return "a host-resident leaf"

    # -- contract checks on the walk ---------------------------------------------------

    def _check_residuals(self, eqn, env) -> None:
        for v in eqn.invars:
            if not _is_var(v):
                continue
            source = env.get(v)
            if source is not None and source.fetched_in == "forward" and source.kind == "parameter":
                self.violate(
                    "fetched outside a region",
                    source.what,
                    f"`{source.what}` is host-resident, but its device copy fetched in the "
                    "forward pass is kept for the backward pass (a residual), so the whole "
                    "leaf occupies device memory for the step. Fetch it only inside a "
                    "region: call the module through `ox.scan(...)`/`ox.checkpoint(...)` "
                    "instead of `jax.device_put(...)` outside one.",
                )

    def _host_arithmetic(self, eqn, env, where) -> None:
        for v in eqn.invars:
            if not (_is_var(v) and _is_host(v.aval)):
                continue
            source = env.get(v)
            place = f" (in {' > '.join(where)})" if where else ""
            if source is not None and source.kind == "gradient":
                self.violate(
                    "host-typed gradient",
                    source.what,
                    f"The gradient of `{source.what}` is host-typed (the transpose of its "
                    f"fetch sends it back to host memory) and `{eqn.primitive.name}`"
                    f"{place} computes on it there. Gradients of host-resident parameters "
                    "must reach the optimizer on the device: wrap the optimizer with "
                    "`ox.offload_optimizer(...)`, or fetch them with "
                    "`jax.device_put(g, jax.memory.Space.Device)` before clipping.",
                )
            else:
                what = source.what if source is not None else "a host-typed value"
                self.violate(
                    "arithmetic on host",
                    what,
                    f"`{eqn.primitive.name}`{place} computes on `{what}` "
                    f"({v.aval.str_short()}) in host "
                    "memory. Fetch it to the device first (call the module through "
                    "`ox.scan`/`ox.checkpoint`, or `jax.device_put(x, "
                    "jax.memory.Space.Device)`), or, if computing on the host is intended, "
                    "wrap the computation in `with ox.host_compute():`.",
                )

    # -- nested programs -------------------------------------------------------------

    def _nested(self, eqn, env, count, phase, where, host_ok) -> None:
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
            )
        elif prim == "cond":
            best = None
            for index, branch in enumerate(params["branches"]):
                sub = _Walker(self.outputs)
                sub.names_seen = self.names_seen
                sub._enter(
                    _open(branch),
                    invars[1:],
                    outvars,
                    env,
                    count,
                    phase,
                    where + (f"cond branch {index}",),
                    host_ok,
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
                )

    def _enter(self, body, invars, outvars, env, count, phase, where, host_ok) -> None:
        inner: dict = {}
        for outer, var in zip(invars, body.invars):
            if _is_var(outer) and outer in env:
                inner[var] = env[outer]
        self.walk(body, inner, count, phase, where, host_ok)
        if len(outvars) == len(body.outvars):
            for outer, var in zip(outvars, body.outvars):
                if _is_var(var) and var in inner and not _is_drop(outer):
                    env[outer] = inner[var]


# -- the entry point -------------------------------------------------------------------

_ROLE_KIND: dict[str | None, str] = {"param": "parameter", "optimizer": "optimizer"}
_HOST_USE = (
    "{caller}({name}): {paths} {are} host-resident (pinned_host) and reached an operation "
    "that mixes memory spaces (`{error}`): either {it} is used outside any "
    "`ox.scan`/`ox.checkpoint` region, or {its} gradient, which comes out host-typed (the "
    "transpose of the fetch sends it back to host memory), meets device values, e.g. in "
    "gradient clipping or the optimizer. Call the module that uses {it} through "
    "`ox.scan(...)`/`ox.checkpoint(...)`, wrap the optimizer with "
    "`ox.offload_optimizer(...)` (which fetches gradients explicitly), or place {it} on "
    "the device (`ox.field(memory='device')`)."
)
_WRONG_MEMORY = (
    "Output `{out}` is returned in {got!r} memory, but it is the new value of `{path}`, "
    "which the plan puts in {want!r}: every next call would move it back (implicitly, "
    "{size}). Return it in {want!r}: update host-resident parameters with "
    "`ox.apply_updates`, or send it back with `jax.device_put(x, jax.memory.Space.{space})`."
)


def _is_dynamic(x: Any) -> bool:
    return isinstance(x, (jax.Array, np.ndarray, np.generic, jax.ShapeDtypeStruct))


def _split_output(path: str) -> tuple[str, str]:
    rest = path[len("output") :]
    if rest.startswith("["):
        end = rest.index("]") + 1
        return "output" + rest[:end], rest[end:]
    return "output", rest


def _match_outputs(entry: Compilation, roots: Sequence[str]) -> list[Any]:
    """For each array output, the argument leaf it is the new value of (or None): an
    output subtree matches an argument whose leaves have the same paths and types."""
    out_paths = entry.output_paths()
    groups: dict[str, dict[str, int]] = {}
    for i, path in enumerate(out_paths):
        group, suffix = _split_output(path)
        groups.setdefault(group, {})[suffix] = i
    inputs: dict[str, dict[str, Any]] = {}
    for leaf in entry.plan.leaves:
        root = next(
            (
                r
                for r in roots
                if leaf.path == r or leaf.path.startswith(r + ".") or leaf.path.startswith(r + "[")
            ),
            None,
        )
        if root is not None:
            inputs.setdefault(root, {})[leaf.path[len(root) :]] = leaf
    matched: list[Any] = [None] * len(out_paths)
    used: set[str] = set()
    for group, members in groups.items():
        for root, leaves in inputs.items():
            if root in used or set(leaves) != set(members):
                continue
            if all(
                tuple(entry.out_avals[i].shape) == leaves[s].shape
                and np.dtype(entry.out_avals[i].dtype) == leaves[s].dtype
                for s, i in members.items()
            ):
                used.add(root)
                for suffix, i in members.items():
                    matched[i] = leaves[suffix]
                break
    return matched


def _as_device(a: jax.ShapeDtypeStruct) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding.with_memory_kind("device"))


def _mixes_memory(error: BaseException) -> bool:
    text = str(error)
    return "memory_space of all inputs" in text or "host-resident array was used outside" in text


def _locate_host_use(
    wrapper: _JitWrapper, args, kwargs, error: BaseException, caller: str = "ox.audit"
) -> ContractError:
    """Which host-resident leaves make the trace mix memory spaces: retrace with every
    other host-resident leaf typed as device memory (only on this error path)."""
    plan = wrapper.plan(*args, **kwargs)
    leaves, treedef = jax.tree_util.tree_flatten((args, kwargs))
    mask = tuple(map(_is_dynamic, leaves))
    statics = tuple(x for x, m in zip(leaves, mask) if not m)
    dynamic = [x for x, m in zip(leaves, mask) if m]
    in_shardings = tuple(
        None if lp.memory is None else plan.sharding(lp, getattr(x, "sharding", None))
        for x, lp in zip(dynamic, plan.leaves)
    )
    flat = wrapper._make_flat(plan, treedef, mask, statics, [])
    entry = Compilation(None, flat, plan, in_shardings, (), (), (), [])
    abstract = entry.abstract(dynamic)
    host = {
        i
        for i, a in enumerate(abstract)
        if a.sharding is not None and a.sharding.memory_kind == "pinned_host"
    }
    offenders = []
    for i in sorted(host):
        trial = [_as_device(a) if j in host and j != i else a for j, a in enumerate(abstract)]
        try:
            jax.make_jaxpr(flat)(*trial)
        except ValueError as e:
            if _mixes_memory(e):
                offenders.append(plan.leaves[i].path)
        except Exception:
            pass
    text = str(error)
    start = text.find("memory_space of all inputs")
    jax_error = text[start : text.find("same", start) + 4] if start >= 0 else text.split("\n")[0]
    paths = ", ".join(f"`{p}`" for p in offenders) or "some host-resident leaves"
    one = len(offenders) <= 1
    message = _HOST_USE.format(
        caller=caller,
        name=wrapper.__name__,
        paths=paths,
        are="is" if one else "are",
        error=jax_error,
        it="it" if one else "them",
        its="its" if one else "their",
    )
    violations = [Violation("host leaf outside region", p, message) for p in offenders]
    return ContractError(message, violations)


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
    wrapper = fn if isinstance(fn, _JitWrapper) else filter_jit(fn)
    name = getattr(wrapper, "__name__", "fn")
    try:
        entry, leaves = wrapper.compilation(*args, **kwargs)
    except ValueError as error:
        if not _mixes_memory(error):
            raise
        raise _locate_host_use(wrapper, args, kwargs, error) from None
    roots = [root for root, _ in _labels(wrapper.fn, args, kwargs)]
    plan: Plan = entry.plan
    closed = jax.jit(entry.flat).trace(*entry.abstract(leaves)).jaxpr
    jaxpr = _dce(closed.jaxpr)

    matched = _match_outputs(entry, roots)
    out_paths = entry.output_paths()
    outputs: dict[Any, tuple[str, str]] = {}
    for var, path, leaf in zip(jaxpr.outvars, out_paths, matched):
        if _is_var(var):
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
                    size=_mib(_nbytes(aval)),
                    space="Host" if leaf.memory == "pinned_host" else "Device",
                ),
            )
    _check_activations(plan, walker, transfers)
    _check_devices(args, kwargs, wrapper, walker)
    report = TransferReport(name, plan.strategy.name, transfers, walker.violations)
    return report.check()


def _argument_transfers(entry: Compilation, leaves: list) -> list[Transfer]:
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
    differentiated = any(t.phase == "backward" for t in transfers) or walker.saw_backward
    for name, policy in plan.activations.items():
        declared, module_path = plan.declared_activations[name]
        moved = [t for t in transfers if t.kind == "activation" and t.what == name]
        if name not in walker.names_seen:
            walker.violate(
                "activation never produced",
                name,
                f"Activation {name!r} is declared {declared!r} by `{module_path}`, but the "
                "program never produces it. Call `ox.name(x, "
                f"{name!r})` where it is computed, or remove the declaration.",
            )
        elif policy == "offload" and differentiated:
            down = [t for t in moved if t.direction == "device-to-host" and t.phase == "forward"]
            up = [t for t in moved if t.direction == "host-to-device" and t.phase == "backward"]
            if not down or not up:
                walker.violate(
                    "activation not offloaded",
                    name,
                    f"Activation {name!r} is declared 'offload' by `{module_path}`, but the "
                    "program does not move it to host in the forward pass and back in the "
                    "backward pass. Produce it inside an `ox.scan`/`ox.checkpoint` region "
                    "(only there does the remat policy apply).",
                )
        elif policy != "offload" and moved:
            walker.violate(
                "activation moved",
                name,
                f"Activation {name!r} is declared {policy!r} (effective policy) by "
                f"`{module_path}`, but the program moves it between memories "
                f"({_mib(sum(t.bytes for t in moved))} per call): a remat policy other "
                "than the plan's applies to it. Use the regions `ox.scan`/`ox.checkpoint`.",
            )


def _check_devices(args, kwargs, wrapper: _JitWrapper, walker: _Walker) -> None:
    from ._guard import device_offenders

    offenders, majority = device_offenders(_labels(wrapper.fn, args, kwargs))
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
