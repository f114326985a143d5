"""How the daemon client's connections end: ``close()``, and the loss of the daemon.

Note: [daemon loss] When the connection breaks (daemon killed, restarted, stopped), requests in
flight are settled at once and the step goes on: writes fail, so the Offloader keeps those
chunks in memory (its disk-full path, with a warning); reads of chunks the daemon had written are
done here, with a local engine, from the session's files, whose descriptors the daemon passed at
open (see offloadd/daemon/session.py [per-session files]), and checked against the block's
checksum. Until the next step every write is kept in memory. At the next step (``begin_step``,
called by ``Offloader.__enter__``) the backend reconnects and offers the daemon the same shared
memory, so the staging pool stays where it is; the read slots that the lost daemon may still
write into stay out of use (see [read slots after a loss] in daemon_slots.py).

What a lost connection held is given back as soon as nothing needs it: its socket once its two
threads have ended (the receiving thread closes it, after the sender), its files at once if no
block lives in them, else when the last one is freed; then the generation is dropped. So a
client that outlives any number of daemon restarts holds what it held after its first step.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import queue
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from offloadd.backend.daemon_link import Generation, Placed
from offloadd.backend.daemon_slots import ReadSlots
from offloadd.io.buffers import AlignedBuffer, address_view
from offloadd.io.python_engine import PythonEngine
from offloadd.io.request import Op, Request, RequestState
from offloadd.wire import protocol as proto

__all__ = ["CLOSE_MARK", "CLOSE_TIMEOUT_S", "Ending"]

log = logging.getLogger("offloadd")

CLOSE_TIMEOUT_S = 5.0
"""How long ``DaemonBackend.close`` waits for the daemon (requests in flight, then the session's
close) before it treats the connection as lost."""
_TEARDOWN_TIMEOUT_S = 5.0  # then for our own threads and the local engine's reads, in all
_LAST_GRACE_S = 0.5  # what the local engine still gets if the teardown's time is spent

CLOSE_MARK: Any = Request(Op.READ, -1, "", 0, 0, 0, lambda _r: None)
"""Stands in a generation's pending table for the CLOSE message, whose answer ends it."""


