"""Fused kernels whose workspace a compile without the hardware leaves unsized.

cuDNN sizes a kernel's workspace when XLA:GPU builds the kernel's plan on a GPU; compiled
without one (a deviceless `h100` target), each cuDNN custom call gets an empty workspace,
its result tuple ending in `u8[0]`. XLA's memory analysis, and so every memory report,
then leaves that workspace out: on the GPU the device total is larger by it. The kernels
are named here so that a report says so instead of pricing the workspace at zero.
"""

import re
from collections import Counter

# `(..., u8[N]{0}) custom-call(...), custom_call_target="__cudnn$..."`: a cuDNN kernel's
# results end with its workspace.
_WORKSPACE = re.compile(
    r"u8\[(\d+)\](?:\{0\})?\) custom-call\(.*?custom_call_target=\"(__cudnn\$[\w$]+)\""
)


def cudnn_workspaces(hlo_text: str) -> list[tuple[str, int]]:
    """(custom-call target, workspace bytes) of each cuDNN kernel in a compiled text."""
    return [(name, int(size)) for size, name in _WORKSPACE.findall(hlo_text)]


def unsized_workspaces(hlo_text: str) -> Counter[str]:
    """How many instructions of each cuDNN custom-call target were compiled with an empty
    workspace (`u8[0]`) in this compiled module's text."""
    return Counter(name for name, size in cudnn_workspaces(hlo_text) if size == 0)


def workspace_note(kernels: Counter[str]) -> str | None:
    """One sentence naming the kernels whose workspace the report leaves out, or None."""
    if not kernels:
        return None
    named = ", ".join(f"{name} x{count}" for name, count in sorted(kernels.items()))
    return (
        f"{sum(kernels.values())} cuDNN kernels ({named}) were compiled without a GPU, so "
        "their workspace is unsized (u8[0]) and not counted: on the GPU cuDNN sizes it when "
        "compiling, and the device total grows by it."
    )
