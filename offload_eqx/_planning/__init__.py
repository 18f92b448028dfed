"""How fast a plan runs and how large a batch fits, in the order the data flows:

- `fused`: the table of fused kernels (cuDNN and splash attention, Pallas kernels' cost
  estimates), one rule per kind, read by the jaxpr count and the simulation alike;
- `flops`, `traced_time`: the work of a traced step per phase and the jaxpr count's
  time model (before any compile: what `ox.fit` orders candidates by);
- `hlo`, `kernels`, `events`, `schedule`, `timeline`: the compiled program read from its
  text, each instruction's cost as XLA formed it, what a simulated step is made of, the
  schedule run as events on the device's resources, and the events written as a Chrome
  trace or drawn as a Gantt chart;
- `estimate`: `ox.estimate`, from the compiled program where there is one;
- `max_batch`: `ox.max_batch`, the largest batch that fits.

May import every layer below it, up to `_inspect`.
"""

# The compiled-module reader lists XLA's rematerialized clones for the memory reports
# (`_inspect/recomputed.py`), which cannot import this layer.
from . import recomputed as recomputed  # noqa: E402
