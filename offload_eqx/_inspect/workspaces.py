"""Fused kernels whose workspace a compile without the hardware leaves unsized.

cuDNN sizes a kernel's workspace when XLA:GPU builds the kernel's plan on a GPU; compiled
without one (a deviceless `h100` target), each cuDNN custom call gets an empty workspace,
its result tuple ending in `u8[0]`. XLA's memory analysis, and so every memory report,
then leaves that workspace out: on the GPU the device total is larger by it. The kernels
are named here so that a report says so instead of pricing the workspace at zero.
"""

import re
from collections import Counter

# `(..., u8[0]{0}) custom-call(...), custom_call_target="__cudnn$..."`
_UNSIZED = re.compile(
    r"u8\[0\](?:\{0\})?\) custom-call\(.*?custom_call_target=\"(__cudnn\$[\w$]+)\""
)


def unsized_workspaces(hlo_text: str) -> Counter[str]:
    """How many instructions of each cuDNN custom-call target were compiled with an empty
    workspace (`u8[0]`) in this compiled module's text."""
    return Counter(match.group(1) for match in _UNSIZED.finditer(hlo_text))


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
