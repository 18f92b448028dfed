"""The plans of whole pytrees: `ox.plan(tree)`, and the plan of an optimizer state for its
parameters (`state_plan`, which `ox.offload_optimizer`'s `init` places the state by)."""

from typing import Any

from .._declare.strategy import Strategy
from .._sharding.mesh import AnyMesh
from .plan import Plan


def plan(
    tree: Any,
    strategy: "str | Strategy | None" = None,
    *,
    mesh: AnyMesh | None = None,
    name: str = "tree",
) -> Plan:
    """The plan for one pytree (a model, an optimizer state, or a tuple of them).

    **Arguments:**

    - `tree`: the pytree; its array leaves may be arrays or `jax.ShapeDtypeStruct`s.
        Nothing is traced or moved.
    - `strategy`: a strategy name (`"hybrid"`, ...) or an `ox.Strategy`; by default the
        model's own annotations.
    - `mesh`: the mesh over which leaves with a `spec` are sharded.
    - `name`: the label of the tree in leaf paths (`name="model"` gives
        `model.layers.w1`).

    **Returns:** an `ox.Plan`; `print` it for a table of every leaf's memory. Optimizer
    state in `tree` (`(model, opt_state)`) is sharded like the parameter it mirrors.
    """
    return Plan([(name, tree)], strategy, mesh)


def state_plan(params: Any, state: Any, strategy: Strategy | None = None, traced=False) -> Plan:
    """The plan of an optimizer `state` for `params` (its root 1): state in the memory
    the strategy gives it (by default, as the optimizer declares it), sharded like the
    parameter whose key path it mirrors (replicated where shapes differ), on the mesh
    the parameters are on. Inside a step, `strategy` is the step's, so `opt.init` traced
    by `ox.filter_jit(..., strategy=...)` builds the state where that strategy keeps it.
    With `traced` (parameters inside a trace, which carry no mesh), only the memories
    are meaningful."""
    roots = [("params", params), ("opt_state", state)]
    return Plan(roots, strategy, specs_need_a_mesh=not traced)
