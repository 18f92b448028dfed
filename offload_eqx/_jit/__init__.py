"""`ox.filter_jit`: one compiled entry per argument structure (`compile`, cached in
`cache`), the per-call path (`dispatch`), ahead-of-time lowering (`aot`), and what can go
wrong around a call, each said in leaf paths: implicit transfers (`guard`:
`ox.no_implicit_transfers`), host-resident leaves used outside a region (`host_use`),
`eqx.error_if` raised from the call (`runtime_errors`), a failed call (`call_errors`),
Ctrl-C held during donating calls (`interrupts`), a step a known XLA:GPU fault
miscompiles, refused before a GPU runs it (`miscompiled`).

May import `_base` to `_arrays`.
"""
