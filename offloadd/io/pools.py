"""Warm memory that offloadd recycles: read-back buffers and the bounce pages of zero-copy writes.

Note: [warm buffers] A page touched for the first time costs a fault and a zeroing, so memcpy
into fresh pages runs several times slower than into warm ones
(docs/benchmarks/fastpath_allocator_cpu-2core_2026-11-23.md). A read-back buffer taken from the
C heap is warm only if glibc kept the pages of what was freed, and trimming the heap (to make RSS
drop) hands exactly those pages back. So read-backs
land in buffers of offloadd's own, mapped and touched once, and recycled when autograd frees the
tensors that view them: the heap then holds only the forward window, and nothing needs trimming.

A :class:`ReadPool` buffer is lent as a tensor (:meth:`ReadPool.lend`) whose storage is a window
on the buffer; when the last tensor viewing that storage dies, so does the window, and its lease
puts the buffer back on a return queue (any thread, under the GIL: an append). The owner's lock
guards everything else. Buffers come in size classes (:func:`size_class`: 16 per power of two,
at least a page apart), and a class is served only by its own buffers: a buffer is created only
when more of its class are out at once than ever before, so with the shapes of a training loop
the pool stops growing after the first backward (borrowing a bigger class instead let two
classes take each other's buffers in turn, creating one more every step). The reader asks for
the largest record a block's size can have at any skew, so the class of a block does not depend
on where the allocator happened to put its storage this step (it did: a 64 KiB tensor at a page
boundary fit the 64 KiB class, the same tensor 16 bytes further did not, and the pool grew
whenever the heap's layout changed). A class that two training steps in a row did not take is
unmapped. Steps, not read-ahead sweeps: backward restarts its sweep whenever an unpack jumps
above where the sweep began (a node unpacks its saved tensors in pack order, so once per layer
in a transformer), and aged per sweep, classes would be unmapped and mapped again within every
step, their page faults then most of offloading's cost
(docs/benchmarks/steady_hf-gpt2_cpu-2core_2026-11-26.md).

Note: [one pool] While offloadd's host cache is torch's CPU allocator (runtime/host_allocator.py),
records (always in CPU memory) of the sizes it serves (``host_allocator.MIN_BYTES`` and more) are
taken from the host cache instead (its blocks are page-aligned and warm too), and
freed back to it. Two reserves of warm memory were one too many:
in backward the host cache kept the blocks of the forward's activations, freed once written and
sized like exactly the records being read back, while the read pool mapped more beside them.
One pool lowers ssd's peak RSS, with no blocks mapped after warm-up, provided the host cache's
``SLACK`` leaves room for the records' size classes beside the gradients' (see ``SLACK`` in
runtime/host_allocator.py; docs/benchmarks/steady-pool_hf-gpt2_cpu-2core_2026-11-26.md).
Elsewhere (glibc's heap, which tier ssd keeps where CUDA is available; small records) this pool
serves them as above. A record from the host
cache is in no Stats field but ``resident_bytes`` while it holds a block; its memory is the host
cache's (its live bytes, which the planner's probe reads).
"""

from __future__ import annotations

import ctypes
from collections import deque
from collections.abc import Callable
from typing import Protocol

import torch

from offloadd.io.buffers import ALIGN, AlignedBuffer, round_up
from offloadd.io.hugepages import HUGE_PAGE

__all__ = ["CachedRecord", "PagePool", "Pool", "ReadPool", "size_class"]


def size_class(nbytes: int) -> int:
    """The buffer size that serves ``nbytes``: 16 classes per power of two, steps of at least a
    page (at most 1/16 more than asked)."""
    n = max(nbytes, 1)
    step = max(ALIGN, (1 << (n.bit_length() - 1)) >> 4)
    return round_up(n, step)


class Pool(Protocol):
    """Memory of offloadd's own (these pools, staging slots), counted in the stats."""

    mapped_bytes: int

    def close(self) -> None: ...


class CachedRecord:
    """A read-back record in a block of torch's CPU allocator while that is offloadd's host cache
    (see [one pool]): freed to the cache, not kept by the pool."""

    __slots__ = ("address", "nbytes", "tensor")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        self.address = tensor.data_ptr()
        self.nbytes = tensor.numel()


class _Lease:
    """Owned by a lent window; returns the buffer when the window dies (a cached record goes
    back to the host cache with the lease, its last reference)."""

    __slots__ = ("buffer", "returned")

    def __init__(
        self, buffer: AlignedBuffer | CachedRecord, returned: deque[AlignedBuffer] | None
    ) -> None:
        self.buffer = buffer
        self.returned = returned

    def __del__(self) -> None:
        if self.returned is not None:
            self.returned.append(self.buffer)  # type: ignore[arg-type]


