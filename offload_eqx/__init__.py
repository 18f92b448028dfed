"""offload_eqx: host offloading for Equinox models, declared on fields and audited."""

from ._activations import Activations as Activations
from ._activations import activations as activations
from ._activations import name as name
from ._annotate import annotate as annotate
from ._jit import filter_jit as filter_jit
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

__version__ = "0.1.0"
