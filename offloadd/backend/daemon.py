"""The daemon client: :class:`DaemonBackend`, the :class:`~offloadd.backend.base.Backend` whose
staging memory, places and I/O all go through ``offloadd serve``.

The runtime does what it does with the embedded backend (slots, chunks, prefetch, forwarding,
fallbacks). The staging pool lies in the session's shared memory (a memfd the daemon created), so
a write is a request naming a range of it. Places are virtual: their offsets are the runtime's
names for chunks, which the backend maps to the daemon's blocks. Requests are sent from a sender
thread (which also runs each request's ``before``, e.g. a wait for the copy that fills the slot,
as the embedded engine's I/O threads do) and completed from a reader thread; a read lands in a
read slot of the shared memory and is copied to its destination.

The threads are in ``daemon_threads.py``; what happens when the connection ends, normally or
not, is in ``daemon_ending.py``.
"""

from __future__ import annotations

import errno
import itertools
import json
import logging
import queue
import threading
import weakref
from collections import deque
from collections.abc import Callable

from offloadd.backend.daemon_link import (
    DaemonError,
    Generation,
    Placed,
    StagingPool,
    connect_control,
    open_session,
    peer_state,
    query,
    recv_frame,
)
from offloadd.backend.daemon_slots import DaemonProcess, ReadSlots
from offloadd.backend.daemon_threads import Traffic
from offloadd.config import Config
from offloadd.io.buffers import AlignedBuffer, SlotPool
from offloadd.io.python_engine import PythonEngine
from offloadd.io.request import Op, Request, RequestState
from offloadd.wire import protocol as proto
from offloadd.wire.address import socket_path
from offloadd.wire.checksum import checksum_function

__all__ = ["DaemonBackend", "DaemonError", "connect_control", "recv_frame"]

log = logging.getLogger("offloadd")


