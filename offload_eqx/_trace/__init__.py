"""What runs while a step is traced: the one trace state (`state`), regions that
fetch host-resident leaves and apply the names' policies (`regions`: `ox.scan`,
`ox.checkpoint`, `ox.name`; `segments`: an `ox.scan` split by layers, its stacked
gradient written in place; `fetches`: `ox.fetch`; `argument_writes`: what a call in a
region writes into the containers it was given), and the modules that bring their own
region (`annotate`: `ox.annotate`; `own_regions`: classes declaring `ox.field`).

May import `_base` to `_plan`.
"""
