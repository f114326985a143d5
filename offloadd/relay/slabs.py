"""Where relayed weights lie while they are in use: :class:`Slabs`.

Note [slabs]
~~~~~~~~~~~~
A group's weights come back into a slab: page-aligned anonymous memory (``mmap``) that the
engine reads into with O_DIRECT, and that the weights' tensors are views of. A slab is handed
out as a tensor made by ``torch.frombuffer`` over a ``memoryview``; the tensor's storage holds
that view until the last tensor on it dies (a parameter swapped out after forward, an unpacked
weight autograd let go of in backward), and a finalizer on the view then gives the slab back.
So what relay holds is known exactly, whoever held the weights last, and a slab's pages stay
warm for the next group of its size (up to ``keep`` idle slabs a size; more are unmapped).
"""

from __future__ import annotations

import contextlib
import mmap
import threading
import weakref
from collections import deque

import torch

from offloadd.io.buffers import ALIGN, round_up

__all__ = ["Slabs"]


def padded(nbytes: int) -> int:
    return max(ALIGN, round_up(nbytes))


class Slabs:
    """Page-aligned slabs that come back by themselves (see Note [slabs]). Thread-safe."""

    def __init__(self, keep: int) -> None:
        self.keep = keep
        self._lock = threading.Lock()
        self._idle: dict[int, list[mmap.mmap]] = {}
        # Slabs given back by finalizers, which may run in any thread, within any allocation
        # (a collection), even one made while this thread holds the lock: they only append.
        self._returned: deque[tuple[mmap.mmap, int]] = deque()
        self.live_bytes = 0
        self.idle_bytes = 0
        self.peak_bytes = 0

    @property
    def held_bytes(self) -> int:
        with self._lock:
            self._drain()
            return self.live_bytes + self.idle_bytes

    def take(self, nbytes: int) -> torch.Tensor:
        """A uint8 tensor of ``padded(nbytes)`` bytes, page-aligned."""
        size = padded(nbytes)
        extra: list[mmap.mmap] = []
        with self._lock:
            extra = self._drain()
            idle = self._idle.get(size)
            mm = idle.pop() if idle else None
            if mm is not None:
                self.idle_bytes -= size
            self.live_bytes += size
            self.peak_bytes = max(self.peak_bytes, self.live_bytes + self.idle_bytes)
        for old in extra:
            old.close()
        if mm is None:
            mm = mmap.mmap(-1, size)
        view = memoryview(mm)
        slab = torch.frombuffer(view, dtype=torch.uint8)
        weakref.finalize(view, self._back, mm, size).atexit = False  # at exit it is still in use
        return slab

    def _back(self, mm: mmap.mmap, size: int) -> None:
        self._returned.append((mm, size))

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