class DaemonBackend(Traffic):
    """:class:`~offloadd.backend.base.Backend` whose I/O is done by ``offloadd serve``.

    A place is ``(0, voffset)``: the virtual offset names a chunk, mapped to the daemon's block
    once its write is answered; the daemon stripes over its own directories."""

    name = "daemon"

    def __init__(self, config: Config, warn: Callable[[str, str], None]) -> None:
        self.socket_path = socket_path(config.daemon.socket)  # see [the default socket]
        self.trusted_uids = config.daemon.trusted_uids  # see [who trusts whom] in wire/trust.py
        self._path = f"daemon:{self.socket_path}"
        self.chunk_bytes = config.chunk_bytes
        slots = max(1, config.staging_bytes // config.chunk_bytes)
        self.staging_bytes = slots * config.chunk_bytes
        # Read slots: enough to keep the daemon busy while earlier chunks are being copied out.
        num_read = max(4, min(16, config.prefetch_bytes // config.chunk_bytes))
        self.read_bytes = num_read * config.chunk_bytes
        # Weakly: our threads must not keep the Offloader alive (its finalizer closes us).
        self._warn_ref: Callable[[], Callable[[str, str], None] | None] = (
            weakref.WeakMethod(warn) if hasattr(warn, "__self__") else lambda: warn
        )
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._ids = itertools.count(1)
        self._records: dict[int, Placed] = {}  # virtual offset -> placement
        self._read_slots = ReadSlots(num_read)  # see [read slots after a loss]
        self._all_quarantined_said = False
        self._read_wait: deque[Request] = deque()
        self._local: PythonEngine | None = None  # reads after a daemon loss
        self._gens: list[Generation] = []
        self._numbers = itertools.count(1)
        self._current: Generation | None = None
        self._closed = False
        self._closing = False  # close() has begun: a loss now is no news for the Offloader
        self._outstanding = 0  # requests submitted and not yet completed or cancelled
        self._buffer: AlignedBuffer | None = None
        # Copying read chunks out of their slots (and running the Offloader's callbacks) is
        # done by two threads, so that the reader thread is never behind a copy.
        self._copyq: queue.SimpleQueue[tuple[Request, int, OSError | None] | None] = (
            queue.SimpleQueue()
        )
        self._copiers = [
            threading.Thread(target=self._copy_loop, name=f"offloadd-daemon-copy-{i}", daemon=True)
            for i in range(2)
        ]
        self.buffered = False
        self._used_slots = 0
        self._free_slots: list[int] = []  # virtual slots given back, reused first
        self._end = 0
        gen = self._connect()  # raises DaemonError: like a missing ssd_dir, fail at construction
        for t in self._copiers:
            t.start()
        assert self._buffer is not None
        self._staging: SlotPool = StagingPool(self._buffer, self.staging_bytes, config.chunk_bytes)
        self._install(gen)

    # -- connection ------------------------------------------------------------------------

    def _connect(self) -> Generation:
        sock, info, fds, self._buffer = open_session(
            self.socket_path,
            self.chunk_bytes,
            self.staging_bytes,
            self.read_bytes,
            self._buffer,
            self.trusted_uids,
        )
        self.buffered = any(info["buffered"])
        sock.settimeout(None)
        gen = Generation(
            sock,
            info["session"],
            fds,
            list(info["files"]),
            checksum_function(info["checksum"]),
            number=next(self._numbers),
            daemon=DaemonProcess.of(sock),
        )
        with self._lock:  # listed before its threads run: a loss retires it from the list
            self._gens.append(gen)
        for target, name in ((self._send_loop, "send"), (self._recv_loop, "recv")):
            t = threading.Thread(
                target=target, args=(gen,), name=f"offloadd-daemon-{name}", daemon=True
            )
            gen.threads.append(t)
        for t in gen.threads:
            t.start()
        log.info("offloadd: session %d with the daemon at %s", gen.session, self.socket_path)
        return gen

    @property
    def connected(self) -> bool:
        return self._current is not None

    def begin_step(self) -> None:
        """Called at each ``with offloader:``; reconnects after a daemon loss, and ends the
        quarantines of read slots that are over (see [read slots after a loss])."""
        with self._lock:
            reconnect = self._current is None and not self._closing
        if reconnect:
            try:
                gen = self._connect()
            except DaemonError as e:
                log.info("offloadd: daemon still unreachable: %s", e)
            else:
                if self._install(gen):
                    log.warning(
                        "offloadd: reconnected to the daemon at %s (session %d)",
                        self.socket_path,
                        gen.session,
                    )
        with self._lock:
            quarantined = self._read_slots.quarantined
        if quarantined:
            self._reclaim_read_slots()

    def _install(self, gen: Generation) -> bool:
        """Make a new connection the current one, unless it was lost already (the daemon
        dropped it, or died, right after the handshake: the next step tries again)."""
        with self._lock:
            if gen.dead:
                return False
            self._current = gen
            return True

    def _reclaim_read_slots(self) -> None:
        """Give back quarantined read slots whose lost daemon has exited, or whose lost session
        the daemon we are connected to again has ended (see [read slots after a loss])."""
        with self._lock:
            gen = self._current
            owners = self._read_slots.owners()
        here = gen.daemon if gen is not None else None
        sessions: set[int] | None = None
        if here is not None and any(owner == here for owner, _session in owners):
            sessions = self._daemon_sessions()
        with self._lock:

            def done(owner: DaemonProcess | None, session: int) -> bool:
                if owner is None:
                    return False  # not identified: it may write for good
                if owner == here:
                    return sessions is not None and session not in sessions
                return owner.exited()

            for slot in self._read_slots.reclaim(done):
                self._release_read_slot(slot, locked=True)

    def _daemon_sessions(self) -> set[int] | None:
        """The numbers of this user's sessions the daemon has now (STATS), or None."""
        try:
            r = query(self.socket_path, trusted_uids=self.trusted_uids)
            return None if r.status else {int(s["id"]) for s in json.loads(r.tail)["sessions"]}
        except (DaemonError, ValueError, KeyError, TypeError):
            return None

    # -- the Backend -----------------------------------------------------------------------

    def stall_hint(self) -> str:
        gen = self._current
        if gen is None:
            return f"the daemon at {self.socket_path} (connection lost)"
        return f"the daemon at {self.socket_path} ({peer_state(gen.sock)})"

    @property
    def writes_pages(self) -> bool:
        return False  # the daemon reads host memory from the shared staging pool only

    @property
    def used_bytes(self) -> int:
        return self._used_slots * self.chunk_bytes

    def staging(self) -> SlotPool:
        return self._staging

    def place(self, hint: int) -> tuple[int, int]:
        self._used_slots += 1
        if self._free_slots:
            return 0, self._free_slots.pop() * self.chunk_bytes
        self._end += 1
        return 0, (self._end - 1) * self.chunk_bytes

    def free(self, file: int, offset: int) -> None:
        """The Offloader freed a chunk's place (its lock held): free the daemon's block."""
        self._used_slots -= 1
        self._free_slots.append(offset // self.chunk_bytes)
        self._forget(offset)

    def open_direct(self) -> bool:
        return False  # device memory goes through the shared staging memory

    def release(self) -> None:
        pass  # close() released everything; the staging pool is the Offloader's to close

    def target(self, file: int) -> tuple[int, str]:
        return -1, self._path

    def submit(self, request: Request, *, direct: bool = False) -> None:
        assert not direct, "the daemon takes host memory only"
        self._submit(request)

    def _submit(self, req: Request) -> None:
        with self._lock:
            self._outstanding += 1
            if req.op is Op.WRITE:
                gen = self._current
                if gen is None:
                    self._fail_later(req, errno.EPIPE, "the daemon is gone; keeping in memory")
                    return
                gen.sendq.put(req)
                return
            rec = self._records.get(req.offset)
            if rec is None:
                self._fail_later(req, errno.ENOENT, f"no daemon block for chunk {req.offset}")
            elif rec.gen is not self._current:
                self._read_locally(req, rec)
            elif (slot := self._read_slots.take()) is not None:
                rec.gen.sendq.put((req, slot))
            elif not self._read_slots.circulating:  # see [read slots after a loss]
                if not self._all_quarantined_said:
                    self._all_quarantined_said = True
                    log.warning(
                        "offloadd: every read slot is held back from the daemon at %s, which "
                        "may still write into it for a lost session; reading from the "
                        "session's files until that session has ended",
                        self.socket_path,
                    )
                self._read_locally(req, rec)
            else:
                self._read_wait.append(req)

    def cancel(self, req: Request) -> bool:
        with self._lock:
            if req.state is RequestState.PENDING:
                req.state = RequestState.CANCELLED
                self._outstanding -= 1
                self._idle.notify_all()
                return True
            return False

    def _forget(self, voffset: int) -> None:
        with self._lock:
            rec = self._records.pop(voffset, None)
            if rec is None:
                return
            gen = rec.gen
            gen.live -= 1
            if gen is self._current:
                gen.sendq.put(proto.Command(proto.Msg.FREE, next(self._ids), block=rec.block))
            elif gen.dead and gen.live == 0:
                self._close_files(gen)
                self._retired(gen)
