"""The daemon's figures: what ``offloadd status --json`` shows and the metrics endpoint exports.

Note: [probes off the loop] ``status`` shows each directory's free space and file-system type.
Asking the file system (``psutil.disk_usage``, the mount table) blocks as long as the file system
does, seconds or forever on a hung NFS mount or a dying disk, so the loop never does it. Once a
second the sampler starts a probe on a daemon thread of its own, unless the previous one is still
running; the loop keeps the last result and shows its age (``age_s`` of each directory), and how
long a running probe has been at it (``dirs_probe_running_s``). A hung probe delays no session,
and does not keep the daemon from exiting.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import psutil

from offloadd.io.files import filesystem_type
from offloadd.wire import protocol as proto

if TYPE_CHECKING:
    from offloadd.daemon.session import Session

__all__ = ["Status", "probe_dirs"]

_SAMPLE_EVERY_S = 1.0


class Status:
    """The counters since start, the recent errors, throughput and the directories' figures.

    Everything here is touched on the loop only, but for the probe's thread, which hands its
    result back through the loop.

    What it reports of the rest of the daemon comes in at construction: the fixed facts (the
    socket, the checksum) and callables for what changes (the engine's name, the sessions, the
    number of connections, the scheduler's waiting jobs)."""

    def __init__(
        self,
        dirs: list[str],
        loop: asyncio.AbstractEventLoop,
        *,
        socket_path: str,
        engine: Callable[[], str],
        checksum: str,
        sessions: Callable[[], Iterable[Session]],
        connections: Callable[[], int],
        queue: Callable[[], dict[str, int]],
    ) -> None:
        self.dirs = dirs
        self.loop = loop
        self.socket_path = socket_path
        self._engine = engine
        self.checksum = checksum
        self._sessions = sessions
        self._connections = connections
        self._queue = queue
        self.started = time.time()
        self.totals = collections.Counter[str]()
        self.errors: deque[str] = deque(maxlen=20)
        self.status_doc: dict[str, Any] = {}  # the last sample's document, for the metrics thread
        self._samples: deque[tuple[float, int, int]] = deque(maxlen=11)
        self._sampler: asyncio.TimerHandle | None = None
        # The first probe runs here, before anything is served, as the directory checks do.
        self._dirs_doc = probe_dirs(dirs)
        self._dirs_at = time.monotonic()
        self._probe_since: float | None = None  # when the probe now running started

    def error(self, text: str) -> None:
        """Keep ``text``, with the time of day, among the recent errors that ``status`` lists."""
        self.errors.append(f"{time.strftime('%H:%M:%S')} {text}")

    def start(self) -> None:
        """Take the first sample; one follows every second until :meth:`stop`. The first one
        starts no probe: ``__init__`` has just probed the directories."""
        self._sample(probe=False)

    def stop(self) -> None:
        if self._sampler is not None:
            self._sampler.cancel()
            self._sampler = None

    def _sample(self, probe: bool = True) -> None:
        now = time.monotonic()
        self._samples.append((now, self.totals["bytes_written"], self.totals["bytes_read"]))
        if probe and self._probe_since is None:
            self._start_probe()
        self.status_doc = self.document()
        self._sampler = self.loop.call_later(_SAMPLE_EVERY_S, self._sample)

    def _start_probe(self) -> None:
        """Probe the directories on a thread of its own (see [probes off the loop])."""
        self._probe_since = time.monotonic()
        dirs, loop = list(self.dirs), self.loop

        def run() -> None:
            try:
                doc = probe_dirs(dirs)
            except BaseException as e:  # never leave the probe marked as running
                doc = [{"path": d, "error": f"probe failed: {e!r}"} for d in dirs]
            with contextlib.suppress(RuntimeError):  # a closed loop: the daemon is exiting
                loop.call_soon_threadsafe(self._probed, doc)

        threading.Thread(target=run, name="offloadd-probe", daemon=True).start()

    def _probed(self, doc: list[dict[str, Any]]) -> None:
        self._dirs_doc = doc
        self._dirs_at = time.monotonic()
        self._probe_since = None

    def document(self, only_uid: int | None = None) -> dict[str, Any]:
        """Everything ``offloadd status --json`` shows (and the metrics endpoint exports).

        ``only_uid``: the view of a client that does not administer the daemon (see
        offloadd/wire/trust.py [who trusts whom]): the sessions and the bytes they hold are
        that uid's alone, and the recent errors, which name other clients' pids and
        identities, are left out; the daemon-wide figures stay."""
        write_bps = read_bps = 0.0
        if len(self._samples) >= 2:
            (t0, w0, r0), (t1, w1, r1) = self._samples[0], self._samples[-1]
            if t1 > t0:
                write_bps, read_bps = (w1 - w0) / (t1 - t0), (r1 - r0) / (t1 - t0)
        now = time.monotonic()
        age = round(now - self._dirs_at, 3)
        since = self._probe_since
        sessions = [s for s in self._sessions() if only_uid is None or s.uid == only_uid]
        return {
            "pid": os.getpid(),
            "protocol": proto.VERSION,
            "socket": self.socket_path,
            "uptime_s": round(time.time() - self.started, 3),
            "engine": self._engine(),
            "checksum": self.checksum,
            "connections": self._connections(),
            "sessions": [
                {
                    "id": s.id,
                    "identity": s.identity,
                    "pid": s.pid,
                    "uid": s.uid,
                    "bytes_held": s.used_bytes,
                    "blocks": len(s.blocks),
                    "quota_bytes": s.account.quota_bytes,  # per user
                    "user_bytes_held": s.account.used_bytes,  # by all sessions of its uid
                    "shm_bytes": s.shm_bytes,
                    "bytes_written": s.bytes_written,
                    "bytes_read": s.bytes_read,
                    "queued_reads": s.queued_reads,
                    "queued_writes": s.queued_writes,
                    "in_engine": s.inflight,
                    "errors": s.errors,
                    "refused": s.refused,
                }
                for s in sessions
            ],
            "bytes_held": sum(s.used_bytes for s in sessions),
            "bytes_written": self.totals["bytes_written"],
            "bytes_read": self.totals["bytes_read"],
            "write_bytes_per_s": round(write_bps),
            "read_bytes_per_s": round(read_bps),
            "queue": self._queue(),
            "dirs": [dict(d, age_s=age) for d in self._dirs_doc],
            "dirs_probe_running_s": None if since is None else round(now - since, 3),
            "io_errors": self.totals["io_errors"],
            "refused_requests": self.totals["refused_requests"],
            "dropped_connections": self.totals["dropped_connections"],
            "refused_connections": self.totals["refused_connections"],
            "recent_errors": list(self.errors) if only_uid is None else [],
            "only_uid": only_uid,
        }


def probe_dirs(dirs: list[str]) -> list[dict[str, Any]]:
    """Free space and file-system type of each directory, for ``status``. Blocks as long as the
    file system does (a hung NFS mount, a dying disk): never call it on the event loop."""
    out: list[dict[str, Any]] = []
    for d in dirs:
        try:
            u = psutil.disk_usage(d)
            out.append(
                {"path": d, "free_bytes": u.free, "total_bytes": u.total, "fs": filesystem_type(d)}
            )
        except OSError as e:
            out.append({"path": d, "error": str(e)})
    return out
