"""The user's arrays put where the plan says: `ox.place`, `ox.shard`, `ox.abstract`
(`place`). Checkpoints, which restore into these places, are the layer below
(`_checkpoints`).

May import `_base` to `_trace`.
"""
