"""offloadd's host cache replayed over a traced run: the bytes it would keep mapped at its
peak, live and cached (the policy of Note [host cache] in csrc/host_allocator/host_allocator.cpp,
with the constants of runtime/host_allocator.py).

An allocation of at least ``MIN_BYTES`` takes a block of its size class: a cached one of that
class if there is one (the most recently freed), else a new one, after unmapping the blocks freed
longest ago while live plus cached bytes would pass ``max(FLOOR_BYTES, peak live x (1 + SLACK))``.
A freed block is cached. Smaller allocations go to glibc's heap, counted as live. A block's
resident bytes are its class: the cache maps no page past it (huge pages, which it advises from
2 MiB, cover the block's aligned whole 2 MiB only), and a training step writes its tensors whole.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

from offloadd.runtime.host_allocator import FLOOR_BYTES, MIN_BYTES, SLACK
from offloadd.tools.predict.live import Event

__all__ = ["Replay", "replay", "size_class"]

_PAGE = 4096


def size_class(n: int) -> int:
    """The block the cache maps for ``n`` bytes: eight classes per power of two, whole pages."""
    b = (n - 1).bit_length()
    step = max(1 << (b - 4) if b > 4 else 1, _PAGE)
    return -(-n // step) * step


@dataclass(frozen=True, slots=True)
class Replay:
    """The replay's peaks: ``resident`` bytes (the cache's blocks, live and cached, and the
    allocations outside it), and the cache's own counters' (size-class bytes): ``live`` and
    ``footprint`` (live plus cached); ``step_live``: the most live above the level the first
    step began at, which is what auto's budget bounds where the host cache measures (Note
    [measured peaks] in offloadd/auto/probe.py)."""

    resident: int
    live: int
    footprint: int
    step_live: int = 0


def replay(events: Iterable[Event], *, before: tuple[str, ...] = ("build",)) -> Replay:
    """``events`` replayed through the host cache; storages made in the phases ``before`` the
    cache is installed (the model's build; for auto inside a limit, its gradients and optimizer
    state too: tools/harness/train.py), or below ``MIN_BYTES``, are counted as they are, never
    cached."""
    blocks: dict[int, int] = {}  # live key in the cache -> its block's size class
    sizes: dict[int, int] = {}  # live key outside the cache -> its bytes
    free: dict[int, list[int]] = {}  # size class -> cached blocks' ids, most recent last
    lru: OrderedDict[int, int] = OrderedDict()  # cached block id -> class, oldest first
    next_id = 0
    live = cached = live_peak = 0  # the cache's counters: class bytes
    resident = peak = footprint = 0  # resident bytes: the cache's blocks and everything else
    start: int | None = None  # live when the first step began
    step_peak = 0
    for e in events:
        if start is None and e.phase == "step":
            start = live
        if e.nbytes < 0:
            if e.key in blocks:
                cls = blocks.pop(e.key)
                live -= cls
                cached += cls
                free.setdefault(cls, []).append(next_id)
                lru[next_id] = cls
                next_id += 1
            else:
                resident -= sizes.pop(e.key)
            continue
        if e.phase in before or e.nbytes < MIN_BYTES:
            sizes[e.key] = e.nbytes
            resident += e.nbytes
            peak = max(peak, resident)
            continue
        cls = size_class(e.nbytes)
        stack = free.get(cls)
        if stack:
            lru.pop(stack.pop())
            cached -= cls
        else:
            resident += cls
            cap = max(FLOOR_BYTES, max(live_peak, live + cls) * (1 + SLACK))
            while lru and live + cached + cls > cap:
                old, old_cls = lru.popitem(last=False)
                free[old_cls].remove(old)
                cached -= old_cls
                resident -= old_cls
        live += cls
        live_peak = max(live_peak, live)
        if start is not None:
            step_peak = max(step_peak, live - start)
        footprint = max(footprint, live + cached)
        blocks[e.key] = cls
        peak = max(peak, resident)
    return Replay(resident=peak, live=live_peak, footprint=footprint, step_live=step_peak)
