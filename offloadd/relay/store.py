"""Where relayed weights are kept: :class:`WeightStore`, over the runtime's :class:`Backend`.

Each group's bytes are one record of ``chunk_bytes`` places that the backend hands out (the
embedded engine's files, or the daemon's). A record is written once, from the staging pool (the
daemon reads host memory from there only), and read back many times, straight into a
page-aligned slab (Note [slabs]): each chunk is one request, and all of a record's requests are
queued at once, so the engine reads a group ahead with its whole queue depth.

The store has its own backend, apart from any :class:`~offloadd.Offloader`'s: its own engine
(or daemon session) and a small staging pool, so that relayed weights and offloaded
activations never wait on each other's slots.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from offloadd.backend import Backend, open_backend
from offloadd.config import Config
from offloadd.io.buffers import ALIGN, copy_bytes, round_up
from offloadd.io.request import Op, Request
from offloadd.relay.placeholder import RelayError
from offloadd.relay.slabs import Slabs
from offloadd.runtime.ordering import CudaOrdering, Event
from offloadd.runtime.stall_watch import StallWatch

__all__ = ["HostStore", "Record", "Transfer", "WeightStore", "open_store"]

log = logging.getLogger("offloadd")

MIB = 1 << 20


@dataclass(eq=False)
class Record:
    """One group's bytes in the store: its places, ``chunk_bytes`` each."""

    name: str
    nbytes: int
    places: list[tuple[int, int]] = field(default_factory=list)


class Transfer:
    """Reads (or writes) of one record in flight; :meth:`wait` until all are done."""

    __slots__ = ("copied", "done", "error", "hint", "nbytes", "pending", "record", "slab", "stream")

    def __init__(
        self,
        record: Record,
        slab: torch.Tensor | None,
        pending: int,
        hint: Callable[[], str] = lambda: "the host store",
    ) -> None:
        self.record = record
        self.slab = slab
        self.pending = pending
        self.hint = hint  # who does the I/O, for a long wait's warning (StallWatch)
        self.error: BaseException | None = None
        # held until the last request lands (a lock is cheaper than an Event to make and to
        # wait on: docs/benchmarks/hooks-round2_cpu-2core_2026-12-05.md); none for a transfer
        # done already (a copy made on the spot)
        self.done: threading.Lock | None = None
        if pending:
            self.done = threading.Lock()
            self.done.acquire()
        self.nbytes = record.nbytes
        self.copied: Event | None = None  # a device copy's end (Note [host relay])
        self.stream: Any = None  # the stream its device memory was taken on

    def finish(self) -> None:
        """The last request landed: wake whoever waits."""
        assert self.done is not None
        self.done.release()

    def wait(self) -> float:
        """Wait for the transfer; the seconds waited. Raises :class:`RelayError` if it failed.
        A long wait (a hung disk, a stopped daemon) is logged, and again as it doubles."""
        t0 = time.perf_counter()
        reading = self.slab is not None  # a write stages from the data
        done = self.done
        got = False
        try:
            if done is not None:
                got = done.acquire(blocking=False)
                if not got:
                    what = (
                        f"relay's {'read' if reading else 'write'} of the weights of "
                        f"{self.record.name!r}"
                    )
                    watch = StallWatch(what, self.hint)
                    while not got:
                        got = done.acquire(timeout=watch.timeout())
                        if not got:
                            watch.check()
        finally:
            if got:  # done (an interrupt in the wait, too): a later wait returns at once
                assert done is not None
                done.release()
        waited = time.perf_counter() - t0
        if self.error is not None:
            raise RelayError(
                f"offloadd relay: {'reading' if reading else 'writing'} the weights of "
                f"{self.record.name!r} failed: {self.error}"
            ) from self.error
        return waited


