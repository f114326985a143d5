"""The offload daemon (``offloadd serve``): one I/O service per node shared by every rank.

``protocol`` (wire format), ``settings`` (DaemonConfig, ``configs/daemon.toml``), ``server`` (the
asyncio service), ``session`` (one client's memory, files and blocks), ``client`` (the training
side: :class:`~offloadd.backend.daemon.DaemonBackend`), ``commands`` (``serve``/``status``/``stop``).
"""

__all__: list[str] = []
