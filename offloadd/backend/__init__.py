"""Where the runtime's chunks go: one :class:`Backend` interface, two implementations.

:class:`~offloadd.backend.embedded.EmbeddedBackend` (files and an I/O engine in the training
process, the default) and :class:`~offloadd.backend.daemon.DaemonBackend` (the node's
``offloadd serve``); :func:`open_backend` picks the one a config names (:func:`uses_daemon`).
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable

from offloadd.backend.base import Backend
from offloadd.config import Config
from offloadd.io.request import Engine
from offloadd.wire.address import no_daemon, socket_path

__all__ = ["Backend", "daemon_missing", "open_backend", "uses_daemon"]


def uses_daemon(cfg: Config) -> bool:
    """Whether ``cfg`` has the daemon at ``daemon.socket`` do the I/O: tier ``ssd`` and a socket
    set (``"default"``: the default path, offloadd/wire/address.py [the default socket])."""
    return cfg.tier == "ssd" and bool(cfg.daemon.socket)


def daemon_missing(cfg: Config) -> str | None:
    """Why no daemon can be listening where ``cfg`` looks for one, in one line, or None (also
    when ``cfg`` uses no daemon). A look at the path alone, no connection: cheap enough for the
    environment's checks at start-up; the Offloader's construction connects, and checks whom."""
    if not uses_daemon(cfg):
        return None
    path = socket_path(cfg.daemon.socket)
    try:
        st = os.stat(path)
    except OSError as e:
        return no_daemon(path, e.strerror or str(e))
    if not stat.S_ISSOCK(st.st_mode):
        return no_daemon(path, "not a socket")
    return None


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
