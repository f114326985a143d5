"""The offload daemon (``offloadd serve``): one I/O service per node shared by every rank.

Its settings are the ``daemon`` section of :mod:`offloadd.config` (``configs/daemon.toml``).
``protocol`` (wire format), ``server`` (the asyncio service), ``session`` (one client's memory,
files and blocks), ``client`` (the training side: :class:`~offloadd.backend.daemon.DaemonBackend`),
``commands`` (``serve``/``status``/``stop``).
"""

__all__: list[str] = []
