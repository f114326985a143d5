"""A block's life: captured once the op that saved it returned, freed once no ref needs it.

Pack (in offloader.py) creates blocks and refs; everything after that which is not reading or
writing bytes is here. :meth:`Lifetime.capture` takes a pending block's bytes (see [capture after
the op] in capture.py) and hands them to the write path; :meth:`Lifetime.drain` applies, under
the lock, the saves and releases queued without it (see [freeing] in handles.py), and frees
blocks whose last ref died: their source, resident copy, slots and places.
"""

from __future__ import annotations

from collections import deque

from offloadd.runtime import held
from offloadd.runtime.accounting import Ledger
from offloadd.runtime.blocks import Back, Block, BlockMap, Out
from offloadd.runtime.capture import CaptureQueue
from offloadd.runtime.dedup import StorageIndex
from offloadd.runtime.handles import Ref
from offloadd.runtime.reader import Reader
from offloadd.runtime.writer import Writer
from offloadd.trace import span

__all__ = ["Lifetime"]


class Lifetime:
    """Capture and freeing of the blocks of one Offloader."""

    def __init__(self, index: StorageIndex, writer: Writer, reader: Reader) -> None:
        self.ledger: Ledger = writer.ledger
        self.blocks: BlockMap = writer.blocks
        self.index = index
        self.writer = writer
        self.reader = reader
        self.released: deque[Ref] = deque()  # refs released without the lock
        self.tally = held.Tally()  # saved tensors kept as they are (see [the tally] in held.py)
        if not held.NATIVE:
            self.ledger.warn_once(
                "held",
                "offloadd: offloadd.runtime._held is not built: the saved-tensor hooks run in "
                "Python, slower per saved tensor (docs/native.md)",
            )
        self.captures = CaptureQueue()  # packed, not yet captured (see capture.py)
        self.closed = False

    def capture_due(self) -> None:
        """Capture what this thread packed in ops that have returned since."""
        for block in self.captures.due():
            self.capture(block)

    def capture_all(self) -> None:
        """Capture everything this thread packed (the caller is between two ops)."""
        for block in self.captures.take_all():
            self.capture(block)

    def capture(self, block: Block) -> None:
        """Copy a pending block out (see [capture after the op] in capture.py)."""
        with span("offloadd::capture"):
            self._capture(block)

    def _capture(self, block: Block) -> None:
        with self.ledger.lock:
            self.drain()  # a block whose graph is gone is dropped, never written
            if block.out is not Out.PENDING:  # freed, held, or captured already
                return
            t = block.source
            assert t is not None
            storage = t.untyped_storage()
            if t._version != block.version:
                # Changed in place after it was saved: unpack raises, as autograd would.
                block.modified = True
                self.release_source(block)
                block.move_out(Out.DROPPED)
                self.ledger.cond.notify_all()
                return
            if (
                self.closed
                or storage.nbytes() != block.nbytes
                or storage.data_ptr() != block.source_ptr
            ):
                # Closed, or the storage was resized or reallocated since pack (as FSDP does
                # to unsharded parameters): keep the tensor itself, as autograd does.
                block.move_out(Out.HELD)
                self.ledger.cond.notify_all()
                return
            block.move_out(Out.CAPTURING)
        try:
            self.writer.write_out(block, t)
        except BaseException as e:
            # Never fail the forward because of offloading: keep the tensor. An interrupt
            # (KeyboardInterrupt while waiting for a slot) goes on up, the block still settled.
            if isinstance(e, Exception):
                self.ledger.warn_once(
                    "pack", f"offloadd: offloading failed, keeping the tensor: {e!r}"
                )
            if block.copy_done is not None:
                block.copy_done.abort()
            with self.ledger.lock:
                self.writer.release_chunks(block)
                self.ledger.stats.fallbacks += isinstance(e, Exception)
                block.move_out(Out.HELD)
                block.copy_done = None
                if block.freed:
                    self.free_block(block)
                self.ledger.cond.notify_all()
            if not isinstance(e, Exception):
                raise
            return
        with self.ledger.lock:
            self.ledger.stats.offloaded_bytes += block.nbytes
            self.release_source(block)
            block.move_out(Out.CAPTURED)
            if block.freed:  # every ref was released while it was being copied
                self.free_block(block)
            self.ledger.cond.notify_all()
        if t.device.type == "cpu":
            self.ledger.note_moved(block.nbytes)
        if self.ledger.warnings_due:
            self.ledger.flush_warnings()

    def release_source(self, block: Block) -> None:
        """Drop the saved tensor a pending or held block kept (lock held)."""
        if block.source is not None:
            block.source = None
            self.ledger.sub_resident(block.nbytes)
        block.stream = None

    def settle(self) -> None:
        """Wait for every write and read in flight, then apply what finished and what was
        released meanwhile (lock held)."""
        writer = self.writer
        self.ledger.wait_while(
            lambda: bool(writer.in_flight or self.blocks.any_loading()),
            "every write and read in flight",
            writer.stall_hint,
        )
        writer.poll_copies()
        self.drain()

    # -- freeing ---------------------------------------------------------------------------

    def drain(self) -> None:
        """Apply, under the lock, what happened without it: the tensors kept as they are (the
        tally's count, see [the tally] in held.py) and the refs released since, in the order
        they were released (see [freeing] in handles.py). The paths that add resident bytes in
        bulk (a block packed or captured, a read) drain first, so the peak sees the tally's."""
        ledger = self.ledger
        ledger.apply_kept(*self.tally.take())
        q = self.released
        while q:
            ref = q.popleft()
            block = ref.block
            block.refs -= 1
            if ref.tensor is not None:  # a kept block (see Ref): only accounting
                if block.refs == 0:
                    ledger.sub_resident(block.resident_bytes, kept=True)
                    self.forget(block)
                continue
            if block.back is not Back.ABSENT and ref.gen != block.gen:
                block.unconsumed -= 1
                if block.unconsumed <= 0 and not block.pinned_resident and block.refs:
                    self.reader.drop_resident(block)
            if block.refs == 0:
                self.free_block(block)

    def free_block(self, block: Block) -> None:
        block.freed = True
        block.pinned_resident = False
        if block.out is Out.CAPTURING:
            self.forget(block)  # no new save may join it
            return  # the capturing thread frees the rest once done (see capture)
        self.release_source(block)
        if block.out is Out.PENDING or block.out is Out.HELD:
            block.move_out(Out.DROPPED)
        # Even while reads are in flight: each request keeps its buffer alive, and the read
        # callback frees the place of a freed block.
        self.reader.drop_resident(block, loading_ok=True)
        self.writer.release_chunks(block)
        self.forget(block)

    def forget(self, block: Block) -> None:
        self.blocks.forget(block)
        self.index.forget(block)
