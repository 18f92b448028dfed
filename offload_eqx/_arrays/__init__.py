"""The user's arrays put where the plan says, and kept there across a restart:
`ox.place`, `ox.shard`, `ox.abstract` (`place`); checkpoints saved and restored into
planned memory (`checkpoints`), checked before anything is written or read
(`checkpoint_checks`), written privately and renamed into place (`checkpoint_writes`) by
a writer thread that every failure and interrupt waits for (`checkpoint_writers`), read
back against the stored shapes without reopening every array (`checkpoint_reads`) and
verified against the checksums written beside them (`checkpoint_checksums`); Equinox
files read leaf by leaf (`checkpoint_files`).

May import `_base` to `_trace`.
"""
