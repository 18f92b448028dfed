"""Ahead-of-time compilation of an `ox.filter_jit` step: `step.lower(*args).compile()`.

As with `eqx.filter_jit`, the lowered and compiled objects take and return what the
step does (pytrees, static leaves included), not the flat list of array leaves the
program underneath takes: `step.lower(model, x).compile()(model, x)`. A call whose
static part, structure or array types differ from the ones lowered is refused with what
differs. Everything else is JAX's (`as_text()`, `cost_analysis()`, `memory_analysis()`,
and the other attributes of `jax.stages.Lowered` / `jax.stages.Compiled`).
"""

from collections.abc import Callable
from typing import Any

import jax

from .._base.compiler_faults import CompilerFaultError
from .call_errors import donated_problem
from .miscompiled import affected, refusal

_OTHER_CALL = (
    "{caller}: this compiled step was lowered for other arguments: {detail}. Lower and "
    "compile it for these arguments (`step.lower(*args).compile()`), or call the step "
    "itself, which compiles what it needs."
)


_AHEAD_OF_TIME = (
    "{where} was given {what}: a program built ahead of time for fixed arguments, which "
    "holds no plan and cannot be traced again. Pass {fix}: {usage}."
)


def refuse_ahead_of_time(fn: Any, where: str, usage: str = "") -> None:
    """Raise a `TypeError` if `fn` is a lowered or compiled program (`step.lower(...)`,
    `.compile()`, or `jax.jit`'s), which `where` (`"ox.estimate"`) cannot trace: it
    would fail inside the trace with JAX's words about a traced array. `usage`: the
    right call (default `where(step, *args)`)."""
    if isinstance(fn, (Lowered, Compiled)):
        built = "step.lower(...)" + (".compile()" if isinstance(fn, Compiled) else "")
        what = f"`{built}` of {fn._caller}"
        fix = "the step itself (the `ox.filter_jit` object)"
    elif isinstance(fn, (jax.stages.Lowered, jax.stages.Compiled)):
        what = f"a `jax.stages.{type(fn).__name__}`"
        fix = "the function itself (`ox.filter_jit(f)`, `jax.jit(f)` or `f`)"
    else:
        return
    usage = usage or f"`{where}(step, *args)`, with the step's arguments"
    raise TypeError(_AHEAD_OF_TIME.format(where=where, what=what, fix=fix, usage=usage))


class Compiled:
    """What `Lowered.compile()` returns: the compiled program, called like the step.

    Like the step, it refuses arguments a donating call consumed (deleted), naming
    them, before the program runs (XLA would say "Invalid buffer passed to Execute()"),
    and a program the installed XLA:GPU is known to miscompile (`miscompiled`): it can
    be inspected, not run."""

    def __init__(self, compiled: jax.stages.Compiled, lowered: "Lowered"):
        self.compiled = compiled
        self._entry = lowered._entry
        self._split = lowered._split  # (args, kwargs) -> (key, types, array leaves)
        self._caller = lowered._caller
        self._step = lowered._step
        self._refused = (
            refusal(compiled, self._entry, self._caller) if affected(self._entry) else None
        )

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._refused is not None:
            raise CompilerFaultError(self._refused)
        key, types, dynamic = self._split(args, kwargs)
        expected_key, expected_types = self._entry.key, self._entry.types
        if key != expected_key:
            detail = "their structure or their non-array (static) leaves differ"
            raise TypeError(_OTHER_CALL.format(caller=self._caller, detail=detail))
        if types != expected_types:
            changed = [
                f"`{leaf.path}` is {_shown(got)}, lowered for {_shown(want)}"
                for leaf, got, want in zip(self._entry.plan.leaves, types, expected_types)
                if got != want
            ]
            detail = "; ".join(changed[:3])
            raise TypeError(_OTHER_CALL.format(caller=self._caller, detail=detail))
        if any(isinstance(x, jax.Array) and x.is_deleted() for x in dynamic):
            arguments = self._step.arguments(*args, **kwargs)
            problem = donated_problem(arguments, self._caller, self._step.donate)
            if problem is not None:
                raise problem
        return self._entry.rebuild(self.compiled(*self._entry.moved(dynamic)))

    def as_text(self, *args: Any, **kwargs: Any) -> Any:
        return self.compiled.as_text(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.compiled, name)


class Lowered:
    """What `step.lower(*args)` returns: the lowered program; `.compile()` compiles it
    into a `Compiled` called like the step."""

    def __init__(
        self, lowered: jax.stages.Lowered, entry: Any, split: Callable, caller: str, step: Any
    ):
        self.lowered = lowered
        self._entry = entry
        self._split = split
        self._caller = caller
        self._step = step  # the `ox.filter_jit` step: its argument labels and donation

    def compile(self, compiler_options: dict[str, Any] | None = None) -> Compiled:
        return Compiled(self.lowered.compile(compiler_options=compiler_options), self)

    def as_text(self, *args: Any, **kwargs: Any) -> Any:
        return self.lowered.as_text(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.lowered, name)


def _shown(types: tuple) -> str:
    shape, dtype, weak = types
    return f"{'weakly typed ' if weak else ''}{jax.numpy.dtype(dtype).name}{list(shape)}"
