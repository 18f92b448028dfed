"""The base layer: exception types, the one table formatter, the planners' option
checks and progress lines, what each JAX primitive means to the plan and the audit, and
every private name of JAX (`jax_private`) and Equinox (`equinox_private`) the package
uses, each looked up once, at import; the known XLA:GPU faults and how a compiled
program shows one (`compiler_faults`, `hlo_slices`).

May import nothing of the package; every other layer may import it.
"""
