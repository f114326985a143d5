"""The daemon's answer to each client message, and the sessions and blocks those act on.

HELLO, STATS, STOP and CLOSE are answered at once (STATS and STOP as the client's uid may: see
offloadd/wire/trust.py [who trusts whom]); OPEN makes a session; WRITE and READ are
checked here and queued with the scheduler, which hands them back done (:meth:`Handlers.done`);
FREE gives a block's disk slot back.

Note: [a session ends after its I/O] A connection that goes (CLOSE, end of file, a drop) ends its
session: its waiting jobs are cancelled, but those already in the engine still write from its
shared memory into its files, or read back, so the memory stays mapped and the files open until
the last of them has completed; only then is the session finished (``finish_session``). A write
that completes for an ended session makes no block, and no slot is given back one by one: closing
the files frees all their space. Shutdown waits for the engine in the same way.

Note: [a freed block's slot waits for its reads] FREE forgets the block id at once (a later READ
of it is refused with ENOENT), but the disk slot goes back to its file only once no READ of the
block is left in the engine (``Block.busy``): a new write must not overwrite bytes being read.
"""

from __future__ import annotations

import errno
import itertools
import json
import logging
import os
from collections.abc import Callable
from typing import TYPE_CHECKING

from offloadd.daemon.connection import Connection, close_all
from offloadd.daemon.scheduler import Job, Scheduler
from offloadd.daemon.session import (
    Account,
    Block,
    Session,
    SessionError,
    check_memfd,
    create_memfd,
    read_only_descriptor,
)
from offloadd.io.buffers import ALIGN
from offloadd.io.files import SlotFile
from offloadd.wire import protocol as proto
from offloadd.wire.trust import administers, own_uid

if TYPE_CHECKING:
    from offloadd.config import DaemonConfig
    from offloadd.daemon.status import Status

__all__ = ["MAX_QUEUED", "Handlers"]

log = logging.getLogger("offloadd.daemon")

MAX_QUEUED = 4096  # commands one session may have waiting or in the engine; more is hostile


