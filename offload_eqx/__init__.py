"""offload_eqx: host offloading for Equinox models, declared on fields and audited.

The modules form layers; each imports only from the layers above it:

1. vocabulary: `_placement` (ox.field), `_activations` (ox.activations), `_strategy`,
   `_table` (the one table formatter), `_errors` (exception types), `_options` (the
   planners' options, checked before any work), `_primitives` (what each JAX primitive
   means to the plan and the audit).
2. sharding: `_memory_space` (host or device types, explicit moves), `_mesh` (specs over
   a mesh, moving arrays onto it).
3. plan: `_plan_walk` (reading annotations), `_remat_policy` (names under a strategy),
   `_leaf_plan` (where one leaf lives), `_plan_print`, `_plan` (every placement rule: memory,
   sharding, mirrored optimizer state, donation, outputs <-> arguments, the name checks).
4. tracing: `_trace_state` (the one trace state), `_fetches` (what a region fetches,
   ox.fetch), `_regions` (ox.scan, ox.checkpoint, ox.name), `_annotate`, `_own_regions`
   (modules with host fields bring a region), `_place` (ox.place, ox.abstract, ox.shard),
   `_checkpoints` (restoring into planned memory), `_guard` (implicit transfers at run
   time), `_host_use`, `_runtime_errors` (`eqx.error_if` raised from the call),
   `_compile` (one compiled entry), `_call_errors` (a failed call said in leaf paths),
   `_interrupts` (Ctrl-C held during donating calls), `_jit_cache` (the compile cache,
   the function's), `_aot` (lowered and compiled steps), `_dispatch` (the per-call path),
   `_jit` (ox.filter_jit).
5. optimizer: `_optimizer_state`, `_optimizer_checks`, `_optimizer_stream`, `_optimizer`
   (ox.offload_optimizer, ox.update_and_apply, ox.apply_updates).
6. inspection: `_transfer_report`, `_jaxpr_walk`, `_audit` (ox.audit), `_targets`
   (targets and their speeds), `_target_devices`, `_deviceless`, `_memory_report`
   (ox.memory_report).
7. planning: `_flops` (the work of a traced step per phase), `_calibrate` (this machine's
   speeds), `_estimate` (ox.estimate), `_fit_space`, `_fit_result`, `_fit_search`,
   `_fit_refine`, `_fit` (ox.fit),
   `_max_batch` (ox.max_batch).
"""

from . import _own_regions  # noqa: F401  (gives classes declaring ox.field a region)
from ._activations import (
    Activations as Activations,
    LayerSplit as LayerSplit,
    activations as activations,
)
from ._annotate import annotate as annotate
from ._audit import audit as audit
from ._checkpoints import (
    restore_checkpoint as restore_checkpoint,
    save_checkpoint as save_checkpoint,
    tree_deserialise_leaves as tree_deserialise_leaves,
)
from ._errors import (
    ContractError as ContractError,
    HostUseError as HostUseError,
    ImplicitTransferError as ImplicitTransferError,
    Violation as Violation,
)
from ._estimate import StepEstimate as StepEstimate, estimate as estimate
from ._fetches import fetch as fetch
from ._fit import fit as fit
from ._fit_result import Candidate as Candidate, FitResult as FitResult
from ._guard import no_implicit_transfers as no_implicit_transfers
from ._jaxpr_walk import host_compute as host_compute
from ._jit import FilterJit as FilterJit, filter_jit as filter_jit
from ._jit_cache import clear_caches as clear_caches
from ._max_batch import max_batch as max_batch
from ._memory_report import (
    MemoryComparison as MemoryComparison,
    MemoryReport as MemoryReport,
    compare_memory as compare_memory,
    memory_report as memory_report,
)
from ._optimizer import (
    apply_updates as apply_updates,
    offload_optimizer as offload_optimizer,
    update_and_apply as update_and_apply,
)
from ._place import abstract as abstract, place as place, shard as shard
from ._placement import Placement as Placement, field as field
from ._plan import LeafPlan as LeafPlan, Plan as Plan, plan as plan
from ._regions import checkpoint as checkpoint, name as name, scan as scan
from ._strategy import STRATEGIES as STRATEGIES, Strategy as Strategy
from ._targets import (
    TARGETS as TARGETS,
    Speeds as Speeds,
    Target as Target,
    register_target as register_target,
)
from ._transfer_report import (
    HostComputation as HostComputation,
    Transfer as Transfer,
    TransferReport as TransferReport,
)

__version__ = "0.1.0"
