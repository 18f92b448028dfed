"""offload_eqx: host offloading for Equinox models, declared on fields and audited.

annotations (`_placement`, `_activations`, `_annotate`) -> plan (`_plan`, `_strategy`)
-> traced program (`_regions`, `_optimizer`, `_jit`, `_mesh`) -> audit / report
(`_audit`, `_guard`, `_memory`, `_targets`).
"""

from ._activations import Activations as Activations
from ._activations import activations as activations
from ._activations import name as name
from ._annotate import annotate as annotate
from ._audit import ContractError as ContractError
from ._audit import Transfer as Transfer
from ._audit import TransferReport as TransferReport
from ._audit import Violation as Violation
from ._audit import audit as audit
from ._audit import host_compute as host_compute
from ._guard import ImplicitTransferError as ImplicitTransferError
from ._guard import no_implicit_transfers as no_implicit_transfers
from ._jit import filter_jit as filter_jit
from ._memory import MemoryComparison as MemoryComparison
from ._memory import MemoryReport as MemoryReport
from ._memory import compare_memory as compare_memory
from ._memory import memory_report as memory_report
from ._optimizer import DeviceState as DeviceState
from ._optimizer import OffloadedState as OffloadedState
from ._optimizer import apply_updates as apply_updates
from ._optimizer import offload_optimizer as offload_optimizer
from ._place import place as place
from ._placement import Placement as Placement
from ._placement import field as field
from ._plan import LeafPlan as LeafPlan
from ._plan import Plan as Plan
from ._plan import plan as plan
from ._regions import checkpoint as checkpoint
from ._regions import scan as scan
from ._strategy import STRATEGIES as STRATEGIES
from ._strategy import Strategy as Strategy
from ._targets import TARGETS as TARGETS
from ._targets import Target as Target
from ._targets import register_target as register_target

__version__ = "0.1.0"
