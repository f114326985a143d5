"""The host cache: offloadd's caching CPU allocator for torch (see Note [host cache] in
csrc/host_allocator/host_allocator.cpp), installed while an Offloader needs it.

Why it exists: on CPU, offloading frees each activation soon after it is made. glibc's heap then
fragments and keeps several times what it holds resident, and every way of trimming it makes the
next activations fault their pages in again
(docs/benchmarks/fastpath_allocator_cpu-2core_2026-11-23.md).
The host cache recycles freed blocks by size class, warm, and caps what it keeps at what was live.

How it is built: by offloadd's install, against the torch installed then, as the extension module
``offloadd.runtime._host_cache`` (setup.py); importing it registers the torch ops
``torch.ops.offloadd_host_cache.*`` that :class:`HostCache` calls. Nothing is compiled at run
time: where the module is missing (or does not load), ``host_allocator = "auto"`` keeps torch's
allocator with a warning and ``"caching"`` raises, naming it (docs/native.md).
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from offloadd.config import Config
from offloadd.runtime.stats import Stats

__all__ = [
    "EXTENSION",
    "FLOOR_BYTES",
    "HUGE_PAGES",
    "MIN_BYTES",
    "SLACK",
    "HostAllocatorError",
    "HostCache",
    "HostCacheCounters",
    "acquire",
    "choose",
    "current",
    "host_cache",
    "load",
    "note_stats",
    "open_for",
    "release",
    "serves",
]

log = logging.getLogger("offloadd")

MIN_BYTES = 128 << 10
"""Allocations below this go to torch's previous allocator (glibc's heap serves them well)."""
FLOOR_BYTES = 64 << 20
"""The cache may always keep this much, however little is live."""
SLACK = 0.4
"""Live plus cached bytes stay within (1 + SLACK) x the most bytes ever live at once. A bound, not
a reserve: blocks are cached only as the size classes in use at once need them. A smaller slack
left no room for tier ssd's read-back records (see [one pool] in io/pools.py) beside the
gradients, and HF GPT-2's backward evicted and mapped blocks every step; at 0.4 none, at the same
peak (docs/benchmarks/steady-pool_hf-gpt2_cpu-2core_2026-11-26.md)."""

HUGE_PAGES = True
"""Blocks of 2 MiB and more are aligned to huge pages and advised to use them: the built-in GPT's
ssd step runs faster from the second step on, at the same RSS, while the first, which faults the
blocks in, is slower (docs/benchmarks/fastpath_allocator_cpu-2core_2026-11-23.md)."""

EXTENSION = "offloadd.runtime._host_cache"
"""The extension module that holds the host cache (built by offloadd's install)."""


class HostAllocatorError(RuntimeError):
    """The host cache is not built or does not load (the message says why)."""


@dataclass(frozen=True, slots=True)
class HostCacheCounters:
    """The host cache's process-wide counters (bytes are size-class bytes)."""

    live_bytes: int
    cached_bytes: int
    """Freed blocks kept mapped, for the next allocation of their size class."""
    peak_live_bytes: int
    peak_footprint_bytes: int
    """Most live + cached bytes at once."""
    hits: int
    misses: int
    evicted_bytes: int
    mapped_bytes: int
    """Bytes mapped fresh (one mapping per miss)."""
    window_peak_live_bytes: int
    """Most live bytes since the last :meth:`HostCache.reset_window` (the planner's probe)."""


class HostCache:
    """The loaded library: install it as torch's CPU allocator, read its counters."""

    def __init__(self) -> None:
        module = _import()
        self._ops: Any = torch.ops.offloadd_host_cache
        self.path = str(module.__file__)
        """The extension module's file."""
        self.min_bytes = MIN_BYTES  # what install() was given: smaller allocations pass by

    def install(
        self,
        min_bytes: int = MIN_BYTES,
        floor_bytes: int = FLOOR_BYTES,
        slack: float = SLACK,
        huge_pages: bool = HUGE_PAGES,
    ) -> None:
        self._ops.configure(min_bytes, floor_bytes, slack, huge_pages)
        if not self._ops.install():
            raise HostAllocatorError("torch kept another CPU allocator of higher priority")
        self.min_bytes = min_bytes

    def uninstall(self) -> None:
        self._ops.uninstall()

    @property
    def installed(self) -> bool:
        return bool(self._ops.installed())

    def counters(self) -> HostCacheCounters:
        return HostCacheCounters(*self._ops.counters())

    def reset_window(self) -> int:
        """Start a new window for ``window_peak_live_bytes``; returns the live bytes now."""
        return int(self._ops.reset_window())

    def empty(self) -> int:
        """Unmap every cached block; returns the bytes given back."""
        return int(self._ops.empty())


_lock = threading.Lock()
_cache: HostCache | None = None
_users = 0


def _import() -> Any:
    """The extension module (HostAllocatorError naming it and the fix where it is missing)."""
    try:
        return importlib.import_module(EXTENSION)
    except (ImportError, OSError) as e:
        raise HostAllocatorError(
            f"the extension module {EXTENSION} is not built or does not load ({e}); build it by "
            "reinstalling offloadd with torch installed: pip install --no-build-isolation . "
            "(docs/native.md)"
        ) from e


def load() -> HostCache:
    """The host cache, loaded (not installed): HostAllocatorError if its extension module is not
    built or does not load. Nothing is compiled."""
    global _cache
    with _lock:
        if _cache is None:
            _cache = HostCache()
        return _cache


def acquire() -> HostCache:
    """Load the host cache and install it; each acquire() needs one release()."""
    global _users
    cache = load()
    with _lock:
        if _users == 0:
            cache.install()
        _users += 1
        return cache


def release() -> None:
    """The last user gone, torch gets its previous allocator back and the cache is unmapped."""
    global _users
    with _lock:
        if _cache is None or _users == 0:
            return
        _users -= 1
        if _users == 0:
            _cache.uninstall()


@contextlib.contextmanager
def host_cache() -> Iterator[HostCache]:
    """offloadd's host cache as torch's CPU allocator inside the block, with or without an
    Offloader (``offloadd.host_cache()``); when it helps and when not: docs/host-cache.md.
    HostAllocatorError if it is not built (docs/native.md); on leaving, torch gets its previous
    allocator back once no Offloader uses it either. Tensors allocated inside may outlive the
    block: their memory goes back to the cache when they die."""
    cache = acquire()
    try:
        yield cache
    finally:
        release()


def serves(nbytes: int) -> bool:
    """Whether a CPU allocation of ``nbytes`` now comes from the host cache (installed by
    acquire(), and at least its ``min_bytes``). Without the lock: called on the read path."""
    cache = _cache
    return _users > 0 and cache is not None and nbytes >= cache.min_bytes


def current() -> HostCache | None:
    """The host cache while installed by acquire(), else None."""
    with _lock:
        return _cache if _users else None


def open_for(cfg: Config, warn: Callable[[str, str], None]) -> bool:
    """Acquire the host cache if ``cfg.host_allocator`` asks for it; True if acquired.

    ``"auto"`` wants it for tier ssd where CUDA is absent (training on CPU) and warns through
    ``warn(key, message)`` when it cannot have it; ``"caching"`` raises instead."""
    mode = cfg.host_allocator
    if not choose(cfg)[0]:
        return False
    try:
        acquire()
    except HostAllocatorError as e:
        if mode == "caching":
            raise HostAllocatorError(f"host_allocator = 'caching': {e}") from e
        warn(
            "host_allocator",
            "offloadd: host_allocator = 'auto' keeps torch's CPU allocator: the host cache is "
            f"unavailable: {e}",
        )
        return False
    return True


def choose(cfg: Config) -> tuple[bool, str]:
    """Whether ``cfg`` wants the host cache, and why: the decision of :func:`open_for`, which then
    acquires it (nothing is built, loaded or installed here)."""
    mode = cfg.host_allocator
    if mode == "system":
        return False, "host_allocator = 'system'"
    if mode == "caching":
        return True, "host_allocator = 'caching'"
    if cfg.tier != "ssd":
        return False, f"host_allocator = 'auto' and tier {cfg.tier}: the host cache is for tier ssd"
    if _has_cuda():
        return False, "host_allocator = 'auto' and CUDA is available: activations are on the GPU"
    return True, "host_allocator = 'auto', tier ssd and no CUDA: training on CPU"


def note_stats(stats: Stats) -> None:
    """Copy the host cache's counters into ``stats`` (process-wide figures)."""
    cache = current()
    if cache is None:
        return
    c = cache.counters()
    stats.host_cached_bytes = c.cached_bytes
    stats.host_cache_hits = c.hits
    stats.host_cache_misses = c.misses


def _has_cuda() -> bool:
    # is_built first: a CPU wheel answers without touching a driver.
    return bool(torch.backends.cuda.is_built() and torch.cuda.is_available())
