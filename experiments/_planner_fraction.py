"""What a fractional plan splits, in words: a name's policy by layers, and the share of
parameter and optimizer-state bytes in host memory when they are placed leaf by leaf."""

from typing import Any

import numpy as np

import offload_eqx as ox


def fraction(strategy: ox.Strategy, step: Any, args: tuple, layers: int) -> str:
    """What a plan splits: each name's policy by layers, and the share of parameter and
    optimizer-state bytes in host memory when they are placed leaf by leaf."""
    parts = [
        f"{name} {policy.first} in {policy.layers} of {layers} layers, {policy.rest} in the rest"
        for name, policy in strategy.names
        if isinstance(policy, ox.LayerSplit)
    ]
    leaves = step.plan(*args).leaves
    kinds = (("params", "param", "parameters"), ("optimizer", "optimizer", "state"))
    for attr, role, what in kinds:
        if isinstance(getattr(strategy, attr), str):
            continue
        managed = [leaf for leaf in leaves if leaf.role == role and leaf.memory is not None]
        total = sum(_nbytes(leaf) for leaf in managed) or 1
        host = [leaf for leaf in managed if leaf.memory == "pinned_host"]
        share = sum(_nbytes(leaf) for leaf in host) / total
        parts.append(f"{what} {share:.0%} on the host ({len(host)} of {len(managed)} leaves)")
    return "; ".join(parts) or "all or nothing"


def _nbytes(leaf: Any) -> int:
    return int(np.prod(leaf.shape, dtype=np.int64)) * np.dtype(leaf.dtype).itemsize
