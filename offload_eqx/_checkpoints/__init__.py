"""Checkpoints: the user's state saved and restored straight into its planned memory.

The data flow of a save: what can be saved and where, checked before anything is written
(`checks`); a private temporary directory, renamed into place once complete
(`private_directory`), written by threads that every failure and interrupt waits for
(`writers`), with each array's checksum beside Orbax's files (`checksums`). Of a restore:
the stored tree read back against `like` without reopening every array, then Orbax's
restore (`reads`), verified against the checksums. `checkpoints` holds the public
`ox.save_checkpoint` and `ox.restore_checkpoint`; `equinox_files` reads an
`eqx.tree_serialise_leaves` file leaf by leaf (`ox.tree_deserialise_leaves`).

May import `_base` to `_arrays` (each restore asks `_arrays.place` where a leaf goes).
"""
