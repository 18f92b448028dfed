"""`ox.fit`: the fastest plan whose compiled memory fits. `fit` holds the algorithm,
one step after another; the steps' parts each have a module: the candidates (`space`),
the state of one search with its traces and compiles (`search`), the plans between all
and nothing found by bisection (`refine`), and the answer (`result`).

May import every layer below it, up to `_planning`.
"""
