"""Blocks and chunks: one storage's bytes on their way out, out, or back in; and the map of them.

A *block* is one storage being offloaded; it is cut into *chunks* of ``chunk_bytes``, the unit of
staging slots, disk slots and I/O requests. Blocks are numbered in pack order (``seq``): backward
unpacks roughly in reverse, which is the order the prefetcher reads them back in.

A block's bytes on disk are its *record*: ``skew`` bytes of padding, the storage's bytes, then
padding to a multiple of 4096. ``skew`` is the storage address modulo 4096 for blocks written in
place (see [zero-copy] in writer_in_place.py), so that record and memory share their page
boundaries; 0 for blocks that go through staging. Read-backs land in a buffer with the same
layout, and the tensor handed to autograd views it from ``skew`` on.

Note: [a block's two sides] A block has a write side, ``out``: how far its bytes got on their
way out; and a read side, ``back``: where they are for backward. Each is one value, changed only
by :meth:`Block.move_out` and :meth:`Block.move_back`, which assert that the move is one of
these (the lock is held for every move):

    out:   PENDING -> CAPTURING | HELD | DROPPED      CAPTURING -> CAPTURED | HELD
           HELD -> DROPPED                            CAPTURED, DROPPED: final
    back:  ABSENT -> LOADING | RESIDENT               LOADING -> RESIDENT | ABSENT
           RESIDENT -> UPLOADING | ABSENT             UPLOADING -> RESIDENT | ABSENT

Beside them, and not stages of either: ``modified``, a verdict (changed in place after it was
saved: unpack raises), found by whichever thread sees it and never cleared; ``freed``, every
ref released (a block freed while CAPTURING is freed by the capturing thread once done); and
the counts: ``refs``, ``loading`` (reads in flight while LOADING), ``unconsumed`` and ``gen``
(refs that have not unpacked the current load). ``prefetched``, ``pinned_resident`` and
``resident_is_source`` say what the resident copy is.
"""

from __future__ import annotations

import bisect
import enum
from collections.abc import Callable, Iterator
from typing import Any

import torch

from offloadd.io.buffers import round_up
from offloadd.io.request import Request

__all__ = ["Back", "Block", "BlockMap", "Chunk", "Out"]


class Out(enum.Enum):
    """A block's write side (see [a block's two sides], and [capture after the op] in
    capture.py)."""

    PENDING = "pending"  # ``source`` holds the data; the op that saved it may still be running
    CAPTURING = "capturing"  # one thread is copying it out; unpack waits
    CAPTURED = "captured"  # the data is in chunks (staging, host pool, disk)
    HELD = "held"  # capture failed or made no sense: ``source`` holds the data for good
    DROPPED = "dropped"  # freed, or changed in place, before its bytes went out: none kept


class Back(enum.Enum):
    """A block's read side (see [a block's two sides])."""

    ABSENT = "absent"  # not in memory for backward (on disk, in slots, in its chunks)
    LOADING = "loading"  # ``resident`` is being read into (``loading`` reads in flight)
    RESIDENT = "resident"  # ``resident`` holds the bytes (or ``error`` says why not)
    UPLOADING = "uploading"  # one unpack copies ``resident`` to the device; others wait


_OUT_MOVES = {
    Out.PENDING: (Out.CAPTURING, Out.HELD, Out.DROPPED),
    Out.CAPTURING: (Out.CAPTURED, Out.HELD),
    Out.HELD: (Out.DROPPED,),
    Out.CAPTURED: (),
    Out.DROPPED: (),
}
_BACK_MOVES = {
    Back.ABSENT: (Back.LOADING, Back.RESIDENT),
    Back.LOADING: (Back.RESIDENT, Back.ABSENT),
    Back.RESIDENT: (Back.UPLOADING, Back.ABSENT),
    Back.UPLOADING: (Back.RESIDENT, Back.ABSENT),
}


class Chunk:
    __slots__ = (
        "file",
        "filling",
        "index",
        "mem",
        "nbytes",
        "offset",
        "on_disk",
        "ready",
        "request",
        "slot",
    )

    def __init__(self, index: int, nbytes: int) -> None:
        self.index = index
        self.nbytes = nbytes  # padded to 4096
        self.file = -1  # the backend's file index
        self.offset = -1  # byte offset in that file
        self.slot: int | None = None  # staging/host slot holding the data
        self.request: Request | None = None  # write or read in flight
        self.on_disk = False
        self.mem: torch.Tensor | None = None  # fallback copy after a failed write
        self.ready: Callable[[], None] | None = None  # waits for its copy into the slot
        self.filling = False  # its slot is taken, its copy not yet enqueued (see writer.py)


