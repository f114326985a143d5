"""How much memory a step uses, as the allocator counts it: the planner's measure of a peak.

Note: [measured peaks] The budget bounds a step's activation peak: the most memory the step uses
above what was in use when its forward began, as the allocator counts it. That is what the user
runs out of, and it is more than the saved activations offloadd holds: the temporaries of each op
(attention scores, a large head's logits and their gradients) come on top of whatever is saved at
that moment, and they are largest in backward, when everything kept is still held. A
:class:`MemoryProbe` reads that memory where an allocator counts it:

- CUDA (:class:`CudaProbe`): ``torch.cuda.memory_allocated`` and its peak. The profile step resets
  the device's peak statistics at each block boundary, so ``max_memory_allocated`` read after
  that step covers the steps since (said where the planner logs its plan).
- CPU with offloadd's host cache (:class:`HostCacheProbe`): its live bytes (allocations of 128 KiB
  and more; smaller ones stay on glibc's heap and are not seen) and a peak it can restart, plus
  offloadd's own buffers (staging slots, small read-backs), which are mapped outside torch's
  allocator; read-backs of 128 KiB and more are in the host cache's live bytes ([one pool] in
  io/pools.py).

Without either (torch's own CPU allocator), :func:`open_probe` returns None and the planner falls
back to offloadd's own accounting of what it holds (see [the plan] in solver.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from offloadd.runtime import host_allocator

__all__ = ["CudaProbe", "HostCacheProbe", "MemoryProbe", "open_probe"]


class MemoryProbe(Protocol):
    """Bytes in use now, and the most in use since the last :meth:`restart`."""

    name: str

    def level(self) -> int:
        """Bytes in use now."""
        ...

    def restart(self) -> int:
        """Start a new window for :meth:`peak`; returns the bytes in use now."""
        ...

    def peak(self) -> int:
        """The most bytes in use at once since the last :meth:`restart`."""
        ...


class CudaProbe:
    """``torch.cuda``'s allocated bytes on ``device`` (see [measured peaks])."""

    name = "cuda"

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def level(self) -> int:
        return int(torch.cuda.memory_allocated(self.device))

    def restart(self) -> int:
        torch.cuda.reset_peak_memory_stats(self.device)
        return int(torch.cuda.memory_allocated(self.device))

    def peak(self) -> int:
        return int(torch.cuda.max_memory_allocated(self.device))


class HostCacheProbe:
    """The host cache's live bytes plus offloadd's buffers (see [measured peaks])."""

    name = "host cache"

    def __init__(self, cache: host_allocator.HostCache, buffers: Callable[[], int]) -> None:
        self.cache = cache
        self.buffers = buffers

    def level(self) -> int:
        return self.cache.counters().live_bytes + self.buffers()

    def restart(self) -> int:
        return self.cache.reset_window() + self.buffers()

    def peak(self) -> int:
        return self.cache.counters().window_peak_live_bytes + self.buffers()


def open_probe(sample: torch.Tensor | None, buffers: Callable[[], int]) -> MemoryProbe | None:
    """The probe for a model whose parameters are like ``sample``: CUDA for a CUDA tensor, the
    host cache while it is torch's CPU allocator, else None (not measurable). ``buffers``: the
    bytes of offloadd's own buffers now."""
    if sample is not None and sample.is_cuda:
        return CudaProbe(sample.device)
    if sample is not None and sample.device.type != "cpu":
        return None
    cache = host_allocator.current()
    if cache is None or not cache.installed:
        return None
    return HostCacheProbe(cache, buffers)
