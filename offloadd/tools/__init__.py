"""The tools built on offloadd (demo, train, bench, rok, models). The runtime never imports them."""

__all__: list[str] = []
