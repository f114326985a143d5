"""Where relayed weights lie while they are in use: :class:`Slabs`.

Note [slabs]
~~~~~~~~~~~~
A group's weights come back into a slab: page-aligned private anonymous memory (``mmap``; a forked
child's writes stay in its copy) that the engine reads into with O_DIRECT, and that the weights'
tensors are views of. A slab is handed out as a tensor made by ``torch.frombuffer`` over a
``memoryview``; the tensor's storage holds that view until the last tensor on it dies (a parameter
swapped out after forward, an unpacked weight autograd let go of in backward), and the callback
of a weak reference to the view then gives the slab back. So what relay holds is known exactly, whoever held the weights
last, and a slab's pages stay warm for the next group of its size (up to ``keep`` idle slabs a
size; more are unmapped).

Note [write guard]
~~~~~~~~~~~~~~~~~~
A write through ``weight.data`` bumps no version counter, so autograd cannot see it. While a
slab is swapped in, relay guards it (:meth:`Slabs.guard`): its pages are read-only, and the
first write faults into csrc/write_guard's handler, which records the address and makes the
slab writable again, so the write goes ahead. :meth:`Slabs.unguard` tells relay whether and
where the slab was written: in forward it raises naming the weight, in a load it writes the
group again. ``resident()`` guards nothing (a system call writing into a guarded weight fails
with EFAULT): it compares each group with the store on exit. A slab is unguarded before it goes
back to the pool, so a slab is never read into or unmapped while guarded. Without the native
module (not built) nothing is guarded: relay then cannot see such writes in forward
(docs/relay.md).
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import threading
import weakref
from collections import deque

import torch

from offloadd.io.buffers import ALIGN, round_up

try:
    from offloadd.relay import _write_guard
except ImportError:  # not built (docs/native.md)
    _write_guard = None  # type: ignore[assignment]

__all__ = ["Slabs"]

log = logging.getLogger("offloadd")
_warned: list[bool] = []


def can_guard() -> bool:
    """Whether slabs can be guarded (the native module is built); warns once if not."""
    if _write_guard is None and not _warned:
        _warned.append(True)
        log.warning(
            "offloadd relay: offloadd.relay._write_guard is not built, so a write through "
            "weight.data to a relayed weight in its forward goes unseen; reinstall offloadd to "
            "build it (docs/native.md)"
        )
    return _write_guard is not None


def padded(nbytes: int) -> int:
    return max(ALIGN, round_up(nbytes))


class Slabs:
    """Page-aligned slabs that come back by themselves (see Note [slabs]). Thread-safe."""

    def __init__(self, keep: int) -> None:
        self.keep = keep
        self._lock = threading.Lock()
        self._idle: dict[int, list[mmap.mmap]] = {}
        # Slabs given back by weak references' callbacks, which may run in any thread, within any allocation
        # (a collection), even one made while this thread holds the lock: they only append.
        self._returned: deque[tuple[mmap.mmap, int]] = deque()
        self.live_bytes = 0
        self.idle_bytes = 0
        self.peak_bytes = 0
        self._slots: dict[int, int] = {}  # a guarded slab's address -> its guard slot
        self._padded: dict[int, int] = {}  # nbytes -> padded(nbytes)
        # the slabs handed out: id of the weak reference to each one's view -> (that reference,
        # its mapping, its size, its address); only take and _back (one dict operation each,
        # atomic under the GIL, as a callback may run in any thread) touch it
        self._out: dict[int, tuple[weakref.ref[memoryview], mmap.mmap, int, int]] = {}
        self.guarding = can_guard()

    @property
    def held_bytes(self) -> int:
        with self._lock:
            self._drain()
            return self.live_bytes + self.idle_bytes

    def take(self, nbytes: int) -> torch.Tensor:
        """A uint8 tensor of ``padded(nbytes)`` bytes, page-aligned."""
        size = self._padded.get(nbytes)
        if size is None:
            size = self._padded[nbytes] = padded(nbytes)
        extra: list[mmap.mmap] = []
        with self._lock:
            if self._returned:
                extra = self._drain()
            idle = self._idle.get(size)
            mm = idle.pop() if idle else None
            if mm is not None:
                self.idle_bytes -= size
            self.live_bytes += size
            if self.live_bytes + self.idle_bytes > self.peak_bytes:
                self.peak_bytes = self.live_bytes + self.idle_bytes
        for old in extra:
            old.close()
        if mm is None:  # private: a forked child writing its copy leaves this one as it is
            mm = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        view = memoryview(mm)
        slab = torch.frombuffer(view, dtype=torch.uint8)
        # a weak reference's callback, not a weakref.finalize (which costs more: see
        # docs/benchmarks/hooks-round2_cpu-2core_2026-12-05.md): the view dies with the slab's
        # storage, and the callback gives the slab back
        ref = weakref.ref(view, self._back)
        self._out[id(ref)] = (ref, mm, size, slab.data_ptr())
        return slab

    def _back(self, ref: weakref.ref[memoryview]) -> None:
        _, mm, size, address = self._out.pop(id(ref))
        slot = self._slots.pop(address, None)
        if slot is not None:  # dropped while guarded (a model dropped mid-forward)
            _write_guard.release(slot)
        self._returned.append((mm, size))

    def guard(self, slab: torch.Tensor) -> bool:
        """Make ``slab`` (one of this pool's, in use) read-only until :meth:`unguard`, noting the
        first write (Note [write guard]); False where it cannot be guarded."""
        address = slab.data_ptr()
        if not self.guarding or slab.device.type != "cpu" or address in self._slots:
            return False
        if address % mmap.PAGESIZE:
            return False
        nbytes = round_up(slab.nbytes, mmap.PAGESIZE)  # its mapping's (64 KiB pages: > padded)
        try:
            self._slots[address] = _write_guard.protect(address, nbytes)
        except (RuntimeError, OSError) as err:  # every slot in use; mprotect failed
            if not _warned:
                _warned.append(True)
                log.warning(
                    "offloadd relay: a slab of %d bytes cannot be guarded (%s), so a write "
                    "through weight.data to its weights in forward goes unseen",
                    slab.nbytes,
                    err,
                )
            return False
        return True

    def guarded(self, slab: torch.Tensor) -> bool:
        """Whether ``slab`` is guarded now (its writes are seen)."""
        return slab.data_ptr() in self._slots

    def written(self, slab: torch.Tensor) -> int | None:
        """The offset of the first write into guarded ``slab`` so far, or None."""
        slot = self._slots.get(slab.data_ptr())
        at = _write_guard.fault(slot) if slot is not None else 0
        return at - slab.data_ptr() if at else None

    def unguard(self, slab: torch.Tensor) -> int | None:
        """Make ``slab`` writable again: the offset of the first write into it since
        :meth:`guard`, or None if it was not written (or not guarded)."""
        slot = self._slots.pop(slab.data_ptr(), None)
        if slot is None:
            return None
        at = _write_guard.release(slot)
        return at - slab.data_ptr() if at else None

    def _drain(self) -> list[mmap.mmap]:
        """Take back the slabs returned (lock held); the ones beyond ``keep`` to unmap."""
        extra = []
        while self._returned:
            mm, size = self._returned.popleft()
            self.live_bytes -= size
            idle = self._idle.setdefault(size, [])
            if len(idle) < self.keep:
                idle.append(mm)
                self.idle_bytes += size
            else:
                extra.append(mm)
        return extra

    def reset_peak(self) -> None:
        with self._lock:
            extra = self._drain()
            self.peak_bytes = self.live_bytes + self.idle_bytes
        for mm in extra:
            mm.close()

    def close(self) -> None:
        """Unmap the idle slabs (live ones are unmapped when their last tensor dies)."""
        with self._lock:
            extra = self._drain()
            idle, self._idle = self._idle, {}
            self.idle_bytes = 0
        idle.setdefault(0, []).extend(extra)
        for slabs in idle.values():
            for mm in slabs:
                with contextlib.suppress(BufferError):  # still viewed: unmapped when collected
                    mm.close()
