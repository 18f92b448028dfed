"""offload_eqx: host offloading for Equinox models, declared on fields and audited.

annotations (`_placement`, `_activations`, `_annotate`) -> plan (`_plan`, `_strategy`)
-> traced program (`_regions`, `_optimizer`, `_jit`, `_mesh`) -> audit / report
(`_jaxpr_walk`, `_audit`, `_transfer_report`, `_guard`, `_memory`, `_targets`).
"""

from ._activations import Activations as Activations, activations as activations, name as name
from ._annotate import annotate as annotate
from ._audit import audit as audit
from ._guard import (
    ImplicitTransferError as ImplicitTransferError,
    no_implicit_transfers as no_implicit_transfers,
)
from ._jaxpr_walk import host_compute as host_compute
from ._jit import filter_jit as filter_jit
from ._memory import (
    MemoryComparison as MemoryComparison,
    MemoryReport as MemoryReport,
    compare_memory as compare_memory,
    memory_report as memory_report,
)
from ._mesh import shard as shard
from ._optimizer import (
    DeviceState as DeviceState,
    OffloadedState as OffloadedState,
    apply_updates as apply_updates,
    offload_optimizer as offload_optimizer,
)
from ._place import place as place
from ._placement import Placement as Placement, field as field
from ._plan import LeafPlan as LeafPlan, Plan as Plan, plan as plan
from ._regions import checkpoint as checkpoint, scan as scan
from ._sequential import (
    SequentialOptimizer as SequentialOptimizer,
    SequentialState as SequentialState,
    check_elementwise as check_elementwise,
    check_per_leaf as check_per_leaf,
    sequential_offload_optimizer as sequential_offload_optimizer,
)
from ._strategy import STRATEGIES as STRATEGIES, Strategy as Strategy
from ._targets import TARGETS as TARGETS, Target as Target, register_target as register_target
from ._transfer_report import (
    ContractError as ContractError,
    Transfer as Transfer,
    TransferReport as TransferReport,
    Violation as Violation,
)

__version__ = "0.1.0"
