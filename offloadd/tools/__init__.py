"""The tools built on offloadd (demo, plan, bench, rok, doctor, the training harness, models). The
runtime never imports them."""

__all__: list[str] = []