class Ending:
    """``close()`` and the loss path of :class:`~offloadd.backend.daemon.DaemonBackend`, whose
    ``__init__`` sets the state declared here."""

    socket_path: str
    _lock: threading.Lock
    _idle: threading.Condition
    _ids: Any  # itertools.count
    _current: Generation | None
    _gens: list[Generation]
    _records: dict[int, Placed]
    _read_slots: ReadSlots
    _read_wait: deque[Request]
    _local: PythonEngine | None
    _closed: bool
    _closing: bool
    _outstanding: int
    _buffer: AlignedBuffer | None
    _copiers: list[threading.Thread]
    _copyq: queue.SimpleQueue[Any]
    _warn_ref: Callable[[], Callable[[str, str], None] | None]

    def _complete(self, req: Request, err: BaseException | None) -> None:
        """Settle a request: run the Offloader's callback (never with our lock held)."""
        req.error = err
        req.state = RequestState.DONE
        try:
            req.callback(req)
        except BaseException:
            log.exception("offloadd: completion callback failed")
        with self._lock:
            self._outstanding -= 1
            self._idle.notify_all()

    def close(self) -> None:
        """Wait for requests in flight, close the session, release memory and descriptors.

        Never waits forever: past ``CLOSE_TIMEOUT_S`` without the daemon settling what is in
        flight (it is stopped, wedged, or stuck on its disk), the connection is treated as lost
        (see [daemon loss]) with a warning, and the rest of the teardown is bounded as well."""
        deadline = time.monotonic() + CLOSE_TIMEOUT_S
        with self._lock:
            if self._closing:
                return
            self._closing = True
            idle = self._wait_idle(deadline)
            stuck = self._current
        until: float | None = None  # the teardown's own deadline, from the first wait on it
        if not idle:
            if stuck is not None:
                self._abandon(stuck, f"settle session {stuck.session}'s requests")
            until = time.monotonic() + _TEARDOWN_TIMEOUT_S
            with self._lock:
                if not self._wait_idle(until):
                    log.warning(
                        "offloadd: closing the session with the daemon at %s with %d request(s) "
                        "still unsettled (the local engine that reads the session's files has "
                        "not finished them)",
                        self.socket_path,
                        self._outstanding,
                    )
        with self._lock:
            self._closed = True
            gen, self._current = self._current, None
        if gen is not None:
            gen.sendq.put(proto.Command(proto.Msg.CLOSE, next(self._ids)))
            if not gen.closed_event.wait(timeout=max(0.0, deadline - time.monotonic())):
                self._abandon(gen, f"answer the close of session {gen.session}")
        if until is None:
            until = time.monotonic() + _TEARDOWN_TIMEOUT_S
        with self._lock:
            gens = list(self._gens)
        for g in gens:
            with self._lock:
                self._shutdown(g)  # wakes our threads blocked on the socket
            g.sendq.put(None)
            for t in g.threads:
                self._join(t, until)
            with self._lock:
                g.sock.close()
        for _ in self._copiers:
            self._copyq.put(None)
        for t in self._copiers:
            self._join(t, until)
        # The local engine finishes the reads from the session's files first. One stuck on its
        # disk past the deadline keeps the files open: closing them under the read would let
        # the descriptor numbers be reused while it runs.
        local_done = self._local is None or self._local.close_within(
            max(_LAST_GRACE_S, until - time.monotonic())
        )
        if local_done:
            with self._lock:
                for g in gens:
                    self._close_files(g)
        else:
            log.warning(
                "offloadd: closing the session with the daemon at %s: a read from the session's "
                "files is still stuck after %.0f s; leaving those files open",
                self.socket_path,
                _TEARDOWN_TIMEOUT_S,
            )
        self._records.clear()
        if self._buffer is not None:
            self._buffer.close()

    def _wait_idle(self, deadline: float) -> bool:
        """Wait (lock held) until no request is outstanding or ``deadline``; True if none is."""
        while self._outstanding > 0:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            self._idle.wait(timeout=left)
        return True

    def _abandon(self, gen: Generation, what: str) -> None:
        """close() gave up waiting for the daemon to ``what``: treat the connection as lost,
        say so."""
        with self._lock:
            sent = [req for req, _slot in gen.pending.values() if req is not CLOSE_MARK]
            writes = sum(1 for req in sent if req.op is Op.WRITE)
            unsent = gen.sendq.qsize() + len(self._read_wait)
        log.warning(
            "offloadd: the daemon at %s did not %s within %.0f s of close(); abandoning the "
            "connection: %d write(s) in flight fail, %d read(s) in flight are read from the "
            "session's files, %d request(s) not yet sent are settled the same way",
            self.socket_path,
            what,
            CLOSE_TIMEOUT_S,
            writes,
            len(sent) - writes,
            unsent,
        )
        err = TimeoutError(f"no answer within {CLOSE_TIMEOUT_S:.0f} s of close()")
        self._lost(gen, err, announce=False)  # shuts the socket down: our sender may be in sendall

    @staticmethod
    def _join(t: threading.Thread, until: float) -> None:
        if t is threading.current_thread():
            return
        t.join(timeout=max(0.0, until - time.monotonic()))
        if t.is_alive():
            log.warning("offloadd: thread %s did not finish; closing without it", t.name)

    def _fail_later(self, req: Request, code: int, message: str) -> None:
        """Fail ``req`` from another thread (the submitter holds the Offloader's lock)."""
        err = OSError(code, message, req.path)

        def raise_it() -> None:
            raise err

        req.state = RequestState.RUNNING
        self._local_engine().submit(
            Request(
                Op.WRITE,
                -1,
                req.path,
                0,
                0,
                0,
                lambda _r: self._complete(req, err),
                before=raise_it,
            )
        )

    def _read_locally(self, req: Request, rec: Placed) -> None:
        """Read a chunk from the session's file ourselves (lock held; see [daemon loss])."""
        gen = rec.gen
        fd = gen.file_fds[rec.file]
        path = os.path.join(gen.file_dirs[rec.file], f"<session {gen.session} file>")

        def done(local: Request) -> None:
            err = local.error
            view = address_view(req.address, req.nbytes)
            if err is None and gen.checksum is not None and gen.checksum(view) != rec.checksum:
                err = OSError(
                    errno.EBADMSG, "checksum mismatch: the data on disk is corrupted", path
                )
            self._complete(req, err)

        req.state = RequestState.RUNNING
        self._local_engine().submit(
            Request(
                Op.READ,
                fd,
                path,
                rec.offset,
                req.address,
                req.nbytes,
                done,
                keepalive=req.keepalive,
            )
        )

    def _local_engine(self) -> PythonEngine:
        if self._local is None:
            self._local = PythonEngine(2)
        return self._local

    def _lost(self, gen: Generation, err: BaseException, *, announce: bool = True) -> None:
        """The connection broke: settle everything in flight (see [daemon loss]). ``announce``:
        warn of it (False where the caller has already said why it gives up)."""
        failed: list[Request] = []
        with self._lock:
            if gen.dead:
                return
            gen.dead = True
            if self._current is gen:
                self._current = None
            entries = list(gen.pending.values())
            gen.pending.clear()
            quarantined: list[int] = []
            for req, slot in entries:
                if req is CLOSE_MARK:
                    continue
                if req.op is Op.WRITE:
                    failed.append(req)
                    continue
                quarantined.append(slot)  # the daemon may still read into it
                rec = self._records.get(req.offset)
                if rec is None:
                    failed.append(req)
                else:
                    self._read_locally(req, rec)
            while self._read_wait:
                req = self._read_wait.popleft()
                rec = self._records.get(req.offset)
                if rec is None:
                    failed.append(req)
                else:
                    self._read_locally(req, rec)
            self._read_slots.quarantine(gen.daemon, gen.session, quarantined)
            if gen.live == 0:
                self._close_files(gen)  # no block lives there: nothing will read them
            closing = self._closing
            gen.sendq.put(None)
            self._shutdown(gen)  # wakes the receiving thread, which closes the socket
        gen.closed_event.set()
        warn = self._warn_ref()
        if announce and closing:
            log.warning(
                "offloadd: lost the daemon at %s while closing session %d (%s); what was in "
                "flight is settled without it",
                self.socket_path,
                gen.session,
                err,
            )
        elif announce and warn is not None:
            warn(
                f"daemon-lost:{gen.number}",
                f"offloadd: lost the daemon at {self.socket_path} ({err}); this step goes on "
                "without it (reads from the session's files, writes kept in memory); "
                "reconnecting at the next step",
            )
        for req in failed:
            self._complete(req, OSError(errno.EPIPE, f"the daemon is gone: {err}", req.path))

    def _close_files(self, gen: Generation) -> None:
        """Close a generation's files (lock held: each number is closed once, never after it
        was reused)."""
        fds, gen.file_fds = gen.file_fds, []
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)

    @staticmethod
    def _shutdown(gen: Generation) -> None:
        """Shut a generation's socket down (lock held, as for its close: a shutdown racing the
        close could reach a descriptor number already reused)."""
        with contextlib.suppress(OSError):
            gen.sock.shutdown(socket.SHUT_RDWR)

    def _retire(self, gen: Generation) -> None:
        """A lost generation's receiving thread, at its end: wait for the sender, close the
        socket, and drop the generation once its files are closed too."""
        for t in gen.threads:
            if t is not threading.current_thread():
                t.join(timeout=_TEARDOWN_TIMEOUT_S)
                if t.is_alive():  # stuck in a write's wait for its copy: leave it to close()
                    log.warning("offloadd: thread %s did not finish; keeping its socket", t.name)
                    return
        with self._lock:
            gen.sock.close()
            gen.retired = True
            self._retired(gen)

    def _retired(self, gen: Generation) -> None:
        """Forget a lost generation whose socket and files are both closed (lock held)."""
        if gen.retired and not gen.file_fds and gen in self._gens and not self._closing:
            self._gens.remove(gen)
