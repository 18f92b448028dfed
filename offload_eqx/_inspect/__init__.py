"""What a compiled step does, reported: every transfer with its leaf path and bytes
(`audit`: `ox.audit`, over the walk of the traced program in `jaxpr_walk`, which names a
value by the output it is written into with `destinations` and checks the contract as it
goes with `walk_checks`, reported as
`transfer_report`), and device memory from the real compilers (`memory_report`:
`ox.memory_report`, `ox.compare_memory`).

May import every layer below it (`_base` to `_jit`, `_targets`).
"""
