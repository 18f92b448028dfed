"""What a user declares: `ox.field` and `Placement` (where a field's arrays live),
`ox.activations` and `LayerSplit` (what to do with each named activation), `ox.Strategy`
(one argument that overrides a whole model's declarations).

May import `_base` only.
"""
