"""The daemon client: :class:`DaemonBackend`, the :class:`~offloadd.backend.base.Backend` whose
staging memory, places and I/O all go through ``offloadd serve``.

The runtime does what it does with the embedded backend (slots, chunks, prefetch, forwarding,
fallbacks). The staging pool lies in the session's shared memory (a memfd the daemon created), so
a write is a request naming a range of it. Places are virtual: their offsets are the runtime's
names for chunks, which the backend maps to the daemon's blocks. Requests are sent from a sender
thread (which also runs each request's ``before``, e.g. a wait for the copy that fills the slot,
as the embedded engine's I/O threads do) and completed from a reader thread; a read lands in a
read slot of the shared memory and is copied to its destination.

Note: [daemon loss] When the connection breaks (daemon killed, restarted, stopped), requests in
flight are settled at once and the step goes on: writes fail, so the Offloader keeps those
chunks in memory (its disk-full path, with a warning); reads of chunks the daemon had written are
done here, with a local engine, from the session's files, whose descriptors the daemon passed at
open (see offloadd/daemon/session.py [per-session files]), and checked against the block's
checksum. Until the next step every write is kept in memory. At the next step (``begin_step``,
called by ``Offloader.__enter__``) the backend reconnects and offers the daemon the same shared
memory, so the staging pool stays where it is. The old files are closed once their last block
is freed.
"""

from __future__ import annotations

import array
import contextlib
import ctypes
import errno
import itertools
import json
import logging
import os
import queue
import socket
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from offloadd.config import Config
from offloadd.daemon import protocol as proto
from offloadd.daemon.checksum import checksum_function
from offloadd.io.buffers import AlignedBuffer, SlotPool, address_view
from offloadd.io.python_engine import PythonEngine
from offloadd.io.request import Op, Request, RequestState, mark_engine_thread

__all__ = ["DaemonBackend", "DaemonError", "connect_control"]

log = logging.getLogger("offloadd")

_CONNECT_TIMEOUT_S = 5.0
CLOSE_TIMEOUT_S = 5.0
"""How long ``DaemonBackend.close`` waits for the daemon (requests in flight, then the session's
close) before it treats the connection as lost."""
_TEARDOWN_TIMEOUT_S = 5.0  # then for our own threads and the local engine's reads, in all
_LAST_GRACE_S = 0.5  # what the local engine still gets if the teardown's time is spent
_MAX_FDS = 16


class DaemonError(ConnectionError):
    """The daemon could not be reached or refused the session."""


