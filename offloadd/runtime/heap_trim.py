"""Giving freed host memory back to the system: glibc's ``malloc_trim``, where there is one.

The ledger calls it once per ``Config.trim_host_bytes`` of CPU activations moved out or in, so
that the C heap's free pages do not pile up in the process's RSS (see ``trim_host_bytes``).
"""

from __future__ import annotations

import ctypes
import platform
from collections.abc import Callable

__all__ = ["malloc_trim"]


def malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim``, or None elsewhere (musl, macOS)."""
    if platform.libc_ver()[0] != "glibc":
        return None
    try:
        fn = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_size_t]
    fn.restype = ctypes.c_int
    return fn
