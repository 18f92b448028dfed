"""offload_eqx: host offloading for Equinox models, declared on fields and audited."""

from ._activations import Activations as Activations, activations as activations, name as name
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
from ._strategy import STRATEGIES as STRATEGIES
from ._targets import TARGETS as TARGETS
from ._targets import Target as Target
from ._targets import register_target as register_target, Strategy as Strategy

__version__ = "0.1.0"
