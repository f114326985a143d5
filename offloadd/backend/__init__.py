"""Where the runtime's chunks go: one :class:`Backend` interface, two implementations.

:class:`~offloadd.backend.embedded.EmbeddedBackend` (files and an I/O engine in the training
process, the default) and :class:`~offloadd.backend.daemon.DaemonBackend` (the node's
``offloadd serve``); :func:`open_backend` picks the one a config names (:func:`uses_daemon`).
"""

from __future__ import annotations

from collections.abc import Callable

from offloadd.backend.base import Backend
from offloadd.config import Config
from offloadd.io.request import Engine

__all__ = ["Backend", "open_backend", "uses_daemon"]


def uses_daemon(cfg: Config) -> bool:
    """Whether ``cfg`` has the daemon at ``daemon.socket`` do the I/O: tier ``ssd`` and a socket
    set (``"default"``: the default path, offloadd/wire/address.py [the default socket])."""
    return cfg.tier == "ssd" and bool(cfg.daemon.socket)


def open_backend(
    cfg: Config, io_engine: Engine | None, warn: Callable[[str, str], None]
) -> Backend | None:
    """The backend ``cfg`` names: None for tier keep, the daemon client, or embedded.

    ``io_engine`` replaces the embedded backend's engine; ``warn(key, message)`` is how the
    daemon client reports a lost daemon (once per key)."""
    if cfg.tier == "keep":
        return None
    if uses_daemon(cfg):
        if io_engine is not None:
            raise ValueError("io_engine cannot be combined with daemon.socket")
        from offloadd.backend.daemon import DaemonBackend

        return DaemonBackend(cfg, warn=warn)
    from offloadd.backend.embedded import EmbeddedBackend

    return EmbeddedBackend(cfg, io_engine)
