"""The seams grid: every pair of offloadd's features and the users' tools, each cell a small
training run with and without offloadd (docs/compose.md#the-seams-grid).

``cells``: the grid (features, tools, which pairs are cells, what each must give); ``arm``: one
training run of a cell, with offloadd (the arm under test) or without (the reference); ``worker``:
an arm in its own process (cold compile caches, ``OFFLOADD=1``, torchrun ranks).
"""