class ReadPool:
    """Recycled, pre-faulted, page-aligned buffers for read-backs (see [warm buffers])."""

    def __init__(self, host_cache: Callable[[int], bool] = lambda nbytes: False) -> None:
        self._host_cache = host_cache  # whether the host cache serves a CPU allocation this size
        self._free: dict[int, list[AlignedBuffer]] = {}
        self._returned: deque[AlignedBuffer] = deque()
        self._used: set[int] = set()  # classes taken since the last step began
        self._used_before: set[int] = set()  # ... during the step before it
        self.mapped_bytes = 0  # every buffer, idle or lent
        self.idle_bytes = 0
        self.created = 0

    def take_record(self, record: int, largest: int) -> AlignedBuffer | CachedRecord:
        """Memory for a read-back record of ``record`` bytes (page-aligned, a whole number of
        pages), ``largest`` the most that records of its block's size can need: from the host
        cache while it is torch's CPU allocator and serves that size, else :meth:`take`."""
        if self._host_cache(record):
            # CPU whatever the default device. (torch.UntypedStorage(n) would skip the fill of
            # torch.use_deterministic_algorithms, but it takes glibc's heap, not the host cache.)
            t = torch.empty(record, dtype=torch.uint8, device="cpu")
            if t.data_ptr() % ALIGN == 0:
                return CachedRecord(t)
        return self.take(largest)

    def take(self, nbytes: int) -> AlignedBuffer:
        """A buffer of at least ``nbytes`` (warm if one of its size class was returned)."""
        self.collect()
        size = size_class(nbytes)
        bufs = self._free.get(size)
        if bufs:
            buf = bufs.pop()
            self.idle_bytes -= buf.nbytes
        else:
            buf = AlignedBuffer(size, huge_pages=size >= HUGE_PAGE)
            self.mapped_bytes += buf.nbytes
            self.created += 1
        self._used.add(size)
        return buf

    def lend(self, buf: AlignedBuffer | CachedRecord, start: int, nbytes: int) -> torch.Tensor:
        """``nbytes`` of ``buf`` from ``start``, as a uint8 tensor with a storage of its own;
        ``buf`` returns to the pool (a cached record: to the host cache) when that storage is
        freed."""
        window = (ctypes.c_char * nbytes).from_address(buf.address + start)
        returned = None if isinstance(buf, CachedRecord) else self._returned
        window._lease = _Lease(buf, returned)  # type: ignore[attr-defined]
        return torch.frombuffer(window, dtype=torch.uint8)

    def collect(self) -> None:
        """Take back the buffers whose lent tensors died (kept warm for their class)."""
        q = self._returned
        while q:
            buf = q.popleft()
            self._free.setdefault(buf.nbytes, []).append(buf)
            self.idle_bytes += buf.nbytes

    def new_step(self) -> None:
        """A training step begins (its forward): unmap the idle buffers of classes that neither
        the last step nor the one before it took (shapes that changed, e.g. sequence length).
        A step that took nothing (its forward was entered again, scope by scope) does not count."""
        if not self._used:
            return
        wanted = self._used | self._used_before
        self._unmap_idle([c for c in self._free if c not in wanted])
        self._used_before, self._used = self._used, set()

    def release_idle(self) -> None:
        """Unmap every idle buffer (nothing will be read back for a while)."""
        self._unmap_idle(list(self._free))

    def close(self) -> None:
        self.release_idle()

    def _unmap_idle(self, classes: list[int]) -> None:
        """Unmap the idle buffers of ``classes`` (after taking back what was returned)."""
        self.collect()
        for size in classes:
            for buf in self._free.pop(size, []):
                buf.close()
                self.mapped_bytes -= buf.nbytes
                self.idle_bytes -= buf.nbytes


class PagePool:
    """4096-byte bounce pages for the unaligned ends of zero-copy writes, grown 64 at a time."""

    def __init__(self, pages_per_buffer: int = 64) -> None:
        self._grow = pages_per_buffer
        self._buffers: list[AlignedBuffer] = []
        self._free: list[int] = []
        self.mapped_bytes = 0

    def acquire(self) -> int:
        """The address of a free page (zeroed by the caller as needed)."""
        if not self._free:
            buf = AlignedBuffer(self._grow * ALIGN)
            self._buffers.append(buf)
            self.mapped_bytes += buf.nbytes
            self._free.extend(buf.address + i * ALIGN for i in range(self._grow - 1, -1, -1))
        return self._free.pop()

    def release(self, address: int) -> None:
        self._free.append(address)

    @staticmethod
    def page(address: int) -> torch.Tensor:
        """The page at ``address`` as a uint8 tensor (valid while its pool is open)."""
        window = (ctypes.c_char * ALIGN).from_address(address)
        return torch.frombuffer(window, dtype=torch.uint8)

    def close(self) -> None:
        for buf in self._buffers:
            buf.close()
        self._buffers.clear()
        self._free.clear()
        self.mapped_bytes = 0
