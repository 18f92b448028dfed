"""The planner tests' problem: the experiments' decoder (`experiments/_decoder.py`),
small enough that a compile for the H100 takes a second, with a batch at which the
baseline does not fit the budgets the tests set from its own compiled memory."""

import functools
import pathlib
import sys
from typing import Any

import jax
import jax.numpy as jnp

import offload_eqx as ox

EXPERIMENTS = pathlib.Path(__file__).resolve().parents[1] / "experiments"
sys.path.insert(0, str(EXPERIMENTS))
try:
    import _decoder as decoder  # pyright: ignore[reportMissingImports]
finally:
    sys.path.remove(str(EXPERIMENTS))

CONFIG = decoder.Config("test", vocab=512, dim=128, ffn=384, layers=4, heads=4, seq=128)
BATCH = 16
FIXED = [
    "baseline",
    "remat",
    "offload_activations",
    "offload_params",
    "offload_optimizer",
    "hybrid",
]


@functools.cache
def make_problem() -> tuple[Any, tuple]:
    """The optimizer, and the step's arguments (abstract: nothing is allocated); one per
    process, shared by `test_fit.py` and `test_fit_between.py` (one worker runs both)."""
    model, opt_state = decoder.abstract_state(CONFIG)
    tokens = jax.ShapeDtypeStruct((BATCH, CONFIG.seq + 1), jnp.int32)
    optimizer = decoder.make_optimizer()
    return optimizer, (model, opt_state, tokens)


def step_of(problem: tuple, strategy: Any) -> Any:
    """The step under `strategy`: one function per strategy and process, so that a test
    fitting it after another finds its traces made (JAX keeps them by function)."""
    return _step(problem[0], strategy)


@functools.cache
def _step(optimizer: Any, strategy: Any) -> Any:
    return decoder.make_step(optimizer, strategy)


@functools.cache
def fixed_estimates_of(problem: tuple) -> dict[str, Any]:
    """Every fixed strategy's estimate (compiled), by name; once per process."""
    return {
        name: ox.estimate(step_of(problem, ox.STRATEGIES[name]), *problem[1], target="h100")
        for name in FIXED
    }
