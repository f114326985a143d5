"""Optional Prometheus endpoint (``--metrics-port``): daemon-wide figures of ``offloadd status``.

prometheus-client is an optional extra (``offloadd[daemon]``), imported only when asked for.
The collector reads the status document that the daemon refreshes every second on its loop, so
the HTTP thread never touches live daemon state.

Note: [what the metrics show] The endpoint listens on 127.0.0.1 without any check of who asks,
so every local user can read it, whatever ``allowed_uids`` says. It therefore shows only
daemon-wide figures, and each session's bytes under its session number alone: no identity
(program, pid, rank), pid or uid, which STATS shows only to the daemon's uid, root and the
session's own user (offloadd/wire/trust.py [who trusts whom]). ``offloadd status`` is where
they are seen.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any, Protocol

__all__ = ["start_metrics"]


class _HasStatus(Protocol):
    status_doc: dict[str, Any]


class _Shuts(Protocol):
    def shutdown(self) -> None: ...


class _Handle:
    def __init__(self, server: _Shuts, thread: threading.Thread) -> None:
        self._server = server
        self._thread = thread

    def shutdown(self) -> None:
        self._server.shutdown()
        self._thread.join(timeout=5)


def start_metrics(status: _HasStatus, port: int) -> _Handle:
    """Serve the daemon's figures on http://127.0.0.1:``port``/metrics."""
    try:
        from prometheus_client import start_http_server
        from prometheus_client.core import CollectorRegistry, GaugeMetricFamily
    except ImportError:
        raise ValueError(
            "metrics_port needs the prometheus-client package: pip install 'offloadd[daemon]'"
        ) from None

    class Collector:
        def collect(self) -> Iterator[Any]:
            doc = status.status_doc
            for key, help_text in (
                ("bytes_held", "Disk bytes held by all sessions"),
                ("bytes_written", "Bytes written since start"),
                ("bytes_read", "Bytes read since start"),
                ("write_bytes_per_s", "Write throughput over the last 10 s"),
                ("read_bytes_per_s", "Read throughput over the last 10 s"),
                ("io_errors", "Failed reads and writes since start"),
                ("refused_requests", "Requests refused (quota, bad block) since start"),
                ("dropped_connections", "Connections dropped for protocol errors"),
                ("connections", "Open connections"),
            ):
                yield GaugeMetricFamily(f"offloadd_{key}", help_text, value=doc.get(key, 0))
            g = GaugeMetricFamily(
                "offloadd_sessions", "Open sessions", value=len(doc.get("sessions", []))
            )
            yield g
            q = GaugeMetricFamily(
                "offloadd_queue_depth", "Requests waiting or running", labels=["queue"]
            )
            for name, v in doc.get("queue", {}).items():
                q.add_metric([name], v)
            yield q
            held = GaugeMetricFamily(  # by number alone: see [what the metrics show]
                "offloadd_session_bytes_held",
                "Disk bytes held per session, by session number",
                labels=["session"],
            )
            for s in doc.get("sessions", []):
                held.add_metric([str(s["id"])], s["bytes_held"])
            yield held
            free = GaugeMetricFamily(
                "offloadd_dir_free_bytes", "Free bytes per offload directory", labels=["dir"]
            )
            age = GaugeMetricFamily(
                "offloadd_dir_probe_age_seconds",
                "Age of the free-space figures per offload directory (grows on a hung file system)",
                labels=["dir"],
            )
            for d in doc.get("dirs", []):
                if "free_bytes" in d:
                    free.add_metric([d["path"]], d["free_bytes"])
                age.add_metric([d["path"]], d.get("age_s", 0.0))
            yield free
            yield age

    registry = CollectorRegistry()
    registry.register(Collector())
    server, thread = start_http_server(port, addr="127.0.0.1", registry=registry)
    return _Handle(server, thread)
