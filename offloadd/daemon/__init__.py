"""The offload daemon (``offloadd serve``): one I/O service per node shared by every rank.

The service: ``core`` (:class:`~offloadd.daemon.core.Server`: listening, connections, shutdown;
``serve``), ``handlers`` (the answer to each message; the sessions and their blocks),
``scheduler`` (the queues, their order, the engine's requests), ``status`` (the figures of
``offloadd status``), ``metrics`` (those figures for Prometheus), ``connection`` (one client's
socket), ``session`` (one client's memory, files and blocks), and the command ``cmd_serve``. The
wire format, the checksums and the trust rules it shares with its clients are
:mod:`offloadd.wire`; it imports nothing of the client's side.

Elsewhere: the settings are the ``daemon`` section of :mod:`offloadd.config`
(:class:`~offloadd.config.DaemonConfig`, ``configs/daemon.toml``); the client, on the training
side, is :class:`~offloadd.backend.daemon.DaemonBackend`, with the ``offloadd status`` and
``offloadd stop`` commands beside it (``backend/cmd_status.py``, ``backend/cmd_stop.py``);
``offloadd run --daemon`` starts one for a command (:mod:`offloadd.integrations.run_daemon`).
"""

__all__: list[str] = []
