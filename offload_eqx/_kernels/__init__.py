"""Host kernels of our own, in C++ against XLA's FFI, built on first use with the
system's compiler and called through `jax.ffi` (`build`): `adamw.cc`, AdamW on float32
masters in one in-place pass (used by `_optimizer.fused_adamw`).

May import nothing of the package; every layer from `_optimizer` up may import it.
"""
