"""``offloadd serve``: the asyncio control plane around one I/O engine shared by all sessions.

Note: [never blocked by a client] The loop only does non-blocking socket calls (it reads with
``recvmsg`` when a socket is readable and writes what the socket takes, keeping the rest in a
bounded buffer), and the engine's threads never wait on a client. A client that stops reading
gets its replies buffered up to a limit and is then dropped; a client that dies is seen as end
of file. Neither delays any other session.

Note: [probes off the loop] ``status`` shows each directory's free space and file-system type.
Asking the file system (``psutil.disk_usage``, the mount table) blocks as long as the file system
does, seconds or forever on a hung NFS mount or a dying disk, so the loop never does it. Once a
second the sampler starts a probe on a daemon thread of its own, unless the previous one is still
running; the loop keeps the last result and shows its age (``age_s`` of each directory), and how
long a running probe has been at it (``dirs_probe_running_s``). A hung probe delays no session,
and does not keep the daemon from exiting.

Note: [reads before writes, fairly] Requests wait in per-session queues; the dispatcher keeps at
most ``2 * io_threads`` of them in the engine and picks, round-robin over sessions, a read if any
session has one, else a write. A session that floods writes therefore delays neither another
session's reads nor, beyond its turn, its writes.
"""

from __future__ import annotations

import array
import asyncio
import collections
import contextlib
import errno
import itertools
import json
import logging
import os
import signal
import socket
import stat
import struct
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import psutil

from offloadd.config import Config, DaemonConfig
from offloadd.daemon import protocol as proto
from offloadd.daemon.checksum import checksum_function
from offloadd.daemon.connection import MAX_FDS, Connection, close_all, fds_of
from offloadd.daemon.session import (
    Block,
    Session,
    SessionError,
    check_memfd,
    create_memfd,
)
from offloadd.io.buffers import ALIGN
from offloadd.io.files import SlotFile, default_offload_dir, filesystem_type
from offloadd.io.request import Engine, Op, Request
from offloadd.io.select import open_host_engine

__all__ = ["Server", "make_engine", "probe_dirs", "serve"]

log = logging.getLogger("offloadd.daemon")

_MAX_QUEUED = 4096  # requests one session may have waiting; more is hostile
_SAMPLE_EVERY_S = 1.0
_UCRED = struct.Struct("3i")


def make_engine(config: DaemonConfig) -> Engine:
    """The daemon's I/O engine, chosen as the embedded one is (native where it built)."""
    engine, choice = open_host_engine(Config(io_threads=config.io_threads))
    log.info("I/O engine %s (%s)", choice.name, choice.reason)
    return engine


@dataclass(slots=True)
class _Op:
    """One request of a session, waiting for or in the engine."""

    conn: Connection
    session: Session
    kind: proto.Msg
    req: int
    block_id: int
    block: Block | None
    shm_offset: int
    nbytes: int
    engine_req: Request | None = None
    status: int = 0
    message: str = ""
    checksum: int = 0


