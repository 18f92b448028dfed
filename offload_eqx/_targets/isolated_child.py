"""The child process that compiles `ox.fit`'s candidate plans (`isolated`): run as
`python -P -m offload_eqx._targets.isolated_child`, it imports JAX and offload_eqx (its
start is their import), then answers requests on its standard input until that closes.

A request is a pickled dict: the module (MLIR bytecode), the compile options
(`CompileOptions.SerializeAsString()`), the ids of the devices compiled for and the
arguments of `jax.experimental.topologies.get_topology_desc` that make them. The child
builds those compile-only devices (once per topology) and compiles the module with the
client call JAX makes (`client.compile(module, devices, options)`), then answers with a
pickled dict: the memory analysis's fields and the compiled HLO text, or the error XLA
raised (its type's name and message). An abort of XLA (a `CHECK` failure) ends this
process, which is the parent's answer: its standard error holds XLA's last words.

A GPU program whose host computation calls one of offload_eqx's kernels names it in
the request (`kernels`): the CUDA plugin's host compiler finds a kernel only where it is
registered in the process that compiles (`_host.kernels.gpu_host`), so the child
registers it as the parent did (the proof's verdict is read from the cache the parent
wrote) before compiling.

Test hook: where the environment names a file in `OFFLOAD_EQX_TEST_ABORT_COMPILE` and
that file exists, the next compile removes it and aborts this process (`os.abort()`),
as an XLA `CHECK` failure would (`tests/test_fit_faults.py`).

Of JAX and jaxlib, only public modules are used here: `jax.interpreters.mlir`
(`make_ir_context`, `ir`), `jaxlib.xla_client` (`CompileOptions`, `DeviceList`).
"""

import os
import pickle
import sys
from typing import Any

import jax
from jax.experimental import topologies
from jax.interpreters import mlir
from jaxlib import xla_client

from .._host.kernels import gpu_host

ABORT_HOOK = "OFFLOAD_EQX_TEST_ABORT_COMPILE"

_topologies: dict[str, tuple] = {}


def _devices(arguments: dict[str, Any]) -> tuple:
    key = repr(sorted(arguments.items()))
    if key not in _topologies:
        _topologies[key] = tuple(topologies.get_topology_desc(**arguments).devices)
    return _topologies[key]


def _aborted_if_asked() -> None:
    path = os.environ.get(ABORT_HOOK)
    if not path:
        return
    try:
        os.unlink(path)  # removed by the one compile it aborts
    except OSError:
        return
    sys.stderr.write(
        f"F0000 00:00:00.000000 {os.getpid()} isolated_child.py:1] Check failed: "
        f"{ABORT_HOOK} asked this compile to abort\n*** Check failure stack trace: ***\n"
    )
    sys.stderr.flush()
    os.abort()


def _text(executable: Any) -> str:
    """The compiled HLO text, as `jax.stages.Compiled.as_text()` reads it."""
    if hasattr(executable, "get_hlo_text"):
        return executable.get_hlo_text()
    return "\n\n".join(module.to_string() for module in executable.hlo_modules())


def _stats(executable: Any) -> dict[str, int]:
    stats = executable.get_compiled_memory_stats()
    return {
        name: int(getattr(stats, name) or 0)
        for name in dir(stats)
        if name.endswith("_size_in_bytes")
    }


def _compile(request: dict[str, Any]) -> dict[str, Any]:
    devices = _devices(request["topology"])
    chosen = [next(d for d in devices if d.id == i) for i in request["devices"]]
    options = xla_client.CompileOptions.ParseFromString(request["options"])
    for kernel in request.get("kernels", ()):
        gpu_host.target(kernel)  # registered with the CUDA plugin's host compiler
    _aborted_if_asked()
    with mlir.make_ir_context():
        module = mlir.ir.Module.parse(request["module"])
        executable = chosen[0].client.compile(module, xla_client.DeviceList(tuple(chosen)), options)
    return {"stats": _stats(executable), "text": _text(executable)}


def main() -> None:
    # Answers go out on the original standard output; anything else written there (a
    # library's print) goes to standard error, which the parent reads as the log.
    answers = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    requests = sys.stdin.buffer
    pickle.dump({"ready": jax.__version__}, answers)
    answers.flush()
    while True:
        try:
            request = pickle.load(requests)
        except EOFError:
            return
        try:
            answer = _compile(request)
        except Exception as error:  # XLA's refusal: the parent raises it again
            answer = {"error": type(error).__name__, "message": str(error)}
        sys.stderr.flush()
        pickle.dump(answer, answers)
        answers.flush()


if __name__ == "__main__":
    main()