class WeightStore:
    """Records of relayed weights on the configured backend (ssd files or the daemon)."""

    def __init__(self, cfg: Config) -> None:
        chunk = cfg.chunk_bytes
        self.chunk_bytes = chunk
        # The daemon reads host memory from its staging pool only: writes go through two of its
        # slots. The embedded engine writes a page-aligned slab where it lies (no staging).
        self._staged = bool(cfg.daemon.socket)
        self._cfg = cfg.replace(staging_bytes=2 * chunk)
        self._backend: Backend | None = open_backend(self._cfg, None, self._warn)
        assert self._backend is not None
        self._lock = threading.Lock()
        self._slot_free = threading.Condition(self._lock)
        self.read_bytes = 0
        self.written_bytes = 0
        self.disk_bytes = 0
        self.wait_s = 0.0  # the relayer's waits for reads
        self.swaps = 0  # groups the relayer brought in for use (RelayStats.swaps)
        self._gave_up = False  # see [a write across a daemon's loss]
        self._pid = os.getpid()  # see ``_forked``

    @staticmethod
    def _warn(key: str, message: str) -> None:
        log.warning("offloadd relay: %s", message)

    def _forked(self) -> bool:
        """Whether this is a child forked from the process that opened the store: its I/O
        threads are not here, and the places its records name are the parent's to reuse."""
        return os.getpid() != self._pid

    def _hint(self) -> str:
        backend = self._backend
        return "the weight store (closed)" if backend is None else backend.stall_hint()

    @property
    def backend(self) -> Backend:
        if self._backend is None:
            raise RelayError("offloadd relay: the weight store is closed (offloadd.unrelay ran)")
        if self._forked():
            raise RelayError(
                "offloadd relay: a relayed model was used in a forked child (a multiprocessing "
                "'fork' worker, a DataLoader worker): its weight store's I/O threads and files "
                "are the parent's, whose writes may reuse the places its records name. Use the "
                "model in the parent, start workers with the 'spawn' method, or call "
                "offloadd.unrelay(model) before forking"
            )
        return self._backend

    def _chunks(self, record: Record) -> list[tuple[int, int, int]]:
        """``(file, offset, position in the record)`` of each chunk."""
        c = self.chunk_bytes
        return [(f, off, i * c) for i, (f, off) in enumerate(record.places)]

    # Note [a write across a daemon's loss]
    # ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    # A record is written at relay() and at each load_state_dict() (model_ops.rewrite), and the
    # caller holds the bytes until it returns. Where the daemon is lost before or under the
    # write, the write fails (EPIPE: the activation path keeps such bytes in memory for a step;
    # relay's records must outlive it): its places are freed, and it is made again on the next
    # daemon, looked for every quarter second for up to DAEMON_BACK_S from the first failure (a
    # supervisor's restart), said once in the log. The records of the lost session stay
    # readable (the client reads its files itself). No daemon by then: the RelayError names the
    # daemon and the wait, and the next writes (the other groups of one load) try once each,
    # without waiting again, until one succeeds.
    DAEMON_BACK_S = 30.0

    def write(self, name: str, data: torch.Tensor) -> Record:
        """Write ``data`` (a uint8 CPU tensor) as a new record; returns when it is on disk
        (after a daemon's loss, on the next one: Note [a write across a daemon's loss])."""
        first: float | None = None
        while True:
            self.begin_step()  # after a daemon's loss, the new one takes the write
            try:
                record = self._write(name, data)
            except RelayError as e:
                cause = e.__cause__
                if not (self._staged and isinstance(cause, OSError) and cause.errno == errno.EPIPE):
                    raise
                now = time.monotonic()
                if first is None:
                    first = now
                    if not self._gave_up:
                        log.warning(
                            "offloadd relay: the daemon is gone; the weights of %r are written "
                            "once one is back (waiting up to %.0f s)",
                            name,
                            self.DAEMON_BACK_S,
                        )
                if self._gave_up or now - first >= self.DAEMON_BACK_S:
                    self._gave_up = True
                    where = str(cause.filename or "?").removeprefix("daemon:")
                    raise RelayError(
                        f"offloadd relay: writing the weights of {name!r} failed: the daemon at "
                        f"{where} is gone, and none took the write in {now - first:.1f} s of "
                        f"waiting (up to {self.DAEMON_BACK_S:.0f} s; why it was not reached is "
                        "logged at INFO)"
                    ) from cause
                time.sleep(0.25)
            else:
                self._gave_up = False
                return record

    def _write(self, name: str, data: torch.Tensor) -> Record:
        """One try of :meth:`write`; a failed one frees its places."""
        backend = self.backend
        nbytes = data.numel()
        c = self.chunk_bytes
        record = Record(name, nbytes)
        for i in range(-(-nbytes // c)):
            record.places.append(backend.place(i))
        self.disk_bytes += len(record.places) * c
        t = Transfer(record, None, len(record.places), self._hint)
        base = data.data_ptr()
        if not self._staged and base % ALIGN == 0 and nbytes % ALIGN == 0:
            for file, offset, pos in self._chunks(record):
                fd, path = backend.target(file)
                n = min(c, nbytes - pos)
                req = Request(
                    Op.WRITE,
                    fd,
                    path,
                    offset,
                    base + pos,
                    n,
                    self._done,
                    keepalive=data,
                    context=t,
                )
                backend.submit(req)
            self._settle(t, record)
            self.written_bytes += nbytes
            return record
        pool = backend.staging()
        for file, offset, pos in self._chunks(record):
            with self._slot_free:
                while (slot := pool.acquire()) is None:
                    self._slot_free.wait()
            n = min(c, nbytes - pos)
            buf = pool.tensor(slot, c)
            buf[:n].copy_(data[pos : pos + n])
            if n < c:
                buf[n:].zero_()
            fd, path = backend.target(file)
            io = round_up(n)
            req = Request(
                Op.WRITE, fd, path, offset, pool.address(slot), io, self._written, context=(t, slot)
            )
            backend.submit(req)
        self._settle(t, record)
        self.written_bytes += nbytes
        return record

    def _settle(self, t: Transfer, record: Record) -> None:
        try:
            t.wait()
        except RelayError:
            self.free(record)
            raise

    def _written(self, req: Request) -> None:
        t, slot = req.context
        with self._slot_free:
            self.backend.staging().release(slot)
            self._slot_free.notify()
        self._finish(t, req)

    def read(self, record: Record, slabs: Slabs, device: torch.device | None = None) -> Transfer:
        """Start reading ``record`` into a slab taken from ``slabs``; returns at once (the
        relayer copies it to ``device``)."""
        slab, base = slabs.take_to(record.nbytes)  # base: its writable mapping (Note [write guard])
        backend = self.backend
        c = self.chunk_bytes
        chunks = self._chunks(record)
        t = Transfer(record, slab, len(chunks), self._hint)
        for file, offset, pos in chunks:
            n = min(c, slab.numel() - pos)
            fd, path = backend.target(file)
            req = Request(
                Op.READ, fd, path, offset, base + pos, n, self._done, keepalive=slab, context=t
            )
            backend.submit(req)
        return t

    def _done(self, req: Request) -> None:
        self._finish(req.context, req)

    def _finish(self, t: Transfer, req: Request) -> None:
        with self._lock:
            if req.error is not None and t.error is None:
                t.error = req.error
            t.pending -= 1
            last = t.pending == 0
            if req.op is Op.READ and req.error is None:
                self.read_bytes += req.nbytes
        if last:
            t.finish()

    def free(self, record: Record) -> None:
        backend = self._backend
        if backend is None or self._forked():  # a forked child's: the parent's places
            return
        with self._lock:
            for file, offset in record.places:
                backend.free(file, offset)
            self.disk_bytes -= len(record.places) * self.chunk_bytes
            record.places = []

    def begin_step(self) -> None:
        if self._backend is not None:
            self.backend.begin_step()  # raises in a forked child

    def close(self) -> None:
        """Finish what is in flight, then give the files back (idempotent)."""
        backend, self._backend = self._backend, None
        if backend is not None and not self._forked():  # not a forked child's (its I/O
            backend.close()  # threads are the parent's: closing would wait for them)
            backend.release()


class HostStore:
    """The cpu tier's relay, for a model on a GPU: each record is a tensor in pinned host memory.

    Note [host relay]
    ~~~~~~~~~~~~~~~~~
    A read for a model on a GPU allocates the group's device copy on the current stream and
    copies into it on the upload stream of :class:`~offloadd.runtime.ordering.CudaOrdering` (the
    rules of H2D in [device ordering]), after the work queued on the current stream so far
    (which may still use the memory that allocation reuses): the copies of the groups ahead
    then run under the computation of the groups before them. :meth:`Relay.wait_for
    <offloadd.relay.relayer.Relay.wait_for>` makes the stream that uses the copy wait for it
    (:meth:`HostStore.await_copy`).
    The copy is recorded on the side stream, so a read dropped before its copy ends (a forward
    in another order) gives its memory back only once the copy is done. A model moved to the
    CPU (``model.to("cpu")``) gets each group copied into a slab: the pinned record itself is
    never handed out, so no write through a weight reaches the store."""

    def __init__(self) -> None:
        self.read_bytes = 0
        self.written_bytes = 0
        self.disk_bytes = 0
        self.wait_s = 0.0
        self.swaps = 0
        self._ordering = CudaOrdering()  # its upload stream, as the activations' reads use

    def write(self, name: str, data: torch.Tensor) -> Record:
        record = Record(name, data.numel())
        held = torch.empty(data.numel(), dtype=torch.uint8, pin_memory=torch.cuda.is_available())
        held.copy_(data)
        record.places = [held]  # type: ignore[list-item]
        self.written_bytes += record.nbytes
        return record

    def read(self, record: Record, slabs: Slabs, device: torch.device | None = None) -> Transfer:
        """Start copying ``record`` to ``device`` (a GPU; else into a slab from ``slabs``)."""
        self.read_bytes += record.nbytes
        held: torch.Tensor = record.places[0]  # type: ignore[assignment]
        if device is None or device.type != "cuda":
            slab, to = slabs.take_to(record.nbytes)
            # both contiguous bytes on the host: a memmove costs far less than copy_ at a
            # group's size (docs/benchmarks/hooks-round2_cpu-2core_2026-12-05.md)
            copy_bytes(to, held.data_ptr(), record.nbytes)
            return Transfer(record, slab, 0)
        o = self._ordering
        current = o.producer(device)
        copy = torch.empty(held.numel(), dtype=torch.uint8, device=device)
        side = o.upload_stream(device)
        o.wait(side, o.record(current))  # queued kernels may still use the memory
        o.copy(side, copy, held)
        o.hold(copy, side)  # dropped before its copy ran: not reused until it has
        t = Transfer(record, copy, 0)
        t.copied, t.stream = o.record(side), current
        return t

    def await_copy(self, t: Transfer) -> None:
        """Make the stream current here wait for ``t``'s copy, and keep its memory for that
        stream if the copy was taken on another."""
        assert t.slab is not None and t.copied is not None
        o = self._ordering
        current = o.producer(t.slab.device)
        o.wait(current, t.copied)
        if current != t.stream:
            o.hold(t.slab, current)

    def free(self, record: Record) -> None:
        record.places = []

    def begin_step(self) -> None:
        pass

    def close(self) -> None:
        pass


def open_store(
    cfg: Config, device: torch.device | None, largest: int = 0
) -> WeightStore | HostStore:
    """The store ``cfg``'s tier names for weights on ``device``; ``largest``: the largest
    group's bytes, read in one request where ``chunk_bytes`` is smaller (up to 32 MiB): each
    request costs a completion, and on a machine whose cores all compute that is a stall."""
    on_gpu = device is not None and device.type == "cuda"
    if cfg.tier == "ssd":
        chunk = min(max(cfg.chunk_bytes, round_up(largest, MIB)), 32 * MIB)
        return WeightStore(cfg.replace(chunk_bytes=chunk) if chunk != cfg.chunk_bytes else cfg)
    if cfg.tier == "cpu" and (on_gpu or torch.cuda.is_available()):
        return HostStore()  # a CPU model too: relayed on the host, then moved to the GPU
    where = (
        "a GPU model's weights"
        if on_gpu
        else "a CPU model's weights on a machine without a GPU (already in host memory)"
    )
    raise RelayError(
        f"tier: relay keeps {where} on ssd (tier = 'ssd')"
        + (" or in pinned host memory (tier = 'cpu')" if on_gpu else "")
        + f", not {cfg.tier!r}"
    )
