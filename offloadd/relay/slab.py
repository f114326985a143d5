"""One slab of relay's pool: :class:`Slab`, its memory mapped twice and its write guard (Note
[slabs] and Note [write guard] in slabs.py)."""

from __future__ import annotations

import contextlib
import ctypes
import logging
import mmap
import os
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


class _Mapping:
    """A slab's memory: its private mapping (what weights view) and, where guarded, the shared
    one reads land in. Every tensor over either holds it, and it unmaps both when the last is
    gone (the shared one only in the process that made it: a forked child has none)."""

    __slots__ = ("pid", "ro", "rw", "size")

    def __init__(self, size: int, guarded: bool) -> None:
        self.size, self.pid, self.rw = size, os.getpid(), 0
        if not guarded:  # private: a forked child writing its copy leaves this one as it is
            self.ro = _map(size, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            return
        fd = os.memfd_create("offloadd-slab", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, size)
            self.ro = _map(size, mmap.MAP_PRIVATE, fd)
            self.rw = _map(size, mmap.MAP_SHARED, fd)
        finally:
            os.close(fd)  # the mappings keep the file
        _libc.madvise(self.rw, size, mmap.MADV_DONTFORK)

    def tensor(self, address: int) -> torch.Tensor:
        buf = (ctypes.c_char * self.size).from_address(address)
        buf.owner = self  # type: ignore[attr-defined]
        return torch.frombuffer(buf, dtype=torch.uint8)

    def __del__(self) -> None:
        _libc.munmap(self.ro, self.size)
        if self.rw and os.getpid() == self.pid:
            _libc.munmap(self.rw, self.size)


class Slab:
    """One mapping of the pool (see Note [slabs]): its tensor, its views, its guard."""

    __slots__ = (
        "__weakref__",
        "base",
        "guarded",
        "mine",
        "size",
        "slot",
        "target",
        "tensor",
        "views",
        "wbase",
        "wmine",
        "wtensor",
    )

    def __init__(self, size: int, guarded: bool) -> None:
        self.size = size
        self.slot: int | None = None
        m = _Mapping(size, guarded)
        self.guarded = guarded
        self.tensor = m.tensor(m.ro)
        self.mine = self.tensor.untyped_storage()._cdata
        self.wtensor = m.tensor(m.rw) if guarded else self.tensor
        self.wmine = self.wtensor.untyped_storage()._cdata
        self.target = self.wtensor.data_ptr()  # where reads land
        self.views: dict[Any, list[torch.Tensor]] = {}
        self.base = use_count(self.mine)  # what the pool's own tensors count
        self.wbase = use_count(self.wmine)
        if guarded:
            self.arm()

    def free(self) -> bool:
        """Whether only the pool's own tensors are on it."""
        return use_count(self.mine) == self.base and use_count(self.wmine) == self.wbase

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
        """Note writes from now on, forgetting earlier ones; False where it cannot be guarded."""
        if not self.guarded:
            return False
        try:  # a handler installed since (faulthandler, a runtime's) goes under the guard's
            _write_guard.rechain()
        except (RuntimeError, OSError) as err:
            self.disarm()  # a write must not meet a handler that takes it for a crash
            self.arm_failed(err)
            return False
        if self.slot is not None and not _write_guard.fault(self.slot):
            return True
        self.disarm()
        return self.arm()

    def written(self) -> int:
        """The address of the first write since guarded, or 0."""
        return _write_guard.fault(self.slot) if self.slot is not None else 0

    def disarm(self) -> int:
        """Writable, the guard's slot freed; the address of the first write since armed, or 0."""
        slot, self.slot = self.slot, None
        return _write_guard.release(slot) if slot is not None else 0

    def clean(self) -> None:
        """Before a read lands: the private pages written through a weight dropped (the shared
        ones show again), read-only again."""
        if self.slot is not None and not _write_guard.fault(self.slot):
            return  # the common case: armed, unwritten
        self.disarm()
        _libc.madvise(self.tensor.data_ptr(), self.size, mmap.MADV_DONTNEED)
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

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # at exit, the module may be gone
            self.disarm()
