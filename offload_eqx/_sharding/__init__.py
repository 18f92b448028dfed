"""JAX's placement machinery, wrapped: host or device memory kinds and the types
that go with them (`memory_space`), specs and moves over a mesh (`mesh`), computation
placed on the host (`host_compute`; `host_split`, `host_chunks` and `host_calls` make it
one call or a chain of them, a large group a slice at a time).

May import `_base` and `_declare`.
"""
