"""What the host computes inside a step, and how it is called.

The optimizer update on the host (`ox.offload_optimizer(update_on="host")`), the sum of
host-resident parameters and their updates, and state built where it will live are host
computations: JAX's `compute_on` primitive with `compute_type="device_host"`, run by
XLA:CPU inline on the CPU backend and by the CUDA plugin's own XLA:CPU as an async host
call on XLA:GPU.

- `compute`: `on_host(fn, *args)`, the one entry: traces `fn` with device-typed operands,
  sends device operands to host memory explicitly, and names the computation for the
  audit; which targets run a host update, and with which compiler options.
- `calls`: binds a traced computation as one host call, or as a chain of them
  (`split`: one per group of results, so XLA:GPU holds one group's results beside the
  state), a large elementwise group a slice at a time (`chunks`), each slice's results
  written over the donated state; the groups and slices are `groups`'s, the one slicing
  driver, which the device update of `stream=None` (`_optimizer.whole_slices`) uses too,
  each piece on the device.
- `kernels`: our own C++ kernels (AdamW on float32 masters, XLA's arithmetic bit for
  bit), compiled when the package is installed, loaded only as built (`kernels.load`),
  registered with jaxlib's XLA:CPU and, once proven safe in a child process, with the
  CUDA plugin's host compiler (`kernels.gpu_host`).

May import `_base` and `_sharding`.
"""