def _identity() -> str:
    rank = os.environ.get("RANK")
    prog = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "python"
    ident = f"{prog} pid {os.getpid()}" + (f" rank {rank}" if rank is not None else "")
    return "".join(c for c in ident if c.isprintable())[: proto.MAX_IDENTITY // 4]


def _recv_frame(sock: socket.socket, buf: bytearray, fds: list[int] | None = None) -> bytes:
    """Block until one complete reply frame is in ``buf``; collect passed descriptors."""
    while True:
        frames = proto.split_frames(buf, proto.MAX_REPLY) if buf else []
        if frames:
            if len(frames) > 1:  # never happens in the handshake: one request, one reply
                raise proto.ProtocolError("unexpected extra reply in the handshake")
            return frames[0]
        data, anc, _flags, _ = sock.recvmsg(
            65536, socket.CMSG_SPACE(_MAX_FDS * array.array("i").itemsize)
        )
        for level, kind, raw in anc:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                a = array.array("i")
                a.frombytes(raw[: len(raw) - len(raw) % a.itemsize])
                if fds is None:
                    for fd in a:
                        os.close(fd)
                else:
                    fds.extend(a)
        if not data:
            raise DaemonError("the daemon closed the connection")
        buf += data


def connect_control(path: str, timeout: float = _CONNECT_TIMEOUT_S) -> socket.socket:
    """A connection past the handshake (for ``offloadd status`` / ``stop`` and tests)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        sock.connect(path)
        sock.sendall(proto.encode_hello(os.getpid(), _identity()))
        r = proto.decode_reply(_recv_frame(sock, bytearray()))
    except (OSError, proto.ProtocolError) as e:
        sock.close()
        raise DaemonError(f"daemon.socket: cannot reach a daemon at {path!r}: {e}") from e
    if r.status:
        sock.close()
        raise DaemonError(
            f"daemon at {path!r} refused the handshake: {r.tail.decode(errors='replace')}"
        )
    return sock


class _StagingPool(SlotPool):
    """The staging slots: the first ``nbytes`` of the shared memory."""

    def __init__(self, buffer: AlignedBuffer, nbytes: int, slot_bytes: int) -> None:
        self.slot_bytes = slot_bytes
        self.num_slots = nbytes // slot_bytes
        self.buffer = buffer
        self._free = list(range(self.num_slots - 1, -1, -1))

    def close(self) -> None:
        self.buffer.close()


@dataclass(slots=True, eq=False)
class _Generation:
    """One connection to a daemon (one session); replaced after a reconnect."""

    sock: socket.socket
    session: int
    file_fds: list[int]
    file_dirs: list[str]
    checksum: Callable[[memoryview], int] | None
    sendq: queue.SimpleQueue[Any] = field(default_factory=queue.SimpleQueue)
    pending: dict[int, tuple[Request, int]] = field(default_factory=dict)  # id -> (req, slot)
    live: int = 0  # blocks written and not freed
    dead: bool = False
    closed_event: threading.Event = field(default_factory=threading.Event)
    threads: list[threading.Thread] = field(default_factory=list)
    # This backend's count of its connections. Not the session id, which a restarted daemon
    # hands out again from 1: a warning keyed on it would be swallowed as already given.
    number: int = 0


@dataclass(slots=True)
class _Placed:
    """Where the daemon put one chunk."""

    gen: _Generation
    block: int
    file: int
    offset: int
    checksum: int


class DaemonBackend:
    """:class:`~offloadd.backend.base.Backend` whose I/O is done by ``offloadd serve``.

    A place is ``(0, voffset)``: the virtual offset names a chunk, mapped to the daemon's block
    once its write is answered; the daemon stripes over its own directories."""

    name = "daemon"

    def __init__(self, config: Config, warn: Callable[[str, str], None]) -> None:
        self.socket_path = config.daemon.socket
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
        self._records: dict[int, _Placed] = {}  # virtual offset -> placement
        self._read_free = list(range(num_read - 1, -1, -1))
        self._read_wait: deque[Request] = deque()
        self._local: PythonEngine | None = None  # reads after a daemon loss
        self._gens: list[_Generation] = []
        self._numbers = itertools.count(1)
        self._current: _Generation | None = None
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
        self._staging: SlotPool = _StagingPool(self._buffer, self.staging_bytes, config.chunk_bytes)
        self._current = gen

    # -- connection ------------------------------------------------------------------------

    def _connect(self) -> _Generation:
        sock = connect_control(self.socket_path)
        fds: list[int] = []
        try:
            attach = self._buffer is not None
            msg = proto.encode_open(
                0, self.chunk_bytes, self.staging_bytes, self.read_bytes, attach
            )
            if attach:
                assert self._buffer is not None
                anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [self._buffer.fd]))]
                sock.sendmsg([msg], anc)
            else:
                sock.sendall(msg)
            r = proto.decode_reply(_recv_frame(sock, bytearray(), fds))
            if r.status:
                raise DaemonError(
                    f"daemon at {self.socket_path!r} refused the session: "
                    f"{os.strerror(r.status)}: {r.tail.decode(errors='replace')}"
                )
            info = json.loads(r.tail)
            nfiles = len(info["files"])
            if len(fds) != 1 + nfiles or info["shm_bytes"] != self.staging_bytes + self.read_bytes:
                raise DaemonError("daemon sent a session that does not match the request")
            shm_fd = fds.pop(0)
            if attach:
                os.close(shm_fd)  # the daemon's copy of our own memfd
            else:
                self._buffer = AlignedBuffer(info["shm_bytes"], fd=shm_fd)
            self.buffered = any(info["buffered"])
        except BaseException as e:
            for fd in fds:
                os.close(fd)
            sock.close()
            if isinstance(e, OSError | proto.ProtocolError | ValueError | KeyError):
                raise DaemonError(f"daemon.socket {self.socket_path!r}: {e}") from e
            raise
        sock.settimeout(None)
        gen = _Generation(
            sock,
            info["session"],
            fds,
            list(info["files"]),
            checksum_function(info["checksum"]),
            number=next(self._numbers),
        )
        for target, name in ((self._send_loop, "send"), (self._recv_loop, "recv")):
            t = threading.Thread(
                target=target, args=(gen,), name=f"offloadd-daemon-{name}", daemon=True
            )
            gen.threads.append(t)
            t.start()
        self._gens.append(gen)
        log.info("offloadd: session %d with the daemon at %s", gen.session, self.socket_path)
        return gen

    @property
    def connected(self) -> bool:
        return self._current is not None

    def begin_step(self) -> None:
        """Called at each ``with offloader:``; reconnects after a daemon loss."""
        with self._lock:
            if self._current is not None or self._closing:
                return
        try:
            gen = self._connect()
        except DaemonError as e:
            log.info("offloadd: daemon still unreachable: %s", e)
            return
        with self._lock:
            self._current = gen
        log.warning(
            "offloadd: reconnected to the daemon at %s (session %d)", self.socket_path, gen.session
        )

    # -- the Backend -----------------------------------------------------------------------

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

    def submit(
        self,
        op: Op,
        file: int,
        offset: int,
        address: int,
        nbytes: int,
        callback: Callable[[Request], None],
        *,
        before: Callable[[], None] | None = None,
        keepalive: Any = None,
        context: Any = None,
        direct: bool = False,
    ) -> Request:
        assert not direct, "the daemon takes host memory only"
        req = Request(
            op,
            -1,
            self._path,
            offset,
            address,
            nbytes,
            callback,
            before=before,
            keepalive=keepalive,
            context=context,
        )
        self._submit(req)
        return req

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
            elif self._read_free:
                rec.gen.sendq.put((req, self._read_free.pop()))
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
        for g in self._gens:
            with contextlib.suppress(OSError):  # wakes our threads blocked on the socket
                g.sock.shutdown(socket.SHUT_RDWR)
            g.sendq.put(None)
            for t in g.threads:
                self._join(t, until)
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
            for g in self._gens:
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

    def _abandon(self, gen: _Generation, what: str) -> None:
        """close() gave up waiting for the daemon to ``what``: treat the connection as lost,
        say so."""
        with self._lock:
            sent = [req for req, _slot in gen.pending.values() if req is not _CLOSE_MARK]
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
        self._lost(gen, err, announce=False)
        with contextlib.suppress(OSError):  # our sender may be blocked in sendall
            gen.sock.shutdown(socket.SHUT_RDWR)

    @staticmethod
    def _join(t: threading.Thread, until: float) -> None:
        if t is threading.current_thread():
            return
        t.join(timeout=max(0.0, until - time.monotonic()))
        if t.is_alive():
            log.warning("offloadd: thread %s did not finish; closing without it", t.name)

    # -- threads ---------------------------------------------------------------------------

    def _send_loop(self, gen: _Generation) -> None:
        mark_engine_thread()
        while True:
            item = gen.sendq.get()
            if item is None:
                return
            try:
                data = self._prepare(gen, item)
            except BaseException as e:  # a write's before() failed (e.g. a CUDA error)
                self._complete(item, e)
                data = None
            # Not kept while waiting: a request's callback would keep its Offloader alive.
            item = None
            if data is None:
                continue
            try:
                gen.sock.sendall(data)
            except OSError as e:
                self._lost(gen, e)

    def _prepare(self, gen: _Generation, item: Any) -> bytes | None:
        """The frame for a queued item, registered as pending; None if settled otherwise."""
        if isinstance(item, proto.Command):  # FREE or CLOSE
            with self._lock:
                if gen.dead:
                    return None
                if item.kind is proto.Msg.CLOSE:
                    gen.pending[item.req] = (_CLOSE_MARK, -1)
            return proto.encode_request(item)
        rid = next(self._ids)
        if isinstance(item, tuple):  # a read and its read slot
            req, slot = item
            with self._lock:
                if not gen.dead and req.state is RequestState.PENDING:
                    req.state = RequestState.RUNNING
                    rec = self._records[req.offset]
                    gen.pending[rid] = (req, slot)
                    off = self.staging_bytes + slot * self.chunk_bytes
                    return proto.encode_request(
                        proto.Command(proto.Msg.READ, rid, rec.block, off, req.nbytes)
                    )
                self._read_free.append(slot)
                placed = self._records.get(req.offset)
                if req.state is RequestState.PENDING and placed is not None:
                    self._read_locally(req, placed)
                    return None
            if req.state is RequestState.PENDING:
                self._complete(req, OSError(errno.EPIPE, "the daemon is gone", req.path))
            return None
        req = item
        with self._lock:
            if req.state is not RequestState.PENDING:
                return None
            req.state = RequestState.RUNNING
        if req.before is not None:
            req.before()  # CUDA: the copy into staging has completed
        assert self._buffer is not None
        off = req.address - self._buffer.address
        if not 0 <= off <= self.staging_bytes - req.nbytes:
            raise OSError(errno.EINVAL, "write source outside the shared staging memory", req.path)
        with self._lock:
            if not gen.dead:
                gen.pending[rid] = (req, -1)
                return proto.encode_request(
                    proto.Command(proto.Msg.WRITE, rid, shm_offset=off, nbytes=req.nbytes)
                )
        self._complete(req, OSError(errno.EPIPE, "the daemon is gone", req.path))
        return None

    def _recv_loop(self, gen: _Generation) -> None:
        mark_engine_thread()
        buf = bytearray()
        err: BaseException | None = None
        try:
            while True:
                data = gen.sock.recv(1 << 16)
                if not data:
                    break
                buf += data
                for body in proto.split_frames(buf, proto.MAX_REPLY):
                    self._on_reply(gen, proto.decode_reply(body))
        except (OSError, proto.ProtocolError) as e:
            err = e
        if not self._closed or gen.pending:
            self._lost(gen, err or ConnectionResetError("the daemon closed the connection"))
        gen.closed_event.set()

    def _on_reply(self, gen: _Generation, r: proto.Reply) -> None:
        with self._lock:
            entry = gen.pending.pop(r.req, None)
        if entry is None:
            if r.status:
                log.warning(
                    "offloadd: daemon refused a request: %s", r.tail.decode(errors="replace")
                )
            return
        req, slot = entry
        if req is _CLOSE_MARK:
            gen.closed_event.set()
            return
        err: OSError | None = None
        if r.status:
            err = OSError(
                r.status, r.tail.decode(errors="replace") or os.strerror(r.status), req.path
            )
        if req.op is Op.WRITE:
            if err is None:
                with self._lock:
                    self._records[req.offset] = _Placed(gen, r.block, r.file, r.offset, r.checksum)
                    gen.live += 1
        else:
            self._copyq.put((req, slot, err))
            return
        self._complete(req, err)

    def _copy_loop(self) -> None:
        mark_engine_thread()
        while True:
            item = self._copyq.get()
            if item is None:
                return
            req, slot, err = item
            item = None  # see _send_loop
            if err is None:
                assert self._buffer is not None
                src = self._buffer.address + self.staging_bytes + slot * self.chunk_bytes
                ctypes.memmove(req.address, src, req.nbytes)
            self._release_read_slot(slot)
            self._complete(req, err)
            req = None  # type: ignore[assignment]

    # -- helpers ---------------------------------------------------------------------------

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

    def _release_read_slot(self, slot: int) -> None:
        with self._lock:
            gen = self._current
            if self._read_wait and gen is not None:
                gen.sendq.put((self._read_wait.popleft(), slot))
            else:
                self._read_free.append(slot)

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

    def _read_locally(self, req: Request, rec: _Placed) -> None:
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

    def _lost(self, gen: _Generation, err: BaseException, *, announce: bool = True) -> None:
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
            for req, slot in entries:
                if req is _CLOSE_MARK:
                    continue
                if req.op is Op.WRITE:
                    failed.append(req)
                    continue
                self._read_free.append(slot)
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
            closing = self._closing
            gen.sendq.put(None)
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

    def _close_files(self, gen: _Generation) -> None:
        for fd in gen.file_fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        gen.file_fds = []


_CLOSE_MARK: Any = Request(Op.READ, -1, "", 0, 0, 0, lambda _r: None)
