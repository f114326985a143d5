"""Saved tensors kept as they are: the handle pack returns for them, and the tally of their bytes.

Note: [the tally] Most saved tensors are small and stay where they are. For each, pack must
remember the version counter (unpack raises PyTorch's in-place error) and the bytes must count
while autograd holds it (``resident_bytes`` and its peak, ``kept_bytes``, the budget's keep
peak). :meth:`Tally.keep` makes the handle, a :class:`Held`, and adds its bytes; freeing the
Held takes them off, both at once and without the lock (the GIL orders them). The paths that
hold the lock call :meth:`Tally.take` (in ``Lifetime.drain``) and the ledger applies what it
returns (``Ledger.apply_kept``): the tensors and bytes saved since, the bytes held now, and the
highest they reached since. Between two takes the ledger's other bytes change only through
queued releases of offloaded blocks, which only lower them, so the peak it records is the true
one or, where a block was released before small tensors rose to their high, above it.

Tier keep holds every saved tensor where it is, whatever its size, so it needs no block either:
:meth:`Tally.share` keeps it the same way but counts its *storage* once, from its first save
until its last Held goes (views, transposes and other saves of that storage add their bytes to
``deduplicated_bytes``). The storage is known by its StorageImpl's address, which its entry
pins with a weak reference (a Held's tensor may leave that storage, ``x.data = y``, and free
it; no new storage takes the address while the entry lives). Nothing moves, so no version or root enters
the key (compare [dedup identity] in dedup.py, for bytes that leave and come back).

The library built from csrc/hot_path/held.c does this in C, several times faster per tensor; where
it is not built, the classes below do the same in Python
(docs/benchmarks/hooks_cpu-2core_2026-12-05.md).
"""

from __future__ import annotations

from typing import Any

from torch.multiprocessing.reductions import StorageWeakRef

__all__ = ["NATIVE", "Held", "Pack", "Tally", "Unpack"]


class _PyTally:
    """The count and bytes of saved tensors kept as they are (see [the tally])."""

    __slots__ = ("deduplicated_bytes", "now", "peak", "saved", "saved_bytes", "shared")

    def __init__(self) -> None:
        self.saved = 0
        self.saved_bytes = 0
        self.deduplicated_bytes = 0
        self.now = 0
        self.peak = 0
        self.shared: dict[int, _PyShared] = {}

    def keep(self, tensor: Any, nbytes: int, resident: int) -> _PyHeld:
        self.saved += 1
        self.saved_bytes += nbytes
        self.now += resident
        if self.now > self.peak:
            self.peak = self.now
        return _PyHeld(tensor, resident, self)

    def share(self, tensor: Any, nbytes: int) -> _PyHeld:
        storage = tensor.untyped_storage()
        entry = self.shared.get(storage._cdata)
        hit = entry is not None
        if entry is None:
            entry = self.shared[storage._cdata] = _PyShared(storage)
        entry.count += 1  # claimed before keep, whose detach may run a release (see held.c)
        try:
            held = self.keep(tensor, nbytes, 0 if hit else entry.nbytes)
        except BaseException:
            entry.count -= 1
            if entry.count == 0:
                if hit:
                    self.now -= entry.nbytes
                entry.forget(self)
            raise
        if hit:
            self.deduplicated_bytes += nbytes
        held.nbytes = 0  # the entry's, taken off when its last Held goes
        held.shared = entry
        return held

    def take(self) -> tuple[int, int, int, int, int]:
        out = (self.saved, self.saved_bytes, self.deduplicated_bytes, self.now, self.peak)
        self.saved = self.saved_bytes = self.deduplicated_bytes = 0
        self.peak = self.now
        return out


class _PyShared:
    """One storage held through ``Tally.share``, and how many Helds hold it; its weak reference
    pins the address ``key`` (see held.c's Shared)."""

    __slots__ = ("count", "key", "nbytes", "weak")

    def __init__(self, storage: Any) -> None:
        self.key = storage._cdata
        self.nbytes = storage.nbytes()
        self.weak = StorageWeakRef(storage)
        self.count = 0

    def forget(self, tally: _PyTally) -> None:
        if tally.shared.get(self.key) is self:
            del tally.shared[self.key]


class _PyHeld:
    """A saved tensor kept as it is (made by ``Tally.keep``)."""

    __slots__ = ("nbytes", "shared", "tally", "tensor", "version")

    def __init__(self, tensor: Any, nbytes: int, tally: _PyTally) -> None:
        # see [no cycle through the graph] in identity.py
        self.tensor = tensor.detach() if tensor.requires_grad else tensor
        self.version = tensor._version
        self.nbytes = nbytes
        self.tally = tally
        self.shared: _PyShared | None = None

    def __del__(self) -> None:
        tally = self.tally
        tally.now -= self.nbytes
        shared = self.shared
        if shared is not None:
            shared.count -= 1
            if shared.count == 0:
                tally.now -= shared.nbytes
                shared.forget(tally)


def _load() -> tuple[Any, Any, Any, Any, bool]:
    """The C library's Tally, Held, Pack and Unpack, or the Python Tally and Held and no hooks
    (offloadd's hooks are then Python functions, see ``Hooks.pair`` in hooks.py)."""
    try:
        from offloadd.runtime import _held
    except ImportError:  # not built (docs/native.md)
        return _PyTally, _PyHeld, None, None, False
    if getattr(_held, "VERSION", 0) < 2:  # a stale build
        return _PyTally, _PyHeld, None, None, False
    return _held.Tally, _held.Held, _held.Pack, _held.Unpack, True


Tally, Held, Pack, Unpack, NATIVE = _load()
