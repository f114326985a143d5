"""``offloadd wall``: the largest batch (or sequence) each strategy trains inside a hard memory
limit (command.py; the search: search.py; one point: points.py)."""

__all__: list[str] = []
