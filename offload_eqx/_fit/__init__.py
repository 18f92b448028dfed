"""`ox.fit`: the fastest plan whose compiled memory fits. `fit` holds the algorithm,
one step after another; each step has a module: what a candidate is (`space`), every
candidate priced from a few traces (`price`), the search's state and bounds (`search`),
the order it compiles candidates in (`order`), the plans between all and nothing found by
bisection (`refine`), and the answer or why there is none (`result`).

May import every layer below it, up to `_planning`.
"""
