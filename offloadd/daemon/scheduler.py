"""The daemon's I/O scheduling: the sessions' queues, their order, and the engine's requests.

Note: [reads before writes, fairly] Commands wait in per-session queues; the scheduler keeps at
most ``2 * io_threads`` of them in the engine and picks, round-robin over sessions, a read if any
session has one, else a write. A session that floods writes therefore delays neither another
session's reads nor, beyond its turn, its writes.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from offloadd.daemon.connection import Connection
from offloadd.daemon.session import Block, Session, SessionError
from offloadd.io.request import Engine, Op, Request
from offloadd.wire import protocol as proto

__all__ = ["Job", "Outcomes", "Scheduler"]


@dataclass(slots=True)
class Job:
    """One WRITE or READ command of a session, waiting for or in the engine."""

    conn: Connection
    session: Session
    kind: proto.Msg
    req: int
    block_id: int
    block: Block | None
    shm_offset: int
    nbytes: int
    status: int = 0
    message: str = ""
    checksum: int = 0


class Outcomes(Protocol):
    """Who answers the client once the scheduler is done with a job."""

    def refused(self, job: Job, error: SessionError) -> None:
        """The job never reached the engine (no disk slot for a write)."""

    def done(self, job: Job) -> None:
        """The engine finished the job; ``job.status`` is 0 or an errno, ``job.message`` why."""


class Scheduler:
    """Per-session queues of jobs, moved into the engine in the order of the module's Note."""

    def __init__(
        self,
        engine: Engine,
        depth: int,
        checksum: Callable[[memoryview], int] | None,
        loop: asyncio.AbstractEventLoop,
        outcomes: Outcomes,
    ) -> None:
        self.engine = engine
        self.depth = depth  # jobs in the engine at most
        self.checksum = checksum
        self.loop = loop
        self.outcomes = outcomes
        self.in_engine = 0
        self._reads: dict[int, deque[Job]] = {}  # session id -> waiting reads
        self._writes: dict[int, deque[Job]] = {}
        self._rr: deque[int] = deque()  # session ids, round-robin order

    def add(self, session_id: int) -> None:
        """Give a new session its queues and its turn."""
        self._reads[session_id] = deque()
        self._writes[session_id] = deque()
        self._rr.append(session_id)

    def cancel(self, s: Session) -> None:
        """Drop a session's waiting jobs and its turn; its jobs in the engine still complete."""
        self._reads.pop(s.id, None)
        self._writes.pop(s.id, None)
        s.queued_reads = s.queued_writes = 0
        with contextlib.suppress(ValueError):
            self._rr.remove(s.id)

    def submit(self, job: Job) -> None:
        """Queue a job behind its session's others, then fill the engine."""
        s = job.session
        if job.kind is proto.Msg.READ:
            self._reads[s.id].append(job)
            s.queued_reads += 1
        else:
            self._writes[s.id].append(job)
            s.queued_writes += 1
        self.dispatch()

    def dispatch(self) -> None:
        """Move waiting jobs into the engine, up to ``depth`` of them."""
        while self.in_engine < self.depth:
            job = self.pick()
            if job is None:
                return
            self._start(job)

    def pick(self) -> Job | None:
        """Take the next job: reads first, sessions in turn (see [reads before writes, fairly])."""
        for queues in (self._reads, self._writes):
            for _ in range(len(self._rr)):
                sid = self._rr[0]
                self._rr.rotate(-1)
                q = queues.get(sid)
                if q:
                    job = q.popleft()
                    if job.kind is proto.Msg.READ:
                        job.session.queued_reads -= 1
                    else:
                        job.session.queued_writes -= 1
                    return job
        return None

    def waiting(self) -> dict[str, int]:
        """The queue figures of ``status``."""
        return {
            "in_engine": self.in_engine,
            "reads": sum(len(q) for q in self._reads.values()),
            "writes": sum(len(q) for q in self._writes.values()),
        }

    def _start(self, job: Job) -> None:
        s = job.session
        before = None
        if job.kind is proto.Msg.WRITE:
            try:
                file, offset = s.alloc()
            except SessionError as e:
                self.outcomes.refused(job, e)
                return
            job.block = Block(file, offset, job.nbytes, 0)
            if self.checksum is not None:
                before = functools.partial(self._sum_source, job)
        assert job.block is not None
        f = s.files[job.block.file]
        req = Request(
            Op.WRITE if job.kind is proto.Msg.WRITE else Op.READ,
            f.fd,
            f.path,
            job.block.offset,
            s.address + job.shm_offset,
            job.nbytes,
            self._done,
            before=before,
            context=job,
        )
        s.inflight += 1
        self.in_engine += 1
        self.engine.submit(req)

    def _sum_source(self, job: Job) -> None:
        """On an I/O thread, before a write: the checksum of the bytes it writes."""
        assert self.checksum is not None
        job.checksum = self.checksum(job.session.view(job.shm_offset, job.nbytes))

    def _done(self, req: Request) -> None:
        """On an I/O thread: verify a read's checksum here, then hand over to the loop."""
        job: Job = req.context
        if req.error is None and job.kind is proto.Msg.READ and self.checksum is not None:
            assert job.block is not None
            got = self.checksum(job.session.view(job.shm_offset, job.nbytes))
            if got != job.block.checksum:
                job.status = errno.EBADMSG
                job.message = (
                    f"checksum mismatch in block {job.block_id} ({req.path} offset {req.offset}): "
                    "the data on disk is corrupted"
                )
        with contextlib.suppress(RuntimeError):  # a closed loop: the daemon is exiting
            self.loop.call_soon_threadsafe(self._complete, job, req)

    def _complete(self, job: Job, req: Request) -> None:
        job.session.inflight -= 1
        self.in_engine -= 1
        err = req.error
        if err is not None:
            job.status = getattr(err, "errno", None) or errno.EIO
            job.message = str(err)
        self.outcomes.done(job)
        self.dispatch()
