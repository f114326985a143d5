"""Page-aligned, pre-faulted host memory: the staging pool that every write goes through.

Note: [why a pool] Pinning or even allocating host memory per tensor costs more than the copy
it serves (torchtune#2076), and O_DIRECT needs 4096-aligned addresses, which torch's CPU
allocator does not give (it aligns to 64). So the pool is one anonymous mmap, touched once at
creation, cut into fixed-size slots; a block larger than a slot spans several slots, which need
not be adjacent, so the pool never fragments.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import mmap
import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

from offloadd.io.hugepages import prefer_huge_pages

if TYPE_CHECKING:
    import torch

__all__ = ["ALIGN", "AlignedBuffer", "SlotPool", "address_view", "copy_bytes", "round_up"]

ALIGN = 4096


def round_up(n: int, align: int = ALIGN) -> int:
    return (n + align - 1) // align * align


class AlignedBuffer:
    """``nbytes`` of page-aligned, pre-faulted memory, seen as a uint8 tensor on first use (the
    daemon never asks: it serves without importing torch).

    Anonymous by default; with ``fd`` (e.g. a memfd the daemon shares), that file mapped shared,
    and the buffer owns the descriptor (closed by :meth:`close`). ``huge_pages``: its whole
    2 MiB pages are faulted as huge pages where the kernel allows (see [huge-page buffers])."""

    def __init__(self, nbytes: int, *, fd: int = -1, huge_pages: bool = False) -> None:
        self.nbytes = round_up(max(nbytes, ALIGN))
        self.fd = fd
        self._mmap: mmap.mmap | None = (
            mmap.mmap(-1, self.nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            if fd < 0
            else mmap.mmap(fd, self.nbytes, flags=mmap.MAP_SHARED)
        )
        first = ctypes.c_char.from_buffer(self._mmap)  # an export: gone before close()
        self.address: int = ctypes.addressof(first)
        del first
        assert self.address % ALIGN == 0
        if huge_pages:
            prefer_huge_pages(self.address, self.nbytes)
        # pre-fault every page now, not on the I/O path: with torch's threads where the process
        # has torch (twice as fast as one memset on two cores), else with one memset
        if "torch" in sys.modules:
            self.tensor.fill_(0)
        else:
            ctypes.memset(self.address, 0, self.nbytes)
        self._pinned = False

    @functools.cached_property
    def tensor(self) -> torch.Tensor:
        """The buffer as a uint8 tensor (torch imported here, on first use). Its storage holds
        a memoryview, an export of the mmap: :meth:`close` then leaves the memory mapped until
        the last tensor viewing it dies (``torch.frombuffer`` over the mmap itself holds none,
        and closing unmapped the memory under live views)."""
        import torch

        assert self._mmap is not None, "the buffer is closed"
        return torch.frombuffer(memoryview(self._mmap), dtype=torch.uint8)

    def pin(self) -> None:
        """Register the buffer with CUDA as page-locked (no-op without CUDA or when done)."""
        import torch

        if self._pinned or not torch.cuda.is_available():
            return
        rc = torch.cuda.cudart().cudaHostRegister(self.address, self.nbytes, 0)
        if int(rc) != 0:
            raise RuntimeError(f"cudaHostRegister of {self.nbytes} bytes failed with code {rc}")
        self._pinned = True

    def close(self) -> None:
        if self._mmap is None:
            return
        if self._pinned:
            import torch

            torch.cuda.cudart().cudaHostUnregister(self.address)
            self._pinned = False
        self.__dict__.pop("tensor", None)
        # still viewed (an export): unmapped when the last tensor on it dies, which drops the
        # memoryview and then the mmap
        with contextlib.suppress(BufferError):
            self._mmap.close()
        self._mmap = None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class SlotPool:
    """Fixed-size slots of one :class:`AlignedBuffer`. Not thread-safe: the owner's lock guards it."""

    def __init__(self, total_bytes: int, slot_bytes: int) -> None:
        if slot_bytes % ALIGN:
            raise ValueError(f"slot size must be a multiple of {ALIGN}, got {slot_bytes}")
        self.slot_bytes = slot_bytes
        self.num_slots = max(1, total_bytes // slot_bytes)
        self.buffer = AlignedBuffer(self.num_slots * slot_bytes)
        self.mapped_bytes = self.buffer.nbytes
        self._free = list(range(self.num_slots - 1, -1, -1))

    def acquire(self) -> int | None:
        return self._free.pop() if self._free else None

    def release(self, slot: int) -> None:
        self._free.append(slot)

    def tensor(self, slot: int, nbytes: int) -> torch.Tensor:
        start = slot * self.slot_bytes
        return self.buffer.tensor[start : start + nbytes]

    def address(self, slot: int) -> int:
        return self.buffer.address + slot * self.slot_bytes

    def close(self) -> None:
        self.buffer.close()


def _copier() -> Callable[[int, int, int], object]:
    try:
        from offloadd.io._native import copy
    except ImportError:  # not built (docs/native.md): ctypes' costs a microsecond more a call
        return ctypes.memmove
    return copy


copy_bytes = _copier()
"""``copy_bytes(dst, src, nbytes)``: copy ``nbytes`` between two addresses of this process."""


def address_view(address: int, nbytes: int) -> memoryview:
    """A writable memoryview of raw memory (for os.pwrite/os.preadv). The caller keeps it alive."""
    return memoryview((ctypes.c_char * nbytes).from_address(address)).cast("B")
