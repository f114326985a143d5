"""offloadd switched on in other people's programs: ``OFFLOADD=1`` (``autoload``, ``scope``,
``_bootstrap``), torchrun ranks (``ranks``), the exit report (``report``) and ``offloadd run``
(``launch``). They use the public surface of the other packages only."""

__all__: list[str] = []
