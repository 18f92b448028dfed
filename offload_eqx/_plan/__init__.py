"""The plan: where every leaf of a step's arguments lives and what each activation
name does, under a strategy. One module (`plan`) owns every placement rule: memory,
sharding, optimizer state by the parameter it mirrors, donation, outputs against
arguments, the names' remat policy (`remat_policy`). `walk` reads annotations off a
pytree, `leaf` places one leaf, `printing` draws the plan as a table; `of_trees` makes
the plans of whole pytrees (`ox.plan`, an optimizer state's).

May import `_base`, `_declare`, `_sharding`.
"""
