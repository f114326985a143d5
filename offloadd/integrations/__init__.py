"""offloadd switched on in other people's programs: the environment, torchrun ranks, launchers."""

__all__: list[str] = []
