"""The offload daemon (``offloadd serve``): one I/O service per node shared by every rank.

The service: ``core`` (:class:`~offloadd.daemon.core.Server`: listening, connections, shutdown;
``serve``), ``ops`` (the answer to each message; the sessions and their blocks), ``scheduler``
(the queues, their order, the engine's requests), ``status`` (the figures of ``offloadd status``),
``metrics`` (those figures for Prometheus), ``connection`` (one client's socket), ``session`` (one
client's memory, files and blocks), ``checksum``. Shared with the client: ``protocol`` (the wire
format). The commands: ``cmd_serve``, ``cmd_status``, ``cmd_stop``, and ``runner`` (``offloadd run
--daemon``).

Elsewhere: the settings are the ``daemon`` section of :mod:`offloadd.config`
(:class:`~offloadd.config.DaemonConfig`, ``configs/daemon.toml``); the client, on the training side, is
:class:`~offloadd.backend.daemon.DaemonBackend`.
"""

__all__: list[str] = []
