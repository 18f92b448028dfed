"""The user's arrays put where the plan says, and kept there across a restart:
`ox.place`, `ox.shard`, `ox.abstract` (`place`); checkpoints saved and restored into
planned memory (`checkpoints`), written privately and renamed into place
(`checkpoint_writes`), their files read leaf by leaf (`checkpoint_files`) and checked
before anything is written or read (`checkpoint_checks`).

May import `_base` to `_trace`.
"""
