"""A measured run's memory: RSS now and at its peak (over the process's life, or since the
peak was last reset), a limit on what the run may hold more, and telling an out-of-memory error
from any other (train.py)."""

from __future__ import annotations

import resource

import psutil
import torch

__all__ = [
    "is_oom",
    "limit_memory",
    "peak_rss",
    "peak_rss_since_reset",
    "reset_peak_rss",
    "rss",
    "unlimit_memory",
]

_unlimited_as = resource.getrlimit(resource.RLIMIT_AS)


def rss() -> int:
    return int(psutil.Process().memory_info().rss)


def peak_rss() -> int:
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def reset_peak_rss() -> None:
    """Set the process's RSS high-water mark to its RSS now (``/proc/self/clear_refs``), so that
    :func:`peak_rss_since_reset` leaves out an earlier peak (building a model whose weights are
    then moved out of memory). OSError where Linux's ``/proc`` is missing."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def peak_rss_since_reset() -> int:
    """The RSS high-water mark (``VmHWM``) since :func:`reset_peak_rss`, or the process's start.
    Unlike ``ru_maxrss`` (:func:`peak_rss`), it keeps no peak from before a reset: the kernel
    folds the high-water mark into ``ru_maxrss`` whenever a thread exits."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise OSError("/proc/self/status has no VmHWM line")


def limit_memory(limit: int, cuda: bool, base_dev: int) -> None:
    """Let the process hold about ``limit`` more bytes than it holds now."""
    if cuda:
        total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, (base_dev + limit) / total))
        return
    vms = int(psutil.Process().memory_info().vms)
    resource.setrlimit(resource.RLIMIT_AS, (vms + limit, _unlimited_as[1]))


def unlimit_memory() -> None:
    """Lift :func:`limit_memory`'s CPU limit."""
    resource.setrlimit(resource.RLIMIT_AS, _unlimited_as)


def is_oom(e: BaseException) -> bool:
    if isinstance(e, torch.OutOfMemoryError | MemoryError):
        return True
    text = str(e)
    return "can't allocate memory" in text or "out of memory" in text.lower()
