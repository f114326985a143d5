"""Where relayed weights lie while they are in use: :class:`Slabs`.

Note [slabs]
~~~~~~~~~~~~
A group's weights come back into a slab: page-aligned memory that the engine reads into with
O_DIRECT (or the host store copies into), and that the weights' tensors are views of. A slab is
kept for good once mapped (up to ``keep`` idle ones a size; more are unmapped), with a tensor
over it and the views a group's weights take of it, made once per layout and reused at every
swap (:meth:`Slabs.views`): a swap sets each parameter's ``.data`` to a view made before.

What is handed out is a handle, an alias of the slab's tensor (:meth:`Slabs.take`). A slab is in
use while anything other than the pool shares its storage: a handle (a read in flight, a group
swapped in, a slab kept for backward), a parameter swapped in, an unpacked weight autograd
holds in backward, a storage object anyone kept (``untyped_storage()``: torch keeps one Python
object a storage, so its references are counted, not the storage's). The pool asks those counts
at the next :meth:`take` (no callback in whatever thread dropped the last tensor), so what relay
holds is known exactly, whoever held the weights last, and a slab's pages stay warm for the next
group of its size.

Note [write guard]
~~~~~~~~~~~~~~~~~~
A write through ``weight.data`` bumps no version counter, so autograd cannot see it. A slab is
therefore one memfd mapped twice: the weights view a private mapping kept read-only, and reads
land in a shared writable mapping of the same pages (:meth:`Slabs.target`; dropped in a forked
child, ``MADV_DONTFORK``), so the guard costs no system call a swap. The first write through a
weight faults into csrc/write_guard's handler, which records the address and makes the mapping
writable, so the write goes ahead into a private copy of the page while the shared page (what
the next read lands in) stays as it was. :meth:`Slabs.swap_out` tells relay whether and where the
slab was written (in forward it raises naming the weight; in a load it writes the group again).
A write noted stays noted, the slab guarded again or not, until :meth:`take` drops the private
pages (``MADV_DONTNEED``) and makes the mapping read-only again before the slab is read into
again. ``resident()`` disarms its slabs
(a system call writing into a read-only weight fails with EFAULT) and compares each group with
the store on exit. Without the native module or memfd, a slab is one private mapping and nothing
is guarded: relay then cannot see such writes in forward (docs/relay.md).

A forked child (a DataLoader worker, a forked server) has no shared mapping: its pool forgets the
parent's slabs, and a slab in use at the fork gets private anonymous pages with its bytes, so the
child's writes and the parent's next reads never meet.
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from typing import Any

import torch

from offloadd.io.buffers import ALIGN, round_up
from offloadd.relay.groups import view_of
from offloadd.relay.slab import Slab, use_count

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
    """Page-aligned slabs, kept and handed out again (see Note [slabs]). Thread-safe."""

    def __init__(self, keep: int) -> None:
        self.keep = keep
        # reentrant: a collection inside a held lock may run a finalizer that closes the pool
        # (relay's, when a model is dropped)
        self._lock = threading.RLock()
        self._sizes: dict[int, list[Slab]] = {}  # padded size -> its slabs, mapped
        self._by_storage: dict[int, Slab] = {}  # a slab's storages -> the slab
        self._padded: dict[int, int] = {}  # nbytes -> padded(nbytes)
        self.mapped_bytes = 0
        self.peak_bytes = 0
        self.guarding = can_guard() and hasattr(os, "memfd_create")
        _POOLS.add(self)

    @property
    def held_bytes(self) -> int:
        with self._lock:
            self._trim()
            return self.mapped_bytes

    @property
    def live_bytes(self) -> int:
        """The bytes of the slabs in use now."""
        with self._lock:
            return sum(s.size for slabs in self._sizes.values() for s in slabs if not s.free())

    def take(self, nbytes: int, *, writable: bool = False) -> torch.Tensor:
        """A uint8 tensor of ``padded(nbytes)`` bytes, page-aligned, held until it (and every
        tensor on its storage) is dropped. What weights view is read-only where guarded: read
        into it at :meth:`target`; ``writable``: the writable mapping of it, for a record to be
        written (its tensor is filled, then written)."""
        return self._take(nbytes, writable)[0]

    def take_to(self, nbytes: int) -> tuple[torch.Tensor, int]:
        """:meth:`take`, and the address to read into it (:meth:`target`)."""
        handle, slab = self._take(nbytes, False)
        return handle, slab.target

    def _take(self, nbytes: int, writable: bool) -> tuple[torch.Tensor, Slab]:
        """A handle on a free slab (or a new one) and the slab: the handle is made under the
        lock, so that no other take finds the slab free meanwhile."""
        size = self._padded.get(nbytes)
        if size is None:
            size = self._padded[nbytes] = padded(nbytes)
        with self._lock:
            slabs = self._sizes.get(size)
            if slabs is None:
                slabs = self._sizes[size] = []
            slab = None
            idle = 0
            few = len(slabs) <= self.keep + 1  # then never more than ``keep`` idle besides it
            for s in slabs:
                if s.free():
                    if slab is None:
                        slab = s
                        if few:
                            break
                    else:
                        idle += 1
            if idle > self.keep:  # after a burst (resident()): back to ``keep`` idle
                self._trim_size(slabs, keep=self.keep + 1, spare=slab)
            if slab is not None:
                if slab.guarded:
                    slab.clean()
                return (slab.wtensor if writable else slab.tensor).detach(), slab  # its handle
        slab = self._new(size)  # outside the lock: a mapping and tensors, allocated
        with self._lock:
            self._sizes.setdefault(size, []).append(slab)
            self._by_storage[slab.mine] = self._by_storage[slab.wmine] = slab
            self.mapped_bytes += size
            self.peak_bytes = max(self.peak_bytes, self.mapped_bytes)
            return slab.handle(writable), slab

    def _new(self, size: int) -> Slab:
        if self.guarding:
            try:
                return Slab(size, guarded=True)
            except OSError as err:  # no memfd here (seccomp, gVisor): no guard either
                self.guarding = False
                if not _warned:
                    _warned.append(True)
                    log.warning(
                        "offloadd relay: slabs cannot be mapped twice here (memfd_create: %s), "
                        "so a write through weight.data to a relayed weight in its forward goes "
                        "unseen",
                        err,
                    )
        return Slab(size, guarded=False)

    def target(self, slab: torch.Tensor) -> int:
        """The address a read into ``slab`` (one of this pool's handles) writes to."""
        s = self._by_storage.get(slab.untyped_storage()._cdata)
        return s.target if s is not None else slab.data_ptr()

    def views(self, slab: torch.Tensor, layout: Any, make: Any) -> list[torch.Tensor] | None:
        """The views of ``slab`` a layout takes (``make(tensor)`` makes them), made once a slab
        and kept; None for a tensor that is not a slab of this pool (a device copy)."""
        s = self._viewed(slab)
        return None if s is None else self._kept(s, layout, make)

    def swap_in(
        self, slab: torch.Tensor, layout: Any, make: Any, guard: bool
    ) -> tuple[list[torch.Tensor], int]:
        """What a group swapped in takes in one call: :meth:`views` (``make(slab)``'s for a
        tensor that is not a slab of this pool), the slab guarded (:meth:`guard`) or made
        writable by anyone, a system call included (``resident()``, ``guard=False``), and its
        storage's key for :meth:`swap_out`."""
        key = slab.untyped_storage()._cdata
        s = self._by_storage.get(key)
        if s is None:
            return make(slab), key
        # kept views looked up here first, a call less a swap
        views = make(slab) if s.mine != key else s.views.get(layout) or self._kept(s, layout, make)
        if guard:
            s.guard()
        else:
            s.disarm()
        return views, key

    def swap_out(self, slab: torch.Tensor, key: int) -> int | None:
        """The offset of the first write into guarded ``slab`` so far, or None; ``key``: its
        storage's, as :meth:`swap_in` gave it (:meth:`written` asks it of the slab)."""
        s = self._by_storage.get(key)
        at = s.written() if s is not None else 0
        return at - slab.data_ptr() if at else None

    def view(self, slab: torch.Tensor, geometry: tuple[Any, ...]) -> torch.Tensor:
        """A new tensor on ``slab`` of ``geometry`` (dtype, storage offset, sizes, strides),
        made from one kept for the slab (a device copy's: made now). New, so that it holds the
        slab as long as whoever it is given to keeps it."""
        s = self._viewed(slab)
        if s is None:
            return view_of(slab, geometry)
        kept = s.views.get(geometry) or self._kept(s, geometry, lambda t: [view_of(t, geometry)])
        return kept[0].detach()

    def _viewed(self, slab: torch.Tensor) -> Slab | None:
        """The slab whose read-only mapping (what weights view) ``slab`` is on, or None."""
        key = slab.untyped_storage()._cdata
        s = self._by_storage.get(key)
        return s if s is not None and s.mine == key else None

    def _kept(self, s: Slab, key: Any, make: Any) -> list[torch.Tensor]:
        got = s.views.get(key)
        if got is None:
            with self._lock:  # the pool's count moves with its views: no take reads it between
                before = use_count(s.mine)
                try:
                    if len(s.views) >= 64:  # layouts and saved views of the size: not for ever
                        s.views.clear()
                    got = s.views[key] = make(s.tensor)
                finally:  # whatever make did, the count is the pool's own again
                    s.base += use_count(s.mine) - before
        return got

    def _slab(self, slab: torch.Tensor) -> Slab | None:
        return self._by_storage.get(slab.untyped_storage()._cdata)

    def guard(self, slab: torch.Tensor) -> bool:
        """Note writes into ``slab`` from now on (Note [write guard]; a write noted before stays);
        False where it cannot be guarded."""
        s = self._slab(slab)
        return s is not None and s.guard()

    def guarded(self, slab: torch.Tensor) -> bool:
        """Whether ``slab`` is guarded now (its writes are seen)."""
        s = self._slab(slab)
        return s is not None and s.slot is not None

    def written(self, slab: torch.Tensor) -> int | None:
        """The offset of the first write into guarded ``slab`` so far, or None."""
        return self.swap_out(slab, slab.untyped_storage()._cdata)

    def _trim(self) -> None:
        """Unmap the idle slabs beyond ``keep`` a size (lock held)."""
        for slabs in self._sizes.values():
            self._trim_size(slabs, self.keep)

    def _trim_size(self, slabs: list[Slab], keep: int, spare: Slab | None = None) -> None:
        idle = [s for s in slabs if s.free()]
        if spare is not None:  # kept first
            idle.remove(spare)
            idle.insert(0, spare)
        for s in idle[keep:]:
            slabs.remove(s)
            self._forget(s)
            s.close()

    def _forget(self, s: Slab) -> None:
        self._by_storage.pop(s.mine, None)
        self._by_storage.pop(s.wmine, None)
        self.mapped_bytes -= s.size

    def reset_peak(self) -> None:
        with self._lock:
            self._trim()
            self.peak_bytes = self.mapped_bytes

    def close(self) -> None:
        """Unmap every slab (one still viewed goes when its last tensor dies)."""
        with self._lock:
            sizes, self._sizes = self._sizes, {}
            for slabs in sizes.values():
                for s in slabs:
                    self._forget(s)
                    s.close()

    def forget_in_child(self) -> None:
        """In a forked child: none of the parent's slabs is handed out again, and those in use
        get private pages (Note [write guard])."""
        sizes, self._sizes = self._sizes, {}
        self._by_storage = {}
        self._lock = threading.RLock()
        self.mapped_bytes = 0
        for slabs in sizes.values():
            for s in slabs:
                if s.guarded and not s.free():
                    s.privatize()


_POOLS: weakref.WeakSet[Slabs] = weakref.WeakSet()  # every pool alive, for a fork


def _forget_in_child() -> None:
    for pool in list(_POOLS):
        pool.forget_in_child()


os.register_at_fork(after_in_child=_forget_in_child)
