"""How fast a plan runs and how large a batch fits: the work of a traced step per
phase (`flops`), the predicted step time (`estimate`: `ox.estimate`), and the largest batch
that fits (`max_batch`: `ox.max_batch`).

May import every layer below it, up to `_inspect`.
"""
