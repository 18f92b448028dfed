"""Accelerators to compile for without the hardware: `ox.Target`, `ox.TARGETS`,
`ox.Speeds` (`targets`; `configs/` holds the GPU descriptions XLA:GPU needs), their
deviceless devices (`devices`), compiling a step for one (`deviceless`), and this
machine's own speeds (`calibrate`).

May import `_base` to `_sharding`.
"""