class Handlers:
    """Answers the messages of every connection; holds the sessions and who owns which block.

    Block ids are global, so that naming another session's block is told apart (EPERM) from
    naming none (ENOENT).

    ``status``: where the counters and recent errors go (STATS answers with its document);
    ``stop()``: how a STOP shuts the daemon down; ``drop(conn, why, error=...)``: how a
    connection is closed and its session ended. ``scheduler`` is set by the server once made
    (it answers the jobs it ran through these handlers)."""

    scheduler: Scheduler

    def __init__(
        self,
        config: DaemonConfig,
        dirs: list[str],
        status: Status,
        *,
        stop: Callable[[], None],
        drop: Callable[..., None],
    ) -> None:
        self.config = config
        self.dirs = dirs
        self.status = status
        self.stop = stop
        self.drop = drop
        self.sessions: dict[int, Session] = {}
        self.block_owner: dict[int, int] = {}  # block id -> session id
        # uid -> its sessions and their disk bytes (see session.py [sessions per user] and
        # [quota per user])
        self.accounts: dict[int, Account] = {}
        self._session_ids = itertools.count(1)
        self._block_ids = itertools.count(1)

    def handle(
        self, conn: Connection, msg: proto.Hello | proto.Open | proto.Command, fds: list[int]
    ) -> None:
        """Answer one message; a ProtocolError or SessionError raised here drops the connection."""
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
        if kind is proto.Msg.STATS:  # see trust [who trusts whom]: others see their own only
            view = self.status.document(None if administers(conn.uid) else conn.uid)
            conn.reply(proto.Reply(msg.req, tail=json.dumps(view, separators=(",", ":")).encode()))
        elif kind is proto.Msg.STOP and not administers(conn.uid):
            why = (
                f"only uid {own_uid()} (the daemon's) or root may stop the daemon; this client "
                f"runs as uid {conn.uid}"
            )
            log.warning("refused a stop by pid %d %r: %s", conn.pid, conn.identity, why)
            conn.reply(proto.Reply(msg.req, errno.EPERM, tail=why.encode()))
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
                self._command(conn, s, msg)
            except SessionError as e:
                self._refuse(conn, s, msg.req, e)

    # -- sessions --------------------------------------------------------------------------

    def _open(self, conn: Connection, msg: proto.Open, fds: list[int]) -> None:
        cfg = self.config
        if conn.session is not None:
            raise proto.ProtocolError("OPEN sent twice")
        mine = self.accounts.get(conn.uid)  # see session.py [sessions per user]
        if mine is not None and mine.sessions >= cfg.max_sessions:
            why = (
                f"too many sessions: uid {conn.uid} has {mine.sessions} open, max_sessions is "
                f"{cfg.max_sessions} per user"
            )
            conn.reply(proto.Reply(msg.req, errno.EUSERS, tail=why.encode()))
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
        theirs: list[int] = []  # the client's read-only descriptors of them
        account = mine or Account(conn.uid, cfg.quota_bytes)
        try:
            for d in self.dirs:
                files.append(SlotFile(d, chunk, cfg.direct_io))
                theirs.append(read_only_descriptor(files[-1]))  # session [per-session files]
            s = Session(
                id=sid,
                identity=conn.identity,
                pid=conn.pid,
                uid=conn.uid,
                chunk_bytes=chunk,
                shm_fd=shm_fd,
                shm_bytes=shm_bytes,
                files=files,
                account=account,
            )
            s.map()
        except (OSError, ValueError) as e:
            for f in files:
                f.close()
            close_all(theirs)
            os.close(shm_fd)
            conn.reply(proto.Reply(msg.req, errno.EIO, tail=f"cannot open a session: {e}".encode()))
            return
        conn.session = s
        self.sessions[sid] = s
        account.sessions += 1
        self.accounts[conn.uid] = account
        self.scheduler.add(sid)
        info = {
            "session": sid,
            "shm_bytes": shm_bytes,
            "read_offset": msg.staging_bytes,
            "files": [f.directory for f in files],
            "buffered": [not f.direct for f in files],
            "checksum": cfg.checksum,
            "quota_bytes": cfg.quota_bytes,  # per user: see session [quota per user]
        }
        doc = json.dumps(info).encode()
        conn.send(
            proto.encode_reply(proto.Reply(msg.req, value=sid, tail=doc)),
            [shm_fd, *theirs],
            then_close=theirs,
        )
        log.info("session %d opened by pid %d %r", sid, conn.pid, conn.identity)

    def end_session(self, s: Session) -> None:
        """The client is gone (see [a session ends after its I/O])."""
        s.closing = True
        self.scheduler.cancel(s)
        if s.inflight == 0:
            self.finish_session(s)

    def finish_session(self, s: Session) -> None:
        """Close an ended session's files and memory (nothing of it is left in the engine)."""
        if self.sessions.pop(s.id, None) is None:
            return
        for bid in s.blocks:
            self.block_owner.pop(bid, None)
        held = s.used_bytes
        s.close()
        s.account.sessions -= 1
        if s.account.sessions == 0:
            del self.accounts[s.uid]
        log.info("session %d ended; freed %d bytes", s.id, held)

    # -- commands --------------------------------------------------------------------------

    def _command(self, conn: Connection, s: Session, msg: proto.Command) -> None:
        if s.queued_reads + s.queued_writes + s.inflight >= MAX_QUEUED:
            raise SessionError(errno.EBUSY, f"more than {MAX_QUEUED} requests outstanding")
        if msg.kind is proto.Msg.WRITE:
            s.check_range(msg.shm_offset, msg.nbytes)
            job = Job(conn, s, msg.kind, msg.req, 0, None, msg.shm_offset, msg.nbytes)
        elif msg.kind is proto.Msg.READ:
            block = self._own_block(s, msg.block)
            s.check_range(msg.shm_offset, msg.nbytes)
            if msg.nbytes != block.nbytes:
                raise SessionError(
                    errno.EINVAL, f"block {msg.block} holds {block.nbytes} bytes, not {msg.nbytes}"
                )
            block.busy += 1
            job = Job(conn, s, msg.kind, msg.req, msg.block, block, msg.shm_offset, msg.nbytes)
        elif msg.kind is proto.Msg.FREE:
            block = self._own_block(s, msg.block)
            del s.blocks[msg.block]
            self.block_owner.pop(msg.block, None)
            block.freed = True
            if block.busy == 0:  # see [a freed block's slot waits for its reads]
                s.release(block.file, block.offset)
            conn.reply(proto.Reply(msg.req, block=msg.block))
            return
        else:
            raise proto.ProtocolError(f"unexpected {msg.kind.name}")
        self.scheduler.submit(job)

    def _own_block(self, s: Session, block_id: int) -> Block:
        block = s.blocks.get(block_id)
        if block is not None:
            return block
        if block_id in self.block_owner:
            raise SessionError(errno.EPERM, f"block {block_id} belongs to another session")
        raise SessionError(errno.ENOENT, f"no block {block_id} in this session")

    def _refuse(self, conn: Connection, s: Session, req: int, e: SessionError) -> None:
        s.refused += 1
        self.status.totals["refused_requests"] += 1
        conn.reply(proto.Reply(req, e.errno, tail=str(e).encode()))

    # -- the scheduler's outcomes (see scheduler.Outcomes) ---------------------------------

    def refused(self, job: Job, error: SessionError) -> None:
        self._refuse(job.conn, job.session, job.req, error)

    def done(self, job: Job) -> None:
        s = job.session
        block = job.block
        assert block is not None
        totals = self.status.totals
        if job.kind is proto.Msg.WRITE:
            if job.status != 0:
                if not s.closing:
                    s.release(block.file, block.offset)
                self._failed(job)
            elif not s.closing:  # else no block: see [a session ends after its I/O]
                bid = next(self._block_ids)
                block.checksum = job.checksum
                s.blocks[bid] = block
                self.block_owner[bid] = s.id
                s.bytes_written += job.nbytes
                totals["bytes_written"] += job.nbytes
                job.conn.reply(
                    proto.Reply(
                        job.req, 0, bid, block.file, block.offset, block.checksum, job.nbytes
                    )
                )
        else:
            block.busy -= 1  # see [a freed block's slot waits for its reads]
            if block.freed and block.busy == 0 and not s.closing:
                s.release(block.file, block.offset)
            if job.status == 0:
                s.bytes_read += job.nbytes
                totals["bytes_read"] += job.nbytes
                job.conn.reply(proto.Reply(job.req, 0, job.block_id))
            else:
                self._failed(job)
        if s.closing and s.inflight == 0:  # see [a session ends after its I/O]
            self.finish_session(s)

    def _failed(self, job: Job) -> None:
        s = job.session
        s.errors += 1
        self.status.totals["io_errors"] += 1
        what = f"session {s.id} {job.kind.name.lower()}: {job.message}"
        log.error("%s", what)
        self.status.error(what)
        job.conn.reply(proto.Reply(job.req, job.status, job.block_id, tail=job.message.encode()))
