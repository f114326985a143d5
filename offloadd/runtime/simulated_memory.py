"""The simulated device's memory: a caching allocator with the reuse rules of CUDA's.

A buffer is handed out on the stream current where it is allocated. Once its last tensor died
it goes back to that stream's cache at once, and the next allocation of that stream may get it:
that stream's later work is ordered after everything queued on it before the free, and nothing
else is. A buffer marked with ``record_stream`` (``Ordering.hold``) as used by other streams
goes back only once events recorded on those streams at the free completed. A buffer is never
handed to another stream's allocation, and its memory is never given back: a copy queued into
a buffer freed meanwhile writes memory that may already be someone else's, as on CUDA.
"""

from __future__ import annotations

import threading
import weakref
import zlib
from typing import Any

import numpy as np
import torch

from offloadd.runtime.simulated_streams import SimulatedEvent, SimulatedStream

__all__ = ["Segment", "SimulatedMemory"]

_ROUND = 512  # CUDA's caching allocator rounds requests up to this


class Segment:
    """One buffer of the cache: its memory and, while it is handed out, its owner."""

    __slots__ = ("address", "array", "capacity", "generation", "live", "nbytes", "stream", "users")

    def __init__(self, capacity: int) -> None:
        self.array = np.zeros(capacity, dtype=np.uint8)
        self.address = int(self.array.ctypes.data)
        self.capacity = capacity
        self.generation = 0  # bumped each time it is handed out
        self.live = False
        self.nbytes = 0
        self.stream: SimulatedStream | None = None  # the allocating stream
        self.users: set[SimulatedStream] = set()  # streams recorded by hold()

    def bytes(self, offset: int = 0, nbytes: int | None = None) -> torch.Tensor:
        """Its memory as a tensor that does not keep the handed-out buffer alive."""
        end = self.capacity if nbytes is None else offset + nbytes
        return torch.from_numpy(self.array[offset:end])

    def checksum(self, nbytes: int) -> int:
        return zlib.crc32(self.array[:nbytes].data)


class SimulatedMemory:
    """The caching allocator (see the module's docstring)."""

    def __init__(self) -> None:
        self._lock = threading.RLock()  # a buffer can die on any thread, this one included
        self._segments: dict[int, Segment] = {}  # address -> segment
        self._cached: dict[SimulatedStream, list[Segment]] = {}  # free, by allocating stream
        self._pending: list[tuple[Segment, list[SimulatedEvent]]] = []  # freed, still in use
        self.allocations = 0
        self.reuses = 0  # allocations served by a buffer freed before

    def allocate(self, nbytes: int, stream: SimulatedStream) -> torch.Tensor:
        """A uint8 buffer of ``nbytes`` for work on ``stream``: the most recently freed cached
        buffer of that stream that fits best, else a new one."""
        with self._lock:
            self._collect()
            cached = self._cached.setdefault(stream, [])
            best: Segment | None = None
            for seg in reversed(cached):
                if seg.capacity >= nbytes and (best is None or seg.capacity < best.capacity):
                    best = seg
            if best is not None:
                cached.remove(best)
                self.reuses += 1
            else:
                best = Segment(-(-max(nbytes, 1) // _ROUND) * _ROUND)
                self._segments[best.address] = best
            best.generation += 1
            best.live = True
            best.nbytes = nbytes
            best.stream = stream
            best.users = set()
            self.allocations += 1
            view = best.array[:nbytes]
            weakref.finalize(view, self._release, best)  # once no tensor uses the buffer
            return torch.from_numpy(view)

    def segment_of(self, t: torch.Tensor) -> Segment | None:
        """The live buffer ``t`` is a view of, if any."""
        try:
            address = t.untyped_storage().data_ptr()
        except Exception:  # no storage (a version handle, a subclass)
            return None
        seg = self._segments.get(address)
        return seg if seg is not None and seg.live else None

    def hold(self, t: torch.Tensor, stream: Any) -> None:
        """``record_stream``: the buffer is not reused before ``stream``'s work queued up to its
        free completed. Other memory is not the allocator's: nothing to do."""
        with self._lock:
            seg = self.segment_of(t)
            if seg is not None and isinstance(stream, SimulatedStream):
                seg.users.add(stream)

    def _release(self, seg: Segment) -> None:
        with self._lock:
            seg.live = False
            users = [s for s in seg.users if s is not seg.stream]
            if users:
                self._pending.append((seg, [s.record() for s in users]))
            else:
                assert seg.stream is not None
                self._cached.setdefault(seg.stream, []).append(seg)

    def _collect(self) -> None:
        """Cache the held buffers whose streams have passed their free (never waits)."""
        still = []
        for seg, events in self._pending:
            if all(ev.query() for ev in events):
                assert seg.stream is not None
                self._cached.setdefault(seg.stream, []).append(seg)
            else:
                still.append((seg, events))
        self._pending = still
