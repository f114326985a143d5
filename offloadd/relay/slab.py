"""One slab of relay's pool: :class:`Slab`, its memory mapped twice and its write guard (Note
[slabs] and Note [write guard] in slabs.py)."""

from __future__ import annotations

import contextlib
import ctypes
import logging
import mmap
import os
import sys
from typing import Any

import torch

from offloadd.io.buffers import round_up

try:
    from offloadd.relay import _write_guard
except ImportError:  # not built (docs/native.md): slabs are then never guarded
    _write_guard = None  # type: ignore[assignment]

__all__ = ["Slab", "use_count"]

log = logging.getLogger("offloadd")
_warned: list[bool] = []
use_count = torch._C._storage_Use_Count
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int]
_libc.mmap.argtypes += [ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_MAP_FIXED = 0x10
_RW = mmap.PROT_READ | mmap.PROT_WRITE


def _map(size: int, flags: int, fd: int = -1, at: int | None = None) -> int:
    address = _libc.mmap(at, size, _RW, flags | (_MAP_FIXED if at else 0), fd, 0)
    if address in (None, ctypes.c_void_p(-1).value):
        err = ctypes.get_errno()
        raise OSError(err, f"offloadd relay: mapping a slab of {size} bytes: {os.strerror(err)}")
    return int(address)


_MFD_NOEXEC_SEAL = 0x8  # Linux 6.3: refused with EACCES under vm.memfd_noexec=2 without it


def _memfd() -> int:
    """A memfd for a slab; OSError where the kernel refuses one (seccomp, gVisor: ENOSYS,
    EPERM)."""
    try:
        return os.memfd_create("offloadd-slab", os.MFD_CLOEXEC | _MFD_NOEXEC_SEAL)
    except OSError:  # a kernel before 6.3 knows no NOEXEC_SEAL (EINVAL)
        return os.memfd_create("offloadd-slab", os.MFD_CLOEXEC)


class _Mapping:
    """A slab's memory: its private mapping (what weights view) and, where guarded, the shared
    one reads land in. Every tensor over either holds it, and it unmaps both when the last is
    gone (the shared one only in the process that made it: a forked child has none)."""

    __slots__ = ("pid", "ro", "rw", "size")

    def __init__(self, size: int, fd: int | None) -> None:
        """``fd``: a memfd of ``size`` bytes to map twice; None: one private mapping."""
        self.size, self.pid, self.ro, self.rw = size, os.getpid(), 0, 0
        if fd is None:  # private: a forked child writing its copy leaves this one as it is
            self.ro = _map(size, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            return
        self.ro = _map(size, mmap.MAP_PRIVATE, fd)
        self.rw = _map(size, mmap.MAP_SHARED, fd)
        _libc.madvise(self.rw, size, mmap.MADV_DONTFORK)

    def tensor(self, address: int) -> torch.Tensor:
        buf = (ctypes.c_char * self.size).from_address(address)
        buf.owner = self  # type: ignore[attr-defined]
        return torch.frombuffer(buf, dtype=torch.uint8)

    def __del__(self) -> None:
        if self.ro:
            _libc.munmap(self.ro, self.size)
        if self.rw and os.getpid() == self.pid:
            _libc.munmap(self.rw, self.size)


_RELEASE = getattr(_write_guard, "release", None)  # bound for __del__ at exit


class Slab:
    """One mapping of the pool (see Note [slabs]): its tensor, its views, its guard.

    What holds a slab: its storages' use counts above the pool's own tensors (``base``,
    ``wbase``: tensors over it, parameters given its views), and the Python storage objects'
    own references above the pool's (``held``: a ``untyped_storage()`` or ``TypedStorage`` kept
    by anyone, which torch counts once however many hold it)."""

    __slots__ = (
        "__weakref__",
        "base",
        "dirty",
        "guarded",
        "held",
        "mine",
        "size",
        "slot",
        "storages",
        "target",
        "tensor",
        "views",
        "wbase",
        "wmine",
        "wtensor",
    )

    def __init__(self, size: int, guarded: bool) -> None:
        """``guarded``: mapped twice and armed (Note [write guard]); OSError where a memfd cannot
        be made (the pool then makes unguarded slabs)."""
        self.size = size
        self.slot: int | None = None
        self.dirty = False  # written where unguarded (resident()): private pages to drop
        if guarded:
            fd = _memfd()
            try:
                os.ftruncate(fd, size)
                m = _Mapping(size, fd)
            finally:
                os.close(fd)  # the mappings keep the file
        else:
            m = _Mapping(size, None)
        self.guarded = guarded
        self.tensor = m.tensor(m.ro)
        self.wtensor = m.tensor(m.rw) if guarded else self.tensor
        self.storages = (self.tensor.untyped_storage(), self.wtensor.untyped_storage())
        self.mine, self.wmine = (st._cdata for st in self.storages)
        self.target = self.wtensor.data_ptr()  # where reads land
        self.views: dict[Any, list[torch.Tensor]] = {}
        self.base = use_count(self.mine)  # what the pool's own tensors count
        self.wbase = use_count(self.wmine)
        self.held = sys.getrefcount(self.storages[0]) + sys.getrefcount(self.storages[1])
        if guarded:
            self.arm()

    def handle(self, writable: bool) -> torch.Tensor:
        """A new tensor on this slab (its writable mapping, where ``writable``): it holds the
        slab until it and every tensor made from it are gone."""
        return (self.wtensor if writable else self.tensor).detach()

    def free(self) -> bool:
        """Whether only the pool's own tensors and storage objects are on it."""
        st = self.storages
        return (
            use_count(self.mine) == self.base
            and (not self.guarded or use_count(self.wmine) == self.wbase)  # unguarded: one storage
            and sys.getrefcount(st[0]) + sys.getrefcount(st[1]) == self.held
        )

    def arm(self) -> bool:
        """Read-only from now on, writes noted; False where no slot is free."""
        address = self.tensor.data_ptr()
        try:
            self.slot = _write_guard.protect(address, round_up(self.size, mmap.PAGESIZE))
        except (RuntimeError, OSError) as err:  # every slot in use; mprotect failed
            self.arm_failed(err)
            return False
        return True

    def arm_failed(self, err: Exception) -> None:
        if not _warned:
            _warned.append(True)
            log.warning(
                "offloadd relay: a slab of %d bytes cannot be guarded (%s), so a write "
                "through weight.data to its weights in forward goes unseen",
                self.size,
                err,
            )

    def guard(self) -> bool:
        """Note writes from now on; a write noted before stays noted (it is reported, and the
        slab cleaned before its next read). False where it cannot be guarded."""
        if not self.guarded:
            return False
        try:  # a handler installed since (faulthandler, a runtime's) goes under the guard's
            _write_guard.rechain()
        except (RuntimeError, OSError) as err:
            self.disarm()  # a write must not meet a handler that takes it for a crash
            self.arm_failed(err)
            return False
        return self.slot is not None or self.arm()

    def written(self) -> int:
        """The address of the first write since guarded, or 0."""
        return _write_guard.fault(self.slot) if self.slot is not None else 0

    def disarm(self) -> int:
        """Writable, the guard's slot freed; the address of the first write since armed, or 0.
        What is written from now on lies on private pages: the slab is cleaned before its next
        read."""
        slot, self.slot = self.slot, None
        if slot is None:
            return 0
        self.dirty = True
        return _write_guard.release(slot)

    def clean(self) -> None:
        """Before a read lands: the private pages written through a weight dropped (the shared
        ones show again), read-only again."""
        if not self.dirty and self.slot is not None and not _write_guard.fault(self.slot):
            return  # the common case: armed, unwritten
        self.disarm()
        _libc.madvise(self.tensor.data_ptr(), self.size, mmap.MADV_DONTNEED)
        self.dirty = False
        self.arm()

    def privatize(self) -> None:
        """In a forked child: this slab's bytes on private anonymous pages of its own."""
        address = self.tensor.data_ptr()
        data = ctypes.string_at(address, self.size)
        _map(self.size, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, at=address)
        ctypes.memmove(address, data, self.size)
        if self.slot is not None:
            self.disarm()
            self.arm()

    def close(self) -> None:
        """Forget the pool's tensors: unmapped once the last other tensor on it dies."""
        self.disarm()
        self.views.clear()

    def __del__(self, release: Any = _RELEASE) -> None:
        # the guard's slot goes before the mapping can (a range left guarded after its unmap
        # would take another mapping's faults there for its own): bound here, as at exit the
        # module's globals may be gone
        slot, self.slot = self.slot, None
        if slot is not None and release is not None:
            with contextlib.suppress(Exception):
                release(slot)
