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

import mmap
import threading
import weakref

import torch

__all__ = ["Slabs"]

PAGE = 4096


def padded(nbytes: int) -> int:
    return max(PAGE, -(-nbytes // PAGE) * PAGE)


class Slabs:
    """Page-aligned slabs that come back by themselves (see Note [slabs]). Thread-safe."""

    def __init__(self, keep: int) -> None:
        self.keep = keep
        self._lock = threading.Lock()
        self._idle: dict[int, list[mmap.mmap]] = {}
        self.live_bytes = 0
        self.idle_bytes = 0
        self.peak_bytes = 0

    @property
    def held_bytes(self) -> int:
        return self.live_bytes + self.idle_bytes

    def take(self, nbytes: int) -> torch.Tensor:
        """A uint8 tensor of ``padded(nbytes)`` bytes, page-aligned."""
        size = padded(nbytes)
        with self._lock:
            idle = self._idle.get(size)
            mm = idle.pop() if idle else None
            if mm is not None:
                self.idle_bytes -= size
            self.live_bytes += size
            self.peak_bytes = max(self.peak_bytes, self.held_bytes)
        if mm is None:
            mm = mmap.mmap(-1, size)
        view = memoryview(mm)
        slab = torch.frombuffer(view, dtype=torch.uint8)
        weakref.finalize(view, self._back, mm, size)
        return slab

    def _back(self, mm: mmap.mmap, size: int) -> None:
        with self._lock:
            self.live_bytes -= size
            idle = self._idle.setdefault(size, [])
            if len(idle) < self.keep:
                idle.append(mm)
                self.idle_bytes += size
                return
        mm.close()

    def reset_peak(self) -> None:
        with self._lock:
            self.peak_bytes = self.held_bytes

    def close(self) -> None:
        """Unmap the idle slabs (live ones are unmapped when their last tensor dies)."""
        with self._lock:
            idle, self._idle = self._idle, {}
            self.idle_bytes = 0
        for slabs in idle.values():
            for mm in slabs:
                mm.close()
