"""The write path: a captured block's bytes copied into slots, then written to the backend.

Tiers. ``ssd``: CPU tensors are written from their own pages (see [zero-copy] in
writer_in_place.py) where the backend allows it; other chunks are copied into the backend's
staging pool and written out, a slot being free again once its write completed. ``cpu``: chunks are copied into a pinned host pool of
``host_budget_bytes`` and stay there; when it is full the oldest chunks are written out (spilled)
to make room. ``keep`` never gets here. CUDA tensors go through the same slots after an
asynchronous copy ordered by :mod:`~offloadd.runtime.ordering`, or, with GDS, are written from
device memory directly.

Note: [a slot being filled] ``write_out`` takes a chunk's slot under the lock, then copies into
it (or, on an async device, enqueues the copy and gets the event its write must wait on) without
the lock. Until it has the lock again, that slot holds stale bytes and ``chunk.ready`` is not set;
the chunk is marked ``filling`` for exactly that span. Another thread forwarding through the
same Offloader (``nn.DataParallel``'s replicas) may meanwhile need a slot: the cpu tier's spill
then writes out host-held chunks, and it skips filling ones, whose write would send the stale
bytes to disk and whose completion would free the slot under the late copy. A thread that finds
no slot and nothing to spill waits while any chunk is being filled, since each will become
spillable (cpu tier) or be written (ssd). The filling thread itself holds none while it waits:
it marks a chunk only after its slot was acquired and clears it before acquiring the next. If
the copy fails, the capture's handler gives the block's chunks back (``release_chunks``), which
clears the mark.

Note: [never fail the step] A write that fails (disk full, the daemon gone) keeps that chunk's
bytes in memory, with one warning; a slot that cannot be had because nothing could ever free one
keeps the chunk in memory too. The step goes on with the same result.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from offloadd.config import Config
from offloadd.io.buffers import ALIGN, SlotPool
from offloadd.io.pools import Pool
from offloadd.io.request import Op, Request
from offloadd.runtime.accounting import Ledger
from offloadd.runtime.blocks import Block, BlockMap, Chunk
from offloadd.runtime.identity import storage_bytes
from offloadd.runtime.ordering import Ordering, StagedCopy
from offloadd.runtime.stall_watch import StallWatch
from offloadd.runtime.writer_in_place import InPlace
from offloadd.trace import span

if TYPE_CHECKING:
    from offloadd.backend.base import Backend

__all__ = ["Writer"]


class Writer:
    """Slots, copies and writes (every method but :meth:`write_out` runs with the lock held)."""

    def __init__(
        self,
        config: Config,
        ledger: Ledger,
        blocks: BlockMap,
        backend: Backend | None,
        ordering: Ordering,
    ) -> None:
        self.config = config
        self.ledger = ledger
        self.blocks = blocks
        self.backend = backend
        self.ordering = ordering
        self.host_tier = config.tier == "cpu"
        self.pool: SlotPool | None = None  # the host pool (cpu tier) or staging (ssd tier)
        self.pools: list[Pool] = []  # freed at shutdown, after the copy streams drained
        self.in_flight = 0  # writes submitted and not completed
        self.pending_copies: deque[StagedCopy] = deque()  # copies whose source is still held
        self.awaiting_copy: list[Block] = []  # freed blocks whose slots a copy still fills
        self.filling = 0  # chunks whose copy into their slot is not enqueued yet
        self.in_place: InPlace | None = None  # zero-copy writes of CPU tensors
        if not self.host_tier and backend is not None and backend.writes_pages:
            self.in_place = InPlace(
                config,
                ledger,
                submit_write=self.submit_write,
                note_buffers=self.note_buffers,
                stall_hint=self.stall_hint,
            )
            self.pools.append(self.in_place.pages)

    def note_buffers(self) -> None:
        """Count the bytes of every pool of ours (after one grew)."""
        self.ledger.note_buffers(sum(p.mapped_bytes for p in self.pools))

    def skew_of(self, device: torch.device, address: int) -> int:
        """Where a new block's bytes start in its record (see blocks.py): in-place writes keep
        the storage's offset in its first page."""
        return address % ALIGN if self._writes_in_place(device) else 0

    def _writes_in_place(self, device: torch.device) -> bool:
        # Host memory that no asynchronous copy fills (a simulated device's tensors are CPU ones).
        return (
            self.in_place is not None
            and device.type == "cpu"
            and not self.ordering.is_async(device)
        )

    # -- copy out --------------------------------------------------------------------------

    def write_out(self, block: Block, t: torch.Tensor) -> None:
        """Copy the storage into slots, chunk by chunk, and start the writes (no lock held)."""
        if self._writes_in_place(t.device):
            assert self.in_place is not None
            self.in_place.write_out(block, t)
            return
        lock = self.ledger.lock
        src = storage_bytes(t)
        is_async = self.ordering.is_async(t.device)
        if (
            t.device.type == "cuda"
            and not self.host_tier
            and self.backend is not None
            and self.backend.open_direct()
        ):
            self._write_out_direct(block, t, src)
            return
        with lock:
            pool = self._slot_pool(is_async)
            if is_async:
                block.copy_done = StagedCopy(self.ordering, block, t, block.stream)
        copy: StagedCopy | None = block.copy_done
        pos = 0
        for chunk in block.chunks:
            n = min(chunk.nbytes, block.nbytes - pos)
            with lock:
                chunk.slot = self._acquire_slot(pool)
                self.ledger.add_resident(chunk.nbytes)
                if chunk.slot is None:  # nothing can free a slot: keep this chunk in memory
                    chunk.mem = torch.zeros(chunk.nbytes, dtype=torch.uint8)
                else:
                    chunk.filling = True  # see [a slot being filled]
                    self.filling += 1
            if chunk.slot is None:
                assert chunk.mem is not None
                chunk.mem[:n].copy_(src[pos : pos + n])
                pos += n
                continue
            # A failure here reaches capture's handler, whose release_chunks clears the mark.
            dst = pool.tensor(chunk.slot, n)
            if copy is not None:
                chunk.ready = copy.chunk(dst, src[pos : pos + n])
            else:
                dst.copy_(src[pos : pos + n])
            pos += n
            with lock:
                self._filled(chunk)
                if not self.host_tier:
                    self.submit_write(block, chunk, chunk.ready)
        if copy is not None:
            copy.seal()
            with lock:
                self.pending_copies.append(copy)

    def _filled(self, chunk: Chunk) -> None:
        """The copy into ``chunk``'s slot is enqueued or done, or failed (lock held)."""
        chunk.filling = False
        self.filling -= 1
        self.ledger.cond.notify_all()  # a thread may wait to spill it, or for its write

    def _write_out_direct(self, block: Block, t: torch.Tensor, src: torch.Tensor) -> None:
        """GDS: write each chunk straight from device memory, after the producer's event.

        The source is held until its last chunk is written; its version counter is compared
        then, as for the copy into staging (see [device ordering] in ordering.py)."""
        ready = self.ordering.record(block.stream).synchronize
        block.direct = True
        block.direct_source = (t, block.version)
        pos = 0
        for chunk in block.chunks:
            n = min(chunk.nbytes, block.nbytes - pos)
            piece = src[pos : pos + n]
            with self.ledger.lock:
                self.ledger.add_resident(chunk.nbytes)  # device memory held until written
                block.direct_pending += 1
                self.submit_write(block, chunk, ready, piece=piece)
            pos += n

    def _slot_pool(self, is_async: bool) -> SlotPool:
        """The slot pool for this tier, created on first use."""
        pool = self.pool
        if pool is None:
            cfg = self.config
            if self.host_tier:
                pool = SlotPool(cfg.host_budget_bytes, cfg.chunk_bytes)
            else:
                assert self.backend is not None
                pool = self.backend.staging()
            self.pool = pool
            self.pools.append(pool)
            self.note_buffers()
        if is_async:
            self.ordering.prepare_pool(pool)
        return pool

    def stall_hint(self) -> str:
        """Who does the I/O and its state, for a long wait's warning (see StallWatch)."""
        return "no backend" if self.backend is None else self.backend.stall_hint()

    def _acquire_slot(self, pool: SlotPool) -> int | None:
        """A free slot, waiting for writes (spilling the oldest host chunks on the cpu tier)."""
        slot = pool.acquire()
        if slot is not None:
            return slot
        st = self.ledger.stats
        start = time.perf_counter()
        st.backpressure_waits += 1
        watch = StallWatch("a free staging slot (writes to finish)", self.stall_hint)
        with span("offloadd::slot_wait"):
            slot = self._wait_for_slot(pool, watch)
        waited = time.perf_counter() - start
        st.io_wait_s += waited
        st.write_wait_s += waited
        return slot

    def _wait_for_slot(self, pool: SlotPool, watch: StallWatch) -> int | None:
        slot = None
        while slot is None:
            # Another thread's chunks being filled will be written (ssd) or become spillable.
            busy = self.in_flight > 0 or bool(self.awaiting_copy) or self.filling > 0
            if self.host_tier and not busy:
                busy = self._spill_oldest()
            if not busy:
                break
            # Nothing signals a copy's completion: poll for those, wait for writes.
            self.ledger.cond.wait(timeout=watch.timeout(0.002 if self.awaiting_copy else 1.0))
            watch.check()
            self.poll_copies()
            slot = pool.acquire()
        return slot

    def _spill_oldest(self) -> bool:
        """cpu tier: start writing the oldest host-held chunks to disk; True if any was started."""
        started = 0
        for block in self.blocks:
            if block.upload_pending():  # its write's end would free the slot under the copy
                continue
            for chunk in block.chunks:
                if (
                    chunk.slot is not None
                    and not chunk.filling  # see [a slot being filled]
                    and chunk.request is None
                    and not chunk.on_disk
                ):
                    # The chunk's own event: the block may still be being captured, its later
                    # chunks' copies not even enqueued (see [device ordering] in ordering.py).
                    self.submit_write(block, chunk, chunk.ready)
                    started += 1
            if started >= 4:
                break
        return started > 0

    # -- writes ----------------------------------------------------------------------------

    def submit_write(
        self,
        block: Block,
        chunk: Chunk,
        ready: Callable[[], None] | None = None,
        *,
        piece: torch.Tensor | None = None,
        address: int = 0,
        head: int = 0,
        tail: int = 0,
    ) -> None:
        """Write a chunk from its slot, (GDS) from the device tensor ``piece``, or (in place)
        from ``address`` with the ``head`` and ``tail`` pages of the request."""
        backend = self.backend
        assert backend is not None
        chunk.file, chunk.offset = backend.place(block.seq + chunk.index)
        self.ledger.note_disk(backend.used_bytes)
        nbytes = chunk.nbytes
        if piece is not None:
            address, nbytes = piece.data_ptr(), piece.numel()
        elif not address:
            assert self.pool is not None and chunk.slot is not None
            address = self.pool.address(chunk.slot)
        fd, path = backend.target(chunk.file)
        req = Request(
            Op.WRITE,
            fd,
            path,
            chunk.offset,
            address,
            nbytes,
            self._on_write_done,
            before=ready,
            keepalive=piece,
            context=(block, chunk),
            head=head,
            tail=tail,
        )
        chunk.request = req
        self.in_flight += 1
        backend.submit(req, direct=piece is not None)

    def _on_write_done(self, req: Request) -> None:
        block, chunk = req.context
        ledger = self.ledger
        with ledger.lock:
            chunk.request = None
            self.in_flight -= 1
            if req.error is None:
                chunk.on_disk = True
                ledger.stats.bytes_written += chunk.nbytes
            else:
                self._write_failed(block, chunk, req.error, req.keepalive)
            if chunk.slot is not None:
                assert self.pool is not None
                self.pool.release(chunk.slot)
                chunk.slot = None
                ledger.sub_resident(chunk.nbytes)
            if block.direct:  # GDS: the device memory was the source
                self._direct_written(block, chunk)
            elif block.in_place:
                assert self.in_place is not None
                self.in_place.chunk_settled(block)
            if block.freed:
                self.free_chunk_disk(chunk)
            ledger.cond.notify_all()

    def _direct_written(self, block: Block, chunk: Chunk) -> None:
        if chunk.mem is None:
            self.ledger.sub_resident(chunk.nbytes)
        block.direct_pending -= 1
        if block.direct_pending == 0 and block.direct_source is not None:
            t, version = block.direct_source
            if t._version != version:
                block.modified = True  # changed in place before it was written
            # A failed chunk keeps a view of the source (chunk.mem): keep checking its
            # version at unpack for as long as that view is the data.
            if all(c.mem is None for c in block.chunks):
                block.direct_source = None

    def _write_failed(
        self, block: Block, chunk: Chunk, err: BaseException, piece: torch.Tensor | None
    ) -> None:
        """Keep the chunk's bytes in memory (see [never fail the step])."""
        self.free_chunk_disk(chunk)
        self.ledger.warn_once(
            f"write:{getattr(err, 'errno', None)}",
            f"offloadd: write failed ({err}); keeping the affected tensors in memory",
        )
        if block.freed:
            return
        if block.direct:  # GDS: keep the device bytes (already counted as resident)
            chunk.mem = piece
        elif block.in_place:
            assert self.in_place is not None
            chunk.mem = self.in_place.chunk_bytes(block, chunk)
            self.ledger.add_resident(chunk.nbytes)
        elif chunk.slot is not None:
            assert self.pool is not None
            chunk.mem = self.pool.tensor(chunk.slot, chunk.nbytes).clone()
            self.ledger.add_resident(chunk.nbytes)
        else:
            return
        self.ledger.stats.fallbacks += 1

    def cancel_write(self, chunk: Chunk) -> bool:
        """Cancel the chunk's write if it has not started (its slot keeps the bytes)."""
        req = chunk.request
        if req is None or req.op is not Op.WRITE or self.backend is None:
            return False
        if not self.backend.cancel(req):
            return False
        chunk.request = None
        self.in_flight -= 1
        self.free_chunk_disk(chunk)
        block = req.context[0]
        if block.in_place:  # its bytes stay in the source (held) or the block's resident copy
            assert self.in_place is not None
            self.in_place.chunk_settled(block)
        self.ledger.cond.notify_all()
        return True

    # -- freeing ---------------------------------------------------------------------------

    def poll_copies(self) -> None:
        """Release the sources of finished copies, and the slots of blocks freed while their
        copy ran."""
        q = self.pending_copies
        while q and q[0].done(wait=False):
            q.popleft()
        if self.awaiting_copy:
            waiting, self.awaiting_copy = self.awaiting_copy, []
            for block in waiting:
                self.release_chunks(block)  # puts it back if its copy is still running

    def release_chunks(self, block: Block) -> None:
        """Give back the slots, memory and places of a block's chunks (cancelling writes)."""
        if not block.copy_completed() or block.upload_pending():
            # A slot may be reused only once its copies (in, and out to the device) completed;
            # rather than waiting with the lock held, poll_copies releases the chunks then.
            if block not in self.awaiting_copy:
                self.awaiting_copy.append(block)
            return
        ledger = self.ledger
        for chunk in block.chunks:
            if chunk.filling:  # write_out failed between the mark and the copy's enqueueing
                self._filled(chunk)
            if not block.direct:  # GDS writes finish; their callback frees the place
                self.cancel_write(chunk)
            if chunk.request is None and chunk.slot is not None and self.pool is not None:
                self.pool.release(chunk.slot)
                chunk.slot = None
                ledger.sub_resident(chunk.nbytes)
            if chunk.mem is not None:
                chunk.mem = None
                ledger.sub_resident(chunk.nbytes)
            if chunk.request is None:
                self.free_chunk_disk(chunk)
        ledger.cond.notify_all()

    def free_chunk_disk(self, chunk: Chunk) -> None:
        if chunk.offset >= 0 and self.backend is not None:
            self.backend.free(chunk.file, chunk.offset)
            chunk.offset = -1
            chunk.on_disk = False
            self.ledger.note_disk(self.backend.used_bytes)
