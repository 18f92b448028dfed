"""Host kernels of our own, in C++ against XLA's FFI: compiled when the package is
installed (`compile`, called by the build hook `hatch_build.py`), loaded only as they
were built (`load`: owner, permissions, SHA-256, and bytes this machine can load, read
by `elf`, which the build also runs in a child process) and called through `jax.ffi`:
`adamw.cc`, AdamW on float32 masters in one in-place pass, XLA's arithmetic bit for bit
(used by `_optimizer.fused_adamw`); `gpu_host` registers them with the CUDA plugin's host
compiler too, once a child process has proven that safe.

May import nothing of the package but `_base` (the build hook runs `compile` alone).
"""
