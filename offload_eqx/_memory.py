"""TRANSITION: the memory reports moved to `_memory_report` (reports) and `_deviceless`
(compiling for a target). This module only keeps `offload_eqx/__init__.py` and the
experiments importing until they import `ox.memory_report`/`ox.compare_memory` (or
`_memory_report`); then delete it."""

from ._memory_report import (
    MemoryComparison as MemoryComparison,
    MemoryReport as MemoryReport,
    compare_memory as compare_memory,
    memory_report as memory_report,
)
