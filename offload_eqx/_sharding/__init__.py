"""JAX's placement machinery, wrapped: host or device memory kinds and the types
that go with them (`memory_space`), specs and moves over a
mesh (`mesh`). Computation placed on the host is `_host`'s.

May import `_base` and `_declare`.
"""
