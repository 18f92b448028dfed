"""offload_eqx: host offloading for Equinox models, declared on the model and checked.

Accelerator memory is often what limits training. JAX can keep arrays in host memory
(the `pinned_host` memory kind) and move them in and out during a step, but each program
then needs its own shardings and remat policies, and a misspelt activation name
silently offloads nothing. Here a model says where each of its arrays lives and what to
do with each named activation; one wrapper compiles that plan, and the package reports
and checks what it does.

Import it as `import offload_eqx as ox`. The entry points, by task:

- Declare placements: `ox.field(memory="pinned_host")` on `eqx.Module` fields,
  `ox.annotate` for modules you did not write; `ox.name` and `ox.activations` for
  activations to save, offload or recompute.
- Run layers where the activation policy applies: `ox.scan` (stacked layers),
  `ox.checkpoint` (one module).
- Compile and run a step: `ox.filter_jit` (`strategy=` a name in `ox.STRATEGIES` or an
  `ox.Strategy`), `ox.place` to put arrays where the plan says.
- Optimizer state in host memory: `ox.offload_optimizer`, `ox.update_and_apply`
  (`delay=1`: the update of the previous step's gradients overlaps this step;
  `ox.apply_pending` applies the last ones). On the CPU, `optax.adam(w)` with float32
  masters runs as one fused in-place kernel, XLA's arithmetic bit for bit, compiled when
  offload_eqx was installed; `ox.host_kernels()` says whether this process uses it.
- See what moves: `ox.audit`, `ox.no_implicit_transfers`, `step.plan(...)`.
- Memory without the hardware: `ox.memory_report`, `ox.compare_memory`
  (`target="h100"` or `"tpu-v5p"`).
- Plan a run: `ox.estimate` (predicted step time: the compiled program's schedule
  simulated, `StepEstimate.timeline` as a Chrome trace), `ox.fit` (the fastest plan that
  fits), `ox.max_batch` (the largest batch that fits); `ox.calibrate_host` measures the
  host you plan for (the optimizer update on the host runs at its threads' bandwidth).
- Checkpoints: `ox.save_checkpoint`, `ox.restore_checkpoint`.

Every public name has a docstring (`help(ox.fit)`). The repository's README.md has the
first examples; its documentation site (concepts, a guide per task, the API reference)
is built with `nox -s docs` into `site/index.html`.
"""

from ._arrays.place import abstract as abstract, place as place, shard as shard
from ._base.compiler_faults import CompilerFaultError as CompilerFaultError
from ._base.errors import (
    ContractError as ContractError,
    HostUseError as HostUseError,
    ImplicitTransferError as ImplicitTransferError,
    Violation as Violation,
)
from ._checkpoints.checkpoints import (
    restore_checkpoint as restore_checkpoint,
    save_checkpoint as save_checkpoint,
    tree_deserialise_leaves as tree_deserialise_leaves,
)
from ._declare.activations import (
    Activations as Activations,
    LayerSplit as LayerSplit,
    activations as activations,
)
from ._declare.placement import Placement as Placement, field as field
from ._declare.strategy import STRATEGIES as STRATEGIES, Strategy as Strategy
from ._fit.fit import fit as fit
from ._fit.result import Candidate as Candidate, FitResult as FitResult
from ._host.kernels.gpu_host import host_kernels as host_kernels
from ._inspect.audit import audit as audit
from ._inspect.jaxpr_walk import host_compute as host_compute
from ._inspect.memory_report import (
    MemoryComparison as MemoryComparison,
    MemoryReport as MemoryReport,
    compare_memory as compare_memory,
    memory_report as memory_report,
)
from ._inspect.transfer_report import (
    HostComputation as HostComputation,
    Transfer as Transfer,
    TransferReport as TransferReport,
)
from ._jit.cache import clear_caches as clear_caches
from ._jit.guard import no_implicit_transfers as no_implicit_transfers
from ._jit.jit import FilterJit as FilterJit, filter_jit as filter_jit
from ._optimizer.optimizer import (
    apply_pending as apply_pending,
    apply_updates as apply_updates,
    offload_optimizer as offload_optimizer,
    update_and_apply as update_and_apply,
)
from ._plan.of_trees import plan as plan
from ._plan.plan import LeafPlan as LeafPlan, Plan as Plan
from ._planning.estimate import StepEstimate as StepEstimate, estimate as estimate
from ._planning.events import Event as Event, Simulation as Simulation
from ._planning.max_batch import max_batch as max_batch
from ._targets.calibrate import calibrate_host as calibrate_host
from ._targets.matmul_efficiency import MatmulEfficiency as MatmulEfficiency
from ._targets.speeds import matmul_efficiency as matmul_efficiency
from ._targets.targets import (
    TARGETS as TARGETS,
    Speeds as Speeds,
    Target as Target,
    register_target as register_target,
)
from ._trace import own_regions as _own_regions  # noqa: F401  (gives classes declaring ox.field a region)
from ._trace.annotate import annotate as annotate
from ._trace.fetches import fetch as fetch
from ._trace.regions import checkpoint as checkpoint, name as name, scan as scan

__version__ = "0.1.0"