class Block:
    """One storage's bytes, on their way out, out, or back in."""

    __slots__ = (
        "back",
        "chunks",
        "copy_done",
        "device",
        "direct",
        "direct_pending",
        "direct_source",
        "error",
        "freed",
        "gen",
        "h2d",
        "handle",
        "in_place",
        "kept",
        "key",
        "loading",
        "modified",
        "nbytes",
        "out",
        "padded",
        "pages",
        "pinned_resident",
        "prefetched",
        "refs",
        "resident",
        "resident_bytes",
        "resident_is_source",
        "seq",
        "skew",
        "slots_read",
        "source",
        "source_ptr",
        "stream",
        "unconsumed",
        "version",
    )

    def __init__(
        self, seq: int, nbytes: int, device: torch.device, chunk_bytes: int, skew: int = 0
    ) -> None:
        self.seq = seq
        self.nbytes = nbytes
        self.skew = skew  # where the storage's bytes start in the record (see above)
        self.padded = round_up(skew + nbytes)
        self.device = device
        self.chunks = [
            Chunk(k, min(chunk_bytes, self.padded - start))
            for k, start in enumerate(range(0, self.padded, chunk_bytes))
        ]
        self.refs = 0
        self.key: tuple[Any, ...] | None = None
        self.kept = False  # held as saved, only counted (a plan's keep; tier keep without dedup)
        self.out = Out.PENDING  # a kept one (a plan's keep) is made HELD at pack
        self.back = Back.ABSENT
        self.resident: torch.Tensor | None = None  # uint8, padded bytes, on host or device
        self.resident_bytes = 0
        self.loading = 0  # reads in flight into ``resident``
        self.gen = 0  # bumped on each load; refs remember which load they consumed
        self.unconsumed = 0
        self.prefetched = False
        self.pinned_resident = False  # the only copy is ``resident`` (a write was cancelled)
        self.error: BaseException | None = None
        self.modified = False
        self.freed = False
        self.copy_done: Any = None  # async devices: the copy into staging (see ordering.py)
        self.direct = False  # CUDA with GDS: written from and read into device memory
        self.direct_pending = 0  # GDS writes in flight
        self.direct_source: tuple[torch.Tensor, int] | None = None  # (tensor, version at pack)
        self.in_place = False  # CPU, zero-copy: written from the tensor's own pages
        self.pages: list[int] = []  # in place: bounce pages of the record's unaligned ends
        self.resident_is_source = False  # ``resident`` is the source's storage (forwarded)
        self.source: torch.Tensor | None = None  # the saved tensor until captured (or held)
        self.source_ptr = 0  # its storage's address at pack
        self.version = 0  # its version counter at pack
        self.stream: Any = None  # async devices: the producer (the stream current at pack)
        # Async devices, ``resident`` on the device: (the event its copy from the slots ends
        # with, or None if it was made on the consumer's stream; the stream it was allocated
        # on). None while ``resident`` is host memory still to be copied up at unpack.
        self.h2d: tuple[Any, Any] | None = None
        self.slots_read: Any = None  # the event of the last copy out of the slots to the device
        self.handle: torch.Tensor | None = None  # shares the saved tensor's version counter

    def move_out(self, new: Out) -> None:
        """The write side's next stage (see [a block's two sides]; lock held)."""
        assert new in _OUT_MOVES[self.out], f"block {self.seq}: out {self.out.name}->{new.name}"
        self.out = new

    def move_back(self, new: Back) -> None:
        """The read side's next stage (see [a block's two sides]; lock held)."""
        assert new in _BACK_MOVES[self.back], f"block {self.seq}: back {self.back.name}->{new.name}"
        self.back = new

    def copy_completed(self) -> bool:
        """True unless an asynchronous copy into staging is still running (never waits)."""
        return self.copy_done is None or bool(self.copy_done.done(wait=False))

    def upload_pending(self) -> bool:
        """Whether a copy out of the slots to the device may still be reading them."""
        if self.slots_read is not None and self.slots_read.query():
            self.slots_read = None
        return self.slots_read is not None


class BlockMap:
    """The live blocks by ``seq``, and their seqs in order (lock held for every call)."""

    def __init__(self) -> None:
        self._blocks: dict[int, Block] = {}
        self._order: list[int] = []
        self._seq = 0

    def new(self, nbytes: int, device: torch.device, chunk_bytes: int, skew: int = 0) -> Block:
        """A block with the next seq, registered, holding one ref."""
        self._seq += 1
        block = Block(self._seq, nbytes, device, chunk_bytes, skew)
        block.refs = 1
        self._blocks[block.seq] = block
        # Usually the largest seq, but threads packing at once can register out of order.
        bisect.insort(self._order, block.seq)
        return block

    def forget(self, block: Block) -> None:
        if self._blocks.pop(block.seq, None) is not None:
            i = bisect.bisect_left(self._order, block.seq)
            if i < len(self._order) and self._order[i] == block.seq:
                del self._order[i]

    def __iter__(self) -> Iterator[Block]:
        """Live blocks, oldest first."""
        return (self._blocks[seq] for seq in self._order)

    def any_loading(self) -> bool:
        return any(b.loading for b in self._blocks.values())

    def position_below(self, seq: int) -> int:
        """Index in pack order of the last block packed before ``seq`` (-1 if none)."""
        return bisect.bisect_left(self._order, seq) - 1

    def at(self, i: int) -> Block:
        return self._blocks[self._order[i]]

    def seq_at(self, i: int) -> int:
        return self._order[i]
