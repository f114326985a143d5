"""The daemon client's threads: the sender (a request's ``before``, then its frame), the
reader (replies, matched to what is pending), and the copiers that take read chunks out of their
read slots and complete the requests. :class:`Traffic` holds them for
:class:`~offloadd.backend.daemon.DaemonBackend`, whose ``__init__`` sets the state declared in
:class:`~offloadd.backend.daemon_ending.Ending`.
"""

from __future__ import annotations

import errno
import logging
import os
from typing import Any

from offloadd.backend.daemon_ending import CLOSE_MARK, Ending
from offloadd.backend.daemon_link import Generation, Placed
from offloadd.io.buffers import copy_bytes
from offloadd.io.request import Op, RequestState, mark_engine_thread
from offloadd.trace import span
from offloadd.wire import protocol as proto

__all__ = ["Traffic"]

log = logging.getLogger("offloadd")


class Traffic(Ending):
    """The sender, reader and copier threads of the daemon client."""

    chunk_bytes: int
    staging_bytes: int

    def _send_loop(self, gen: Generation) -> None:
        mark_engine_thread()
        while True:
            item = gen.sendq.get()
            if item is None:
                return
            try:
                with span("offloadd::daemon_send"):
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

    def _prepare(self, gen: Generation, item: Any) -> bytes | None:
        """The frame for a queued item, registered as pending; None if settled otherwise."""
        if isinstance(item, proto.Command):  # FREE or CLOSE
            with self._lock:
                if gen.dead:
                    return None
                if item.kind is proto.Msg.CLOSE:
                    gen.pending[item.req] = (CLOSE_MARK, -1)
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
                self._read_slots.give_back(slot)
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

    def _recv_loop(self, gen: Generation) -> None:
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
                    with span("offloadd::daemon_reply"):
                        self._on_reply(gen, proto.decode_reply(body))
        except (OSError, proto.ProtocolError) as e:
            err = e
        if not self._closed or gen.pending:
            self._lost(gen, err or ConnectionResetError("the daemon closed the connection"))
        gen.closed_event.set()
        if gen.dead:
            self._retire(gen)

    def _on_reply(self, gen: Generation, r: proto.Reply) -> None:
        with self._lock:
            entry = gen.pending.pop(r.req, None)
        if entry is None:
            if r.status:
                log.warning(
                    "offloadd: daemon refused a request: %s", r.tail.decode(errors="replace")
                )
            return
        req, slot = entry
        if req is CLOSE_MARK:
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
                    self._records[req.offset] = Placed(gen, r.block, r.file, r.offset, r.checksum)
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
                copy_bytes(req.address, src, req.nbytes)
            self._release_read_slot(slot)
            self._complete(req, err)
            req = None

    def _release_read_slot(self, slot: int, *, locked: bool = False) -> None:
        """A read slot is free again: to the oldest waiting read, else to the free list."""
        if not locked:
            with self._lock:
                self._release_read_slot(slot, locked=True)
            return
        gen = self._current
        if self._read_wait and gen is not None:
            gen.sendq.put((self._read_wait.popleft(), slot))
        else:
            self._read_slots.give_back(slot)
