"""The read path: a block made resident again for unpack, and the prefetcher that runs ahead.

Note: [forwarding] A chunk still in a slot when backward needs it is copied from the slot and its
write is cancelled if it has not started: the last tensors of a forward are often never written
at all. A block written in place whose source is still held is not even copied: backward gets
the source's own storage, as it would without offloadd, and the writes not yet started are
cancelled.

Read-backs of host blocks land in warm buffers of the read pool (see [warm buffers] in
io/pools.py), or of the host cache where it is torch's CPU allocator ([one pool]), laid out like
the block's record, so O_DIRECT puts every byte in its final place; autograd gets a tensor that
views the buffer, which returns to its pool when that tensor dies.

Note: [prefetch window] Backward unpacks roughly in reverse pack order. At each unpack, blocks
packed before it are read ahead, newest first, while the bytes of blocks prefetched and not yet
consumed stay under the window: eight times the median block of the step (at least two chunks), at
most ``prefetch_bytes``; the read pool then holds about that much warm. A sweep remembers where it
stopped: an unpack inside the range already scanned resumes there, so backward costs O(blocks) in
all, not per unpack.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from offloadd.io.buffers import ALIGN
from offloadd.io.pools import ReadPool
from offloadd.io.request import Op, Request
from offloadd.runtime import host_allocator
from offloadd.runtime.blocks import Back, Block, Out
from offloadd.runtime.handles import Ref, view
from offloadd.runtime.identity import inplace_error, storage_bytes
from offloadd.runtime.writer import Writer
from offloadd.trace import span
from offloadd.units import format_bytes

__all__ = ["Reader"]


class Reader:
    """Unpack of offloaded refs, loads, consumption and prefetch (lock held, except
    :meth:`unpack` and :meth:`to_device`)."""

    def __init__(self, writer: Writer) -> None:
        self.writer = writer  # whose slots it forwards from and whose writes it cancels
        self.config, self.ledger, self.blocks = writer.config, writer.ledger, writer.blocks
        self.backend, self.ordering = writer.backend, writer.ordering
        self.prefetch_live = 0  # bytes held by prefetched blocks not yet consumed
        self.pool = ReadPool(host_allocator.serves)
        writer.pools.append(self.pool)
        self.window = self.config.prefetch_bytes  # sized from the blocks at each sweep
        self._pf_low = 0  # prefetch sweep: blocks with seq in [_pf_low, _pf_high) were scanned
        self._pf_high = 0

    def unpack(
        self, ref: Ref, drain: Callable[[], None], closed: Callable[[], bool]
    ) -> torch.Tensor:
        """The saved tensor of an offloaded ref: its source until captured, else read back.

        ``drain()``: apply the saves and releases queued without the lock (see
        Lifetime.drain); ``closed()``: whether the Offloader was closed."""
        block = ref.block
        with self.ledger.lock:
            drain()
            while block.out is Out.CAPTURING:
                self.ledger.cond.wait()
            source = block.source
            if source is None:
                if closed() and block.back is Back.ABSENT:
                    raise RuntimeError("offloadd: unpack after Offloader.close()")
                copy = block.copy_done
        handle = source if source is not None else block.handle
        if handle is not None and handle._version != block.version:
            # Changed in place since it was saved (see [the version handle] in capture.py).
            raise inplace_error(ref.desc, block.version, handle._version)
        if source is not None:
            # Not captured (yet): a view of the saved tensor itself, which shares its version
            # counter, so that a graph built on it (double backward) still sees in-place changes.
            return source.as_strided(ref.size, ref.stride, ref.offset)
        if copy is not None:
            # Async devices: the slots are complete, and the version checked, once the copy
            # completed. Waited for without the lock: I/O callbacks and other threads need it.
            copy.done(wait=True)
        with self.ledger.lock:
            direct = block.direct_source  # GDS, in place: writes may still read the source
            if direct is not None and direct[0]._version != direct[1]:
                block.modified = True
            if block.modified:
                raise inplace_error(ref.desc, block.version, block.version + 1)
            if block.back is Back.ABSENT:
                self.load(block, prefetch=False)
            if not closed():  # the slots and the backend are gone: nothing more to read ahead
                self.prefetch_below(block.seq)
            if block.back is Back.LOADING or block.back is Back.UPLOADING:
                start = time.perf_counter()
                with span("offloadd::read_wait"):
                    self.ledger.wait_while(
                        lambda: block.back is Back.LOADING or block.back is Back.UPLOADING,
                        f"the read-back of a saved activation ({format_bytes(block.nbytes)})",
                        self.writer.stall_hint,
                    )
                waited = time.perf_counter() - start
                self.ledger.stats.io_wait_s += waited
                self.ledger.stats.read_wait_s += waited
            if block.error is not None:
                err = block.error
                raise OSError(
                    getattr(err, "errno", None),
                    f"offloadd: reading back a saved activation failed: {err}",
                    getattr(err, "filename", None),
                ) from err
            buf = block.resident
            assert buf is not None
            h2d = block.h2d
            upload = self.ordering.is_async(block.device) and not block.direct and h2d is None
            if upload:
                block.move_back(Back.UPLOADING)  # other unpacks wait for the copy below
            else:
                fresh = ref.gen != block.gen
                self.consume(block, ref)
        if upload:
            buf, fresh = self.to_device(block, ref, buf)
        elif h2d is not None:
            self._await_upload(block, buf, h2d)
        if fresh and buf.device.type == "cpu":
            self.ledger.note_moved(block.padded)
        if self.ledger.warnings_due:
            self.ledger.flush_warnings()
        return view(buf, ref)

    def load(self, block: Block, *, prefetch: bool) -> None:
        """Make ``block.resident``: copy chunks held in memory, read the others (async)."""
        with span("offloadd::read"):
            self._load(block, prefetch)

    def _load(self, block: Block, prefetch: bool) -> None:
        # Async devices: slots are complete only once the copy is; unpack waited for it without
        # the lock and prefetch only takes blocks whose copy completed.
        assert block.copy_completed()
        ledger = self.ledger
        if block.in_place and block.direct_source is not None:
            self._forward_source(block)
            return
        if self._slots_to_device(block):
            self._upload(block, prefetch)
            return
        ready: Callable[[], None] | None = None
        if block.direct:
            buf = rec = self.ordering.empty(block.padded, block.device)
            # The caching allocator may hand out memory that kernels queued on this stream
            # still use; a GDS read from another thread ignores stream order, so wait for them.
            ready = self.ordering.record(self.ordering.producer(block.device)).synchronize
        else:
            created = self.pool.created
            # the largest record of this size at any skew: the class does not follow the heap
            host = self.pool.take_record(block.padded, block.nbytes + ALIGN - 1)
            rec = host.tensor[: block.padded]  # the record; the storage's bytes from skew on
            buf = self.pool.lend(host, block.skew, block.nbytes)
            if self.pool.created != created:
                self.writer.note_buffers()
        self._made_resident(block, buf, prefetch)
        block.move_back(Back.LOADING)  # until its reads land
        try:
            on_demand = self._fill(block, rec, buf, ready)
        except BaseException as e:  # a submit refused (the engine closed): unpack raises it
            # kept without its traceback, whose frames hold refs of this block
            block.error = block.error or RuntimeError(f"the read was not started: {e!r}")
            raise
        finally:
            if block.loading == 0:  # every chunk copied, or read (the reads land later)
                block.move_back(Back.RESIDENT)
        if prefetch:
            ledger.stats.prefetched_bytes += block.padded
        elif on_demand:
            ledger.stats.on_demand_reads += 1

    def _fill(
        self,
        block: Block,
        rec: torch.Tensor,
        buf: torch.Tensor,
        ready: Callable[[], None] | None,
    ) -> bool:
        """Copy or read each chunk into the record ``rec`` (``buf`` viewing it); whether any
        chunk is read from the backend."""
        backend = self.backend
        assert backend is not None
        ledger = self.ledger
        on_demand = False
        pool = self.writer.pool
        pos = 0
        for chunk in block.chunks:
            dst = rec[pos : pos + chunk.nbytes]
            if block.direct:  # GDS chunks hold their real length, not the padded one
                dst = dst[: max(0, min(chunk.nbytes, block.nbytes - pos))]
            write = chunk.request
            if chunk.mem is not None:
                dst.copy_(chunk.mem[: dst.numel()])
            elif block.direct and write is not None and write.op is Op.WRITE:
                dst.copy_(write.keepalive)  # still being written: take the device source
                ledger.stats.forwarded_bytes += chunk.nbytes
            elif chunk.slot is not None:  # see [forwarding]
                assert pool is not None and not block.in_place
                dst.copy_(pool.tensor(chunk.slot, chunk.nbytes))
                if self.writer.cancel_write(chunk):
                    pool.release(chunk.slot)
                    chunk.slot = None
                    ledger.sub_resident(chunk.nbytes)
                    block.pinned_resident = True
                ledger.stats.forwarded_bytes += chunk.nbytes
            elif chunk.on_disk:
                fd, path = backend.target(chunk.file)
                req = Request(
                    Op.READ,
                    fd,
                    path,
                    chunk.offset,
                    dst.data_ptr(),
                    dst.numel(),
                    self._on_read_done,
                    before=ready,
                    keepalive=dst if block.direct else buf,
                    context=(block, chunk),
                )
                # counted once submitted (a refused one is not in flight); its completion
                # waits for the lock this holds
                backend.submit(req, direct=block.direct)
                chunk.request = req
                block.loading += 1
                on_demand = True
            else:
                raise AssertionError("chunk without data")
            pos += chunk.nbytes
        return on_demand

    def _made_resident(self, block: Block, buf: torch.Tensor, prefetch: bool) -> None:
        block.resident = buf
        block.resident_bytes = block.padded
        block.h2d = None
        block.gen += 1
        block.unconsumed = block.refs
        block.prefetched = prefetch
        block.error = None
        self.ledger.add_resident(block.padded)
        if prefetch:
            self.prefetch_live += block.padded

    def _uploadable(self, block: Block) -> bool:
        """Whether every chunk of ``block`` (on an async device) is in a pinned slot, with no
        write in flight (see H2D in [device ordering])."""
        return (
            self.ordering.is_async(block.device)
            and not block.direct
            and not block.in_place
            and self.writer.pool is not None
            and all(c.slot is not None and c.mem is None and not c.filling for c in block.chunks)
        )

    def _slots_to_device(self, block: Block) -> bool:
        """:meth:`_uploadable`, cancelling the writes not started; False if one has started
        (its end would give the slot back under the copy)."""
        if not self._uploadable(block):
            return False
        for chunk in block.chunks:
            if chunk.request is not None and not self.writer.cancel_write(chunk):
                return False
        return True

    def _upload(self, block: Block, prefetch: bool) -> None:
        """Copy ``block``'s slots to a new device buffer on the upload stream (see H2D in
        [device ordering]); unpack makes the consumer wait for it."""
        o, pool = self.ordering, self.writer.pool
        assert pool is not None
        consumer = o.producer(block.device)
        dev = o.empty(block.padded, block.device)
        stream = o.upload_stream(block.device)
        o.wait(stream, o.record(consumer))  # queued kernels may still read the memory
        pos = 0
        for chunk in block.chunks:
            assert chunk.slot is not None
            o.copy(stream, dev[pos : pos + chunk.nbytes], pool.tensor(chunk.slot, chunk.nbytes))
            pos += chunk.nbytes
        o.hold(dev, stream)  # dropped unconsumed: not reused before the copy ran
        done = o.record(stream)
        self._made_resident(block, dev, prefetch)
        block.move_back(Back.RESIDENT)
        block.h2d = (done, consumer)
        block.slots_read = done
        self.ledger.stats.forwarded_bytes += block.padded
        if prefetch:
            self.ledger.stats.prefetched_bytes += block.padded

    def _await_upload(self, block: Block, buf: torch.Tensor, h2d: tuple[Any, Any]) -> None:
        """Make the stream current here wait for ``buf``'s copy to the device (without the
        lock), and keep ``buf`` for it if it was allocated on another stream."""
        done, allocated_on = h2d
        consumer = self.ordering.producer(block.device)
        if done is not None:
            self.ordering.wait(consumer, done)
        if consumer != allocated_on:
            self.ordering.hold(buf, consumer)

    def _forward_source(self, block: Block) -> None:
        """In place, source still held: backward uses it (see [forwarding])."""
        assert block.direct_source is not None
        block.resident = storage_bytes(block.direct_source[0])
        block.move_back(Back.RESIDENT)
        block.resident_bytes = 0  # counted as the held source
        block.resident_is_source = True
        block.gen += 1
        block.unconsumed = block.refs
        block.prefetched = False
        block.error = None
        for chunk in block.chunks:
            if chunk.request is not None and self.writer.cancel_write(chunk):
                block.pinned_resident = True  # its only copy
        self.ledger.stats.forwarded_bytes += block.nbytes

    def _on_read_done(self, req: Request) -> None:
        block, chunk = req.context
        with self.ledger.lock:
            chunk.request = None
            block.loading -= 1
            if block.loading == 0 and block.back is Back.LOADING:
                block.move_back(Back.RESIDENT)  # or, if ``error`` is set, why not
            if req.error is not None:
                block.error = req.error
            else:
                self.ledger.stats.bytes_read += chunk.nbytes
            if block.freed:
                self.writer.free_chunk_disk(chunk)
            self.ledger.cond.notify_all()

    def consume(self, block: Block, ref: Ref) -> None:
        if ref.gen != block.gen:
            ref.gen = block.gen
            block.unconsumed -= 1
            if block.unconsumed <= 0 and not block.pinned_resident:
                self.drop_resident(block)

    def drop_resident(self, block: Block, *, loading_ok: bool = False) -> None:
        if block.back is Back.ABSENT or (block.back is Back.LOADING and not loading_ok):
            return
        block.move_back(Back.ABSENT)
        block.resident = None
        block.h2d = None
        self.ledger.sub_resident(block.resident_bytes)
        if block.resident_is_source:
            block.resident_is_source = False
            assert self.writer.in_place is not None
            self.writer.in_place.release_source(block)
        if block.prefetched:
            self.prefetch_live -= block.padded
            block.prefetched = False

    def prefetch_below(self, seq: int) -> None:
        """Read ahead, in reverse pack order from ``seq`` (see [prefetch window])."""
        if self._pf_low <= seq <= self._pf_high:
            start = self._pf_low
        else:  # a new sweep (a new backward, or a jump below what was scanned)
            start = self._pf_high = self._pf_low = seq
            self.window = self._size_window()
        window = self.window
        if self.prefetch_live >= window:
            return
        blocks = self.blocks
        i = blocks.position_below(start)
        while i >= 0 and self.prefetch_live < window:
            block = blocks.at(i)
            i -= 1
            if (
                block.back is Back.ABSENT
                and block.out is Out.CAPTURED
                and (block.gen == 0 or block.unconsumed > 0)  # not consumed by every ref yet
                and not block.modified
                and block.copy_completed()
                and (
                    any(c.on_disk and c.request is None for c in block.chunks)
                    or (self._uploadable(block) and all(c.request is None for c in block.chunks))
                )
            ):
                try:
                    self.load(block, prefetch=True)
                except torch.OutOfMemoryError:
                    # A copy up from the slots takes device memory ahead of use (H2D in
                    # [device ordering]), which must not fail a backward that fits without it:
                    # the block is copied up when unpacked. Nothing was changed yet.
                    self.ledger.warn_once(
                        "prefetch-oom",
                        "offloadd: reading ahead ran out of device memory; saved tensors are "
                        "copied to the device when backward needs them instead "
                        "(a smaller prefetch_bytes avoids the attempts)",
                    )
                    break
        self._pf_low = blocks.seq_at(i) + 1 if i >= 0 else 0

    def _size_window(self) -> int:
        """The read-ahead window for this sweep, from the blocks live now (see [prefetch window])."""
        cfg = self.config
        sizes = sorted(b.padded for b in self.blocks)
        if not sizes:
            return cfg.prefetch_bytes
        return min(cfg.prefetch_bytes, max(2 * cfg.chunk_bytes, 8 * sizes[len(sizes) // 2]))

    def to_device(self, block: Block, ref: Ref, host: torch.Tensor) -> tuple[torch.Tensor, bool]:
        """Copy a block read back into host memory to its device, without the lock held.

        The device buffer is allocated on the current (compute) stream of this backward thread,
        so the caching allocator orders its reuse after the kernels that will read it."""
        dev: torch.Tensor | None = None
        try:
            dev = self.ordering.upload(host, block.device)
        finally:
            with self.ledger.lock:
                if block.back is Back.UPLOADING:  # else dropped meanwhile
                    block.move_back(Back.RESIDENT)
                if dev is not None and block.resident is host:
                    block.resident = dev  # later refs take it as it is, on this stream
                    block.h2d = (None, self.ordering.producer(block.device))
                fresh = ref.gen != block.gen
                if dev is not None:
                    self.consume(block, ref)
                self.ledger.cond.notify_all()
        assert dev is not None
        return dev, fresh