class Server:
    """The daemon: sessions, the engine, the listening socket, and the figures of ``status``."""

    def __init__(self, config: DaemonConfig) -> None:
        self.config = config
        self.socket_path = config.socket_path
        self.dirs = list(config.dirs) or [default_offload_dir()]
        for d in self.dirs:  # the same checks as the client's ssd_dirs, before binding
            SlotFile(d, ALIGN, config.direct_io).close()
        self.checksum = checksum_function(config.checksum)
        self.engine = make_engine(config)
        self.depth = 2 * config.io_threads
        self.loop: asyncio.AbstractEventLoop = asyncio.get_running_loop()
        self.conns: set[Connection] = set()
        self.sessions: dict[int, Session] = {}
        self.block_owner: dict[int, int] = {}  # block id -> session id
        self._session_ids = itertools.count(1)
        self._block_ids = itertools.count(1)
        self._reads: dict[int, deque[_Op]] = {}  # session id -> waiting reads
        self._writes: dict[int, deque[_Op]] = {}
        self._rr: deque[int] = deque()  # session ids, round-robin order
        self._in_engine = 0
        self._stopping = asyncio.Event()
        self._listener: socket.socket | None = None
        self.started = time.time()
        self.totals = collections.Counter[str]()
        self.errors: deque[str] = deque(maxlen=20)
        self._samples: deque[tuple[float, int, int]] = deque(maxlen=11)
        self.status_doc: dict[str, Any] = {}
        self._sampler: asyncio.TimerHandle | None = None
        # Free space and file-system type of the directories (see [probes off the loop]); the
        # first probe runs here, before anything is served, as the checks above do.
        self._dirs_doc = probe_dirs(self.dirs)
        self._dirs_at = time.monotonic()
        self._probe_since: float | None = None  # when the probe now running started

    # -- lifecycle -------------------------------------------------------------------------

    def listen(self) -> None:
        path = self.socket_path
        directory = os.path.dirname(path) or "."
        os.makedirs(directory, mode=0o700, exist_ok=True)
        st = os.stat(directory)
        if st.st_uid != os.getuid():
            raise ValueError(f"socket: directory {directory!r} belongs to uid {st.st_uid}")
        if stat.S_IMODE(st.st_mode) != 0o700:
            os.chmod(directory, 0o700)
        if os.path.exists(path):
            probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                probe.connect(path)
            except OSError:
                os.unlink(path)  # left by a daemon that was killed
            else:
                raise ValueError(f"socket: another daemon is serving {path!r}")
            finally:
                probe.close()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)
        try:
            sock.bind(path)
        finally:
            os.umask(old)
        os.chmod(path, 0o600)
        sock.listen(128)
        sock.setblocking(False)
        self._listener = sock
        self.loop.add_reader(sock.fileno(), self._accept)
        log.info("offloadd daemon %d serving %s, dirs %s", os.getpid(), path, ", ".join(self.dirs))

    async def run(self) -> None:
        self.listen()
        for sig in (signal.SIGTERM, signal.SIGINT):
            self.loop.add_signal_handler(sig, self.stop)
        self._sample()
        await self._stopping.wait()
        await self.shutdown()

    def stop(self) -> None:
        self._stopping.set()

    async def shutdown(self) -> None:
        log.info("offloadd daemon stopping")
        if self._sampler is not None:
            self._sampler.cancel()
        if self._listener is not None:
            self.loop.remove_reader(self._listener.fileno())
            self._listener.close()
            self._listener = None
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.socket_path)
        for conn in list(self.conns):
            self.drop(conn, "daemon stopping", error=False)
        while any(s.inflight for s in self.sessions.values()):
            await asyncio.sleep(0.01)
        await self.loop.run_in_executor(None, self.engine.close)
        for s in list(self.sessions.values()):
            self._finish_session(s)

    # -- connections -----------------------------------------------------------------------

    def _accept(self) -> None:
        assert self._listener is not None
        while True:
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                log.error("accept failed: %s", e)
                return
            pid, uid, _gid = _UCRED.unpack(
                sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
            )
            if uid != os.getuid() and uid not in self.config.allowed_uids:
                log.error("refused a connection from uid %d (pid %d): not allowed", uid, pid)
                self.totals["refused_connections"] += 1
                sock.close()
                continue
            sock.setblocking(False)
            conn = Connection(self, sock, uid, pid)
            self.conns.add(conn)
            self.loop.add_reader(sock.fileno(), self._readable, conn)

    def _readable(self, conn: Connection) -> None:
        try:
            data, anc, _flags, _ = conn.sock.recvmsg(
                65536, socket.CMSG_SPACE(MAX_FDS * array.array("i").itemsize)
            )
        except (BlockingIOError, InterruptedError):
            return
        except OSError as e:
            self.drop(conn, f"receive failed: {e}")
            return
        fds = fds_of(anc)
        if not data:
            close_all(fds)
            self.drop(conn, "client closed the connection", error=False)
            return
        conn.inbuf += data
        try:
            frames = proto.split_frames(conn.inbuf, proto.MAX_FRAME)
            if fds and not (len(frames) == 1 and frames[0][:1] == bytes([proto.Msg.OPEN])):
                raise proto.ProtocolError("descriptors sent with a message other than OPEN")
            for i, body in enumerate(frames):
                if conn.closed:
                    break
                self._handle(conn, proto.decode_request(body), fds if i == 0 else [])
                close_all(fds)  # any that OPEN did not take
        except (proto.ProtocolError, SessionError) as e:
            self.drop(conn, f"protocol error: {e}")
        finally:
            close_all(fds)

    def drop(self, conn: Connection, why: str, *, error: bool = True) -> None:
        """Close a connection; its session's blocks and files are freed (see _end_session)."""
        if conn.closed:
            return
        conn.closed = True
        who = f"pid {conn.pid} {conn.identity!r}"
        if error:
            log.error("dropping connection of %s: %s", who, why)
            self.totals["dropped_connections"] += 1
            self.errors.append(f"{time.strftime('%H:%M:%S')} {who}: {why}")
        else:
            log.info("connection of %s closed: %s", who, why)
        fd = conn.sock.fileno()
        self.loop.remove_reader(fd)
        if conn.writing:
            self.loop.remove_writer(fd)
        conn.sock.close()
        self.conns.discard(conn)
        if conn.session is not None:
            self._end_session(conn.session)

    def _handle(
        self, conn: Connection, msg: proto.Hello | proto.Open | proto.Command, fds: list[int]
    ) -> None:
        if not conn.hello:
            if not isinstance(msg, proto.Hello):
                raise proto.ProtocolError("the first message must be HELLO")
            conn.hello = True
            conn.identity = msg.identity
            if msg.version != proto.VERSION:
                conn.send(
                    proto.encode_reply(
                        proto.Reply(0, errno.EPROTONOSUPPORT, tail=b"protocol version mismatch")
                    )
                )
                raise proto.ProtocolError(
                    f"protocol version {msg.version}, this daemon speaks {proto.VERSION}"
                )
            conn.reply(proto.Reply(0, value=os.getpid()))
            return
        if isinstance(msg, proto.Hello):
            raise proto.ProtocolError("HELLO sent twice")
        if isinstance(msg, proto.Open):
            self._open(conn, msg, fds)
            return
        kind = msg.kind
        if kind is proto.Msg.STATS:
            doc = json.dumps(self.status(), separators=(",", ":")).encode()
            conn.reply(proto.Reply(msg.req, tail=doc))
        elif kind is proto.Msg.STOP:
            log.info("stop requested by pid %d %r", conn.pid, conn.identity)
            conn.reply(proto.Reply(msg.req))
            self.stop()
        elif kind is proto.Msg.CLOSE:
            conn.reply(proto.Reply(msg.req))
            self.drop(conn, "session closed", error=False)
        else:
            s = conn.session
            if s is None:
                raise proto.ProtocolError(f"{kind.name} before OPEN")
            try:
                self._request(conn, s, msg)
            except SessionError as e:
                s.refused += 1
                self.totals["refused_requests"] += 1
                conn.reply(proto.Reply(msg.req, e.errno, tail=str(e).encode()))

    # -- sessions --------------------------------------------------------------------------

    def _open(self, conn: Connection, msg: proto.Open, fds: list[int]) -> None:
        cfg = self.config
        if conn.session is not None:
            raise proto.ProtocolError("OPEN sent twice")
        if len(self.sessions) >= cfg.max_sessions:
            conn.reply(proto.Reply(msg.req, errno.EUSERS, tail=b"too many sessions"))
            return
        chunk = msg.chunk_bytes
        if not ALIGN <= chunk <= cfg.max_chunk_bytes or chunk % ALIGN:
            raise proto.ProtocolError(f"OPEN chunk_bytes {chunk} invalid")
        if msg.staging_bytes < chunk or msg.read_bytes < chunk:
            raise proto.ProtocolError("OPEN staging and read regions must hold a chunk each")
        if msg.staging_bytes % chunk or msg.read_bytes % chunk:
            raise proto.ProtocolError("OPEN regions must be whole chunks")
        shm_bytes = msg.staging_bytes + msg.read_bytes
        if shm_bytes > cfg.max_shm_bytes:
            conn.reply(
                proto.Reply(
                    msg.req,
                    errno.ENOMEM,
                    tail=f"shared memory of {shm_bytes} bytes above max_shm_bytes".encode(),
                )
            )
            return
        if msg.attach != bool(fds) or len(fds) > 1:
            raise proto.ProtocolError("OPEN attach flag does not match the descriptors sent")
        sid = next(self._session_ids)
        if fds:
            shm_fd = fds.pop()
            try:
                got = check_memfd(shm_fd, shm_bytes, shm_bytes)
            except (ValueError, OSError) as e:
                os.close(shm_fd)
                raise proto.ProtocolError(str(e)) from None
            assert got == shm_bytes
        else:
            shm_fd = create_memfd(shm_bytes, f"offloadd-session-{sid}")
        files: list[SlotFile] = []
        try:
            for d in self.dirs:
                files.append(SlotFile(d, chunk, cfg.direct_io))
            s = Session(
                id=sid,
                identity=conn.identity,
                pid=conn.pid,
                uid=conn.uid,
                chunk_bytes=chunk,
                shm_fd=shm_fd,
                shm_bytes=shm_bytes,
                files=files,
                quota_bytes=cfg.quota_bytes,
            )
            s.map()
        except (OSError, ValueError) as e:
            for f in files:
                f.close()
            os.close(shm_fd)
            conn.reply(proto.Reply(msg.req, errno.EIO, tail=f"cannot open a session: {e}".encode()))
            return
        conn.session = s
        self.sessions[sid] = s
        self._reads[sid] = deque()
        self._writes[sid] = deque()
        self._rr.append(sid)
        info = {
            "session": sid,
            "shm_bytes": shm_bytes,
            "read_offset": msg.staging_bytes,
            "files": [f.directory for f in files],
            "buffered": [not f.direct for f in files],
            "checksum": cfg.checksum,
            "quota_bytes": cfg.quota_bytes,
        }
        doc = json.dumps(info).encode()
        conn.send(
            proto.encode_reply(proto.Reply(msg.req, value=sid, tail=doc)),
            [shm_fd] + [f.fd for f in files],
        )
        log.info("session %d opened by pid %d %r", sid, conn.pid, conn.identity)

    def _end_session(self, s: Session) -> None:
        """The client is gone: cancel its queued work, free its blocks once the engine is done."""
        s.closing = True
        self._reads.pop(s.id, None)
        self._writes.pop(s.id, None)
        s.queued_reads = s.queued_writes = 0
        if s.inflight == 0:
            self._finish_session(s)

    def _finish_session(self, s: Session) -> None:
        if self.sessions.pop(s.id, None) is None:
            return
        for bid in s.blocks:
            self.block_owner.pop(bid, None)
        held = s.used_bytes
        s.close()
        with contextlib.suppress(ValueError):
            self._rr.remove(s.id)
        log.info("session %d ended; freed %d bytes", s.id, held)

    # -- requests --------------------------------------------------------------------------

    def _request(self, conn: Connection, s: Session, msg: proto.Command) -> None:
        if s.queued_reads + s.queued_writes + s.inflight >= _MAX_QUEUED:
            raise SessionError(errno.EBUSY, f"more than {_MAX_QUEUED} requests outstanding")
        if msg.kind is proto.Msg.WRITE:
            s.check_range(msg.shm_offset, msg.nbytes)
            op = _Op(conn, s, msg.kind, msg.req, 0, None, msg.shm_offset, msg.nbytes)
            self._writes[s.id].append(op)
            s.queued_writes += 1
        elif msg.kind is proto.Msg.READ:
            block = self._own_block(s, msg.block)
            s.check_range(msg.shm_offset, msg.nbytes)
            if msg.nbytes != block.nbytes:
                raise SessionError(
                    errno.EINVAL, f"block {msg.block} holds {block.nbytes} bytes, not {msg.nbytes}"
                )
            block.busy += 1
            op = _Op(conn, s, msg.kind, msg.req, msg.block, block, msg.shm_offset, msg.nbytes)
            self._reads[s.id].append(op)
            s.queued_reads += 1
        elif msg.kind is proto.Msg.FREE:
            block = self._own_block(s, msg.block)
            del s.blocks[msg.block]
            self.block_owner.pop(msg.block, None)
            block.freed = True
            if block.busy == 0:
                s.release(block.file, block.offset)
            conn.reply(proto.Reply(msg.req, block=msg.block))
            return
        else:
            raise proto.ProtocolError(f"unexpected {msg.kind.name}")
        self._dispatch()

    def _own_block(self, s: Session, block_id: int) -> Block:
        block = s.blocks.get(block_id)
        if block is not None:
            return block
        if block_id in self.block_owner:
            raise SessionError(errno.EPERM, f"block {block_id} belongs to another session")
        raise SessionError(errno.ENOENT, f"no block {block_id} in this session")

    def _dispatch(self) -> None:
        """Move queued requests into the engine, reads first, round-robin (see the Note)."""
        while self._in_engine < self.depth:
            op = self._next_op()
            if op is None:
                return
            self._start(op)

    def _next_op(self) -> _Op | None:
        for queues in (self._reads, self._writes):
            for _ in range(len(self._rr)):
                sid = self._rr[0]
                self._rr.rotate(-1)
                q = queues.get(sid)
                if q:
                    op = q.popleft()
                    if op.kind is proto.Msg.READ:
                        op.session.queued_reads -= 1
                    else:
                        op.session.queued_writes -= 1
                    return op
        return None

    def _start(self, op: _Op) -> None:
        s = op.session
        addr = s.address + op.shm_offset
        if op.kind is proto.Msg.WRITE:
            try:
                file, offset = s.alloc()
            except SessionError as e:
                s.refused += 1
                self.totals["refused_requests"] += 1
                op.conn.reply(proto.Reply(op.req, e.errno, tail=str(e).encode()))
                return
            op.block = Block(file, offset, op.nbytes, 0)
            f = s.files[file]
            checksum = self.checksum
            if checksum is not None:

                def before(op: _Op = op, fn: Any = checksum) -> None:
                    op.checksum = fn(op.session.view(op.shm_offset, op.nbytes))

            else:
                before = None  # type: ignore[assignment]
            req = Request(
                Op.WRITE,
                f.fd,
                f.path,
                offset,
                addr,
                op.nbytes,
                self._done_cb,
                before=before,
                context=op,
            )
        else:
            assert op.block is not None
            f = s.files[op.block.file]
            req = Request(
                Op.READ, f.fd, f.path, op.block.offset, addr, op.nbytes, self._done_cb, context=op
            )
        op.engine_req = req
        s.inflight += 1
        self._in_engine += 1
        self.engine.submit(req)

    def _done_cb(self, req: Request) -> None:
        """On an I/O thread: verify a read's checksum here, then hand over to the loop."""
        op: _Op = req.context
        if req.error is None and op.kind is proto.Msg.READ and self.checksum is not None:
            assert op.block is not None
            got = self.checksum(op.session.view(op.shm_offset, op.nbytes))
            if got != op.block.checksum:
                op.status = errno.EBADMSG
                op.message = (
                    f"checksum mismatch in block {op.block_id} ({req.path} offset {req.offset}): "
                    "the data on disk is corrupted"
                )
        with contextlib.suppress(RuntimeError):  # a closed loop: the daemon is exiting
            self.loop.call_soon_threadsafe(self._complete, op, req)

    def _complete(self, op: _Op, req: Request) -> None:
        s = op.session
        s.inflight -= 1
        self._in_engine -= 1
        block = op.block
        assert block is not None
        err = req.error
        if err is not None:
            op.status = getattr(err, "errno", None) or errno.EIO
            op.message = str(err)
        if op.kind is proto.Msg.WRITE:
            if op.status == 0 and not s.closing:
                bid = next(self._block_ids)
                block.checksum = op.checksum
                s.blocks[bid] = block
                self.block_owner[bid] = s.id
                s.bytes_written += op.nbytes
                self.totals["bytes_written"] += op.nbytes
                op.conn.reply(
                    proto.Reply(op.req, 0, bid, block.file, block.offset, block.checksum, op.nbytes)
                )
            else:
                if not s.closing:
                    s.release(block.file, block.offset)
                self._failed(op)
        else:
            block.busy -= 1
            if block.freed and block.busy == 0 and not s.closing:
                s.release(block.file, block.offset)
            if op.status == 0:
                s.bytes_read += op.nbytes
                self.totals["bytes_read"] += op.nbytes
                op.conn.reply(proto.Reply(op.req, 0, op.block_id))
            else:
                self._failed(op)
        if s.closing and s.inflight == 0:
            self._finish_session(s)
        self._dispatch()

    def _failed(self, op: _Op) -> None:
        s = op.session
        s.errors += 1
        self.totals["io_errors"] += 1
        what = f"session {s.id} {op.kind.name.lower()}: {op.message}"
        log.error("%s", what)
        self.errors.append(f"{time.strftime('%H:%M:%S')} {what}")
        op.conn.reply(proto.Reply(op.req, op.status, op.block_id, tail=op.message.encode()))

    # -- status ----------------------------------------------------------------------------

    def _sample(self) -> None:
        now = time.monotonic()
        self._samples.append((now, self.totals["bytes_written"], self.totals["bytes_read"]))
        if self._probe_since is None:
            self._start_probe()
        self.status_doc = self.status()
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

    def status(self) -> dict[str, Any]:
        """Everything ``offloadd status --json`` shows (and the metrics endpoint exports)."""
        write_bps = read_bps = 0.0
        if len(self._samples) >= 2:
            (t0, w0, r0), (t1, w1, r1) = self._samples[0], self._samples[-1]
            if t1 > t0:
                write_bps, read_bps = (w1 - w0) / (t1 - t0), (r1 - r0) / (t1 - t0)
        now = time.monotonic()
        age = round(now - self._dirs_at, 3)
        dirs = [dict(d, age_s=age) for d in self._dirs_doc]
        since = self._probe_since
        sessions = [
            {
                "id": s.id,
                "identity": s.identity,
                "pid": s.pid,
                "uid": s.uid,
                "bytes_held": s.used_bytes,
                "blocks": len(s.blocks),
                "quota_bytes": s.quota_bytes,
                "shm_bytes": s.shm_bytes,
                "bytes_written": s.bytes_written,
                "bytes_read": s.bytes_read,
                "queued_reads": s.queued_reads,
                "queued_writes": s.queued_writes,
                "in_engine": s.inflight,
                "errors": s.errors,
                "refused": s.refused,
            }
            for s in self.sessions.values()
        ]
        return {
            "pid": os.getpid(),
            "protocol": proto.VERSION,
            "socket": self.socket_path,
            "uptime_s": round(time.time() - self.started, 3),
            "engine": getattr(self.engine, "name", type(self.engine).__name__),
            "checksum": self.config.checksum,
            "connections": len(self.conns),
            "sessions": sessions,
            "bytes_held": sum(s.used_bytes for s in self.sessions.values()),
            "bytes_written": self.totals["bytes_written"],
            "bytes_read": self.totals["bytes_read"],
            "write_bytes_per_s": round(write_bps),
            "read_bytes_per_s": round(read_bps),
            "queue": {
                "in_engine": self._in_engine,
                "reads": sum(len(q) for q in self._reads.values()),
                "writes": sum(len(q) for q in self._writes.values()),
            },
            "dirs": dirs,
            "dirs_probe_running_s": None if since is None else round(now - since, 3),
            "io_errors": self.totals["io_errors"],
            "refused_requests": self.totals["refused_requests"],
            "dropped_connections": self.totals["dropped_connections"],
            "refused_connections": self.totals["refused_connections"],
            "recent_errors": list(self.errors),
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


def _loop_factory() -> Any:
    try:
        import uvloop
    except ImportError:
        log.warning(
            "uvloop is not installed; using asyncio's default event loop (uvloop is a "
            "dependency of offloadd: pip install uvloop)"
        )
        return asyncio.new_event_loop
    log.info("event loop: uvloop %s", uvloop.__version__)
    return uvloop.new_event_loop


def serve(config: DaemonConfig) -> int:
    """Run the daemon in the foreground until SIGTERM/SIGINT or ``offloadd stop``."""

    async def main() -> None:
        server = Server(config)
        metrics = None
        if config.metrics_port:
            from offloadd.daemon.metrics import start_metrics

            metrics = start_metrics(server, config.metrics_port)
        try:
            await server.run()
        finally:
            if metrics is not None:
                metrics.shutdown()

    with asyncio.Runner(loop_factory=_loop_factory()) as runner:
        runner.run(main())
    log.info("offloadd daemon stopped")
    return 0
