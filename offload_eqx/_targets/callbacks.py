"""Host callbacks in a program compiled for a GPU target without a GPU.

JAX lowers a host callback (`jax.pure_callback`, `jax.experimental.io_callback`,
`jax.debug.callback` and `jax.debug.print`, and so `eqx.error_if` and
`eqx.branched_error_if`, which raise through one) by registering it with the platform's
backend; a process without a GPU has none, and the compile fails with JAX's "Unknown
backend: 'gpu' requested, but no platforms that are instances of gpu are present". A
deviceless compile (`ox.memory_report`, `ox.estimate`, `ox.fit` for `target="h100"`)
only wants the program's memory and schedule, and never runs it: so while one lowers
(`_host.compute.traced_for`), each callback is lowered as zeros of its results
(tokens passed through), and everywhere else exactly as JAX lowers it.

What that leaves out: the callback's own host work and the copy of its operands to the
host (a scalar for `eqx.error_if`), neither priced nor counted in memory.
"""

import functools
from typing import Any

from jax.interpreters import mlir

from .._base.jax_private import (
    CALLBACK_PRIMITIVES,
    full_like_aval,
    lowerings,
    platform_specific_lowerings,
)
from .._host.compute import deviceless_platform

GPU_PLATFORMS = ("cuda", "rocm")


def _jax_rule(primitive: Any, platform: str) -> Any:
    """The rule JAX lowers `primitive` with on `platform`: its own, else the common one."""
    entry = platform_specific_lowerings[platform].get(primitive)
    entry = entry or lowerings.get(primitive)
    return None if entry is None else entry.rule


def _lowering(jax_rule: Any) -> Any:
    def rule(ctx: Any, *args: Any, **params: Any) -> Any:
        if deviceless_platform() not in GPU_PLATFORMS:
            return jax_rule(ctx, *args, **params)
        if ctx.tokens_in is not None and len(ctx.tokens_in):
            ctx.set_tokens_out(ctx.tokens_in)
        return [full_like_aval(ctx, 0, aval) for aval in ctx.avals_out]

    return rule


@functools.cache
def lower_callbacks_as_zeros_in_deviceless_gpu_compiles() -> None:
    """Register the rule above for the GPU platforms, once per process."""
    for primitive in CALLBACK_PRIMITIVES:
        for platform in GPU_PLATFORMS:
            jax_rule = _jax_rule(primitive, platform)
            if jax_rule is not None:
                rule = _lowering(jax_rule)
                mlir.register_lowering(primitive, rule, platform=platform, cacheable=False)
