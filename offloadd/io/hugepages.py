"""Backing long-lived I/O buffers with transparent huge pages (THP), where the kernel allows it.

Note: [huge-page buffers] An O_DIRECT request pins its buffer's pages and hands the device one
segment per physically contiguous run. From 4 KiB pages a 4 MiB request is up to 1024 segments;
from 2 MiB huge pages it is 2. Where the cost is per page, not per request in flight, huge pages
multiply what the engines write and read per second, with every engine and setting alike
(docs/benchmarks/native-io_cpu-2core_2026-11-23.md). Systems default to THP ``madvise``, so a
buffer gets huge pages only when asked: :func:`advise_huge_pages` asks with
``MADV_HUGEPAGE`` (pages faulted from now on) and ``MADV_COLLAPSE`` (Linux >= 6.1: pages already
there, copied into huge pages now). Either may be refused (THP ``never``, an old kernel, no
free huge pages); the buffer then stays as it was, which is only slower.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os

__all__ = ["HUGE_PAGE", "advise_huge_pages", "prefer_huge_pages"]

log = logging.getLogger("offloadd")

HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14
_MADV_COLLAPSE = 25

_libc: ctypes.CDLL | None = None


def _madvise(address: int, nbytes: int, advice: int) -> int:
    """0, or the errno of madvise(2)."""
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        _libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        _libc.madvise.restype = ctypes.c_int
    if _libc.madvise(address, nbytes, advice) == 0:
        return 0
    return ctypes.get_errno()


def advise_huge_pages(address: int, nbytes: int) -> bool:
    """Ask for huge pages on the whole 2 MiB pages inside ``[address, address + nbytes)`` of an
    anonymous mapping this process owns; True if the pages there now are huge pages (collapsed),
    False if the kernel refused or the range holds no whole huge page. Contents are kept."""
    whole = _whole_huge_pages(address, nbytes)
    if whole is None:
        return False
    start, end = whole
    err = _madvise(start, end - start, _MADV_HUGEPAGE)
    if err:
        log.debug("offloadd: MADV_HUGEPAGE refused (%s)", os.strerror(err))
        return False
    err = _madvise(start, end - start, _MADV_COLLAPSE)
    if err:
        log.debug("offloadd: MADV_COLLAPSE refused (%s)", os.strerror(err))
        return False
    return True


def prefer_huge_pages(address: int, nbytes: int) -> bool:
    """Ask for huge pages where the range's whole 2 MiB pages will be faulted from now on (no
    collapse: for fresh mappings, before they are touched); True if the kernel took the advice."""
    whole = _whole_huge_pages(address, nbytes)
    return whole is not None and _madvise(whole[0], whole[1] - whole[0], _MADV_HUGEPAGE) == 0


def _whole_huge_pages(address: int, nbytes: int) -> tuple[int, int] | None:
    """[start, end) of the whole 2 MiB pages inside the range; None if none, or not Linux."""
    start = -(-address // HUGE_PAGE) * HUGE_PAGE
    end = (address + nbytes) // HUGE_PAGE * HUGE_PAGE
    if end <= start or not hasattr(os, "sched_getaffinity"):
        return None
    return start, end
