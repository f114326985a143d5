"""Zero-copy writes: a CPU tensor written to disk from its own pages.

Note: [zero-copy] On the ssd tier, a captured CPU tensor is not copied into staging: its
storage is written with O_DIRECT straight from where it lies. O_DIRECT needs page-aligned memory
and file offsets, and torch's allocator aligns storages to 64 bytes only, so the block's record
(see blocks.py) starts ``skew = address % 4096`` bytes into its first page: memory page ``k`` of
the storage's span is record page ``k``. Every page but the first and the last is written in
place; those two may hold bytes that are not the storage's (the allocator's header, a
neighbour's data), so they are written from bounce pages that hold the storage's bytes of that
page and zeros (an engine request's ``head``/``tail``, see io/request.py).

The tensor is held until its last chunk is written (``block.direct_source``), then released:
that is when its memory goes back to the allocator. Its version counter is compared then, as for
every copy taken after capture: a change in place while the write ran makes unpack raise. Bytes
held this way are bounded by ``staging_bytes`` (with a budget, by its plan's room: [room for
writes]); past it forward waits (backpressure), as it does for staging slots. Backward that
needs a block whose source is still held takes the source itself (no copy, no read) and
cancels the writes that have not started (see [forwarding] in reader.py).

Note: [room for writes] The sources held are memory a budget must count, and a slow disk holds
more of them. With a budget, the plan that runs says what its budget leaves over its predicted
peak (``Planner.write_room`` in stages.py, ``Plan.room`` in auto/solver.py), and the bytes held
are bounded by that where it is less than ``staging_bytes``, but never below one chunk (and
one block, however large, may always be held alone), so that writes go on. A profile step
leaves no room: its writes hold one chunk (or one block), so that the peaks it measures are the
plan's own and not what a slow disk held then, which the room would count twice. The bound is
read at each wait, so it follows the step that runs. The staging pool needs no such bound:
its slots are one buffer of ``staging_bytes``, counted whole from its creation, and a slow disk
makes forward wait for a slot rather than hold more.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from offloadd.io.buffers import ALIGN
from offloadd.io.pools import PagePool
from offloadd.runtime.blocks import Block, Chunk
from offloadd.runtime.identity import storage_bytes
from offloadd.units import format_bytes

if TYPE_CHECKING:
    from offloadd.config import Config
    from offloadd.runtime.accounting import Ledger

__all__ = ["InPlace"]


class InPlace:
    """The zero-copy write path of a :class:`~offloadd.runtime.writer.Writer`.

    What it needs of the writer comes in as callables: ``submit_write(block, chunk, address=,
    head=, tail=)`` (a chunk's write from ``address``, with bounce pages for its ends),
    ``note_buffers()`` (the mapped buffers changed) and ``stall_hint()`` (who does the I/O, for
    a long wait's warning)."""

    def __init__(
        self,
        config: Config,
        ledger: Ledger,
        *,
        submit_write: Callable[..., None],
        note_buffers: Callable[[], None],
        stall_hint: Callable[[], str],
    ) -> None:
        self.config = config
        self.ledger = ledger
        self.submit_write = submit_write
        self.note_buffers = note_buffers
        self.stall_hint = stall_hint
        self.pages = PagePool()
        self.held_bytes = 0  # sources held until written (bounded by limit())
        self.room: Callable[[], int | None] = lambda: None  # a plan's room (see [room for writes])

    def write_out(self, block: Block, t: torch.Tensor) -> None:
        """Start the writes of ``block`` from ``t``'s own pages (no lock held)."""
        ledger = self.ledger
        with ledger.lock:
            self._wait_room(block.nbytes)
            block.in_place = True
            block.direct_source = (t, block.version)
            self.held_bytes += block.nbytes
            ledger.add_resident(block.nbytes)  # the source, until its last write completed
            try:
                self._submit(block, t)
            except BaseException:
                # The caller cancels what was submitted (release_chunks); none: undo here.
                if not block.direct_pending:
                    block.direct_pending = 1
                    self.chunk_settled(block)
                raise

    def _submit(self, block: Block, t: torch.Tensor) -> None:
        src = storage_bytes(t)
        base = block.source_ptr - block.skew  # memory address of record byte 0
        end = block.skew + block.nbytes
        last = len(block.chunks) - 1
        lo = 0
        for chunk in block.chunks:
            hi = lo + chunk.nbytes
            head = tail = 0
            if (lo == 0 and block.skew) or (hi > end and hi - lo == ALIGN):
                head = self._bounce(block, src, lo)
            if chunk.index == last and hi > end and hi - lo > ALIGN:
                tail = self._bounce(block, src, hi - ALIGN)
            block.direct_pending += 1
            self.submit_write(block, chunk, address=base + lo, head=head, tail=tail)
            lo = hi

    def _bounce(self, block: Block, src: torch.Tensor, at: int) -> int:
        """A bounce page holding record bytes ``[at, at + 4096)``: the storage's, else zeros."""
        grown = self.pages.mapped_bytes
        address = self.pages.acquire()
        if self.pages.mapped_bytes != grown:
            self.note_buffers()
        block.pages.append(address)
        page = self.pages.page(address)
        page.zero_()
        a, b = max(at, block.skew), min(at + ALIGN, block.skew + block.nbytes)
        page[a - at : b - at].copy_(src[a - block.skew : b - block.skew])
        return address

    def limit(self) -> int:
        """The most bytes of sources held for writing: ``staging_bytes``, or what a budget's
        plan leaves where that is less, at least one chunk (see [room for writes])."""
        cfg, room = self.config, self.room()
        if room is None:
            return cfg.staging_bytes
        return min(cfg.staging_bytes, max(cfg.chunk_bytes, room))

    def _wait_room(self, nbytes: int) -> None:
        """Backpressure: wait while the sources held for writing exceed :meth:`limit`."""
        limit = self.limit()
        if self.held_bytes == 0 or self.held_bytes + nbytes <= limit:
            return
        st = self.ledger.stats
        st.backpressure_waits += 1
        start = time.perf_counter()
        self.ledger.wait_while(
            lambda: bool(self.held_bytes and self.held_bytes + nbytes > limit),
            f"writes to finish ({format_bytes(limit)} of sources held)",
            self.stall_hint,
        )
        waited = time.perf_counter() - start
        st.io_wait_s += waited
        st.write_wait_s += waited

    # -- completion (lock held) ------------------------------------------------------------

    def chunk_settled(self, block: Block) -> None:
        """One of the block's writes completed, failed or was cancelled."""
        block.direct_pending -= 1
        if block.direct_pending:
            return
        for address in block.pages:
            self.pages.release(address)
        block.pages.clear()
        source = block.direct_source
        if source is not None and source[0]._version != source[1]:
            block.modified = True  # changed in place while it was being written
        self.held_bytes -= block.nbytes
        self.ledger.cond.notify_all()
        self.release_source(block)

    def release_source(self, block: Block) -> None:
        """Drop the held source once no write reads it and backward does not use it."""
        if block.direct_pending or block.resident_is_source or block.direct_source is None:
            return
        block.direct_source = None
        self.ledger.sub_resident(block.nbytes)

    def chunk_bytes(self, block: Block, chunk: Chunk) -> torch.Tensor:
        """A copy of a chunk's record bytes (a failed write keeps them in memory)."""
        assert block.direct_source is not None
        src = storage_bytes(block.direct_source[0])
        lo = chunk.index * self.config.chunk_bytes
        mem = torch.zeros(chunk.nbytes, dtype=torch.uint8)
        a, b = max(lo, block.skew), min(lo + chunk.nbytes, block.skew + block.nbytes)
        if b > a:
            mem[a - lo : b - lo].copy_(src[a - block.skew : b - block.skew])
        return mem

    def close(self) -> None:
        self.pages.close()
