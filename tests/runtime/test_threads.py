"""Faults between threads: counters, warnings, waits under the lock,
and a shutdown before the copy streams drained."""

from __future__ import annotations

import gc
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from offloadd import Offloader
from offloadd.io.buffers import SlotPool
from offloadd.io.pools import PagePool, ReadPool
from tests._support.helpers import MakeOffloader, SavePayload

# Engine-independent: one embedded engine (tests/runtime/test_shutdown.py runs every engine).
ENGINE_PARAMS = ("native-threads",)


@pytest.mark.usefixtures("fast_switching")
def test_counters_exact_with_threads_packing(make_offloader: MakeOffloader, disk_dir: Path) -> None:
    """saved_tensors and saved_bytes lose no count between threads: a small tensor's save is
    counted on the tally under the GIL (held.py) and applied under the lock at the next drain,
    every other count is updated under the lock.

    Before, they were updated outside it. On CPython 3.11 with the GIL that cannot lose a count
    (``st.n += 1`` on a plain attribute has no point where the interpreter switches threads), so
    this passed before the fix too; it guards free-threaded builds and any later refactoring."""
    off = make_offloader(disk_dir)
    per_thread, threads = 3000, 4
    x = torch.ones(4, requires_grad=True)
    barrier = threading.Barrier(threads)

    def work() -> None:
        barrier.wait()
        with off:
            for _ in range(per_thread):
                (x * x).sum()  # saves x twice; the graph is dropped at once

    pool = [threading.Thread(target=work) for _ in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    st = off.stats()
    off.close()
    assert st.saved_tensors == 2 * per_thread * threads
    assert st.saved_bytes == 2 * per_thread * threads * 16


def test_small_tensors_counted_exactly_nothing_queued() -> None:
    """The lock-free hot path: counts and the peak are exact, and nothing is queued for the
    tensors kept (a long scope saving only small tensors grows no queue)."""
    off = Offloader(tier="keep", min_bytes=1 << 20)
    x = torch.randn(16, requires_grad=True)  # 64 bytes
    n = 12288
    with off:
        y = x
        for _ in range(n):
            y = y.sin()  # saves its input
            assert not off.runtime.life.released
    st = off.stats()
    assert (st.saved_tensors, st.saved_bytes, st.kept_bytes) == (n, 64 * n, 64 * n)
    assert st.resident_bytes == st.peak_resident_bytes == 64 * n
    y.sum().backward()
    st = off.stats()
    assert st.resident_bytes == 0 and st.peak_resident_bytes == 64 * n
    off.close()


def test_warn_once_is_once_across_threads(make_offloader: MakeOffloader, disk_dir: Path) -> None:
    """I/O threads (and the daemon client's) warn with or without the Offloader's lock held."""
    off = make_offloader(disk_dir)
    logged: list[str] = []

    class SlowSet(set[str]):
        def __contains__(self, key: object) -> bool:
            found = super().__contains__(key)
            time.sleep(0.05)  # widen the window between the check and the add
            return found

    off.runtime.ledger._warned = SlowSet()
    import offloadd.runtime.accounting as mod

    real = mod.log.warning
    mod.log.warning = lambda msg, *a: logged.append(msg)  # type: ignore[method-assign]
    try:
        pool = [
            threading.Thread(target=off.runtime.ledger.warn_once, args=("k", "m")) for _ in range(4)
        ]
        for t in pool:
            t.start()
        for t in pool:
            t.join()
    finally:
        mod.log.warning = real  # type: ignore[method-assign]
    off.runtime.ledger._warnings.clear()
    off.close()
    assert logged == ["m"]


class _FakeCopy:
    """A D2H copy (as on CUDA) that checks it is never waited for with the lock held."""

    def __init__(self, off: Offloader) -> None:
        self.off = off
        self.waited_with_lock: list[str] = []
        self.complete = False
        self.polls = 0

    def done(self, *, wait: bool) -> bool:
        if wait:
            if self.off.runtime.lock.locked():
                self.waited_with_lock.append("done(wait=True)")
            self.complete = True
        else:
            self.polls += 1
            self.complete = self.complete or self.polls > 3
        return self.complete


def test_copy_waits_are_made_without_the_lock(
    make_offloader: MakeOffloader, disk_dir: Path
) -> None:
    """Unpack waits for a block's D2H copy without the lock; a block freed while its copy runs
    gives its slots back once the copy completed, not by waiting under the lock."""
    off = make_offloader(disk_dir, min_bytes=1)
    x = torch.ones(1, requires_grad=True)
    payload = torch.randn(1 << 16)
    SavePayload.seen.clear()
    with off:
        y = SavePayload.apply(x, payload)
    block = next(iter(off.runtime.blocks))
    fake = _FakeCopy(off)
    block.copy_done = fake  # type: ignore[assignment]
    y.sum().backward()
    assert torch.equal(SavePayload.seen[0], payload)
    assert fake.waited_with_lock == []
    # freed while "copying": the chunks stay until a poll sees the copy complete
    with off:
        y = SavePayload.apply(x, payload)
    block = next(iter(off.runtime.blocks))
    fake = _FakeCopy(off)
    block.copy_done = fake  # type: ignore[assignment]
    off.synchronize()
    del y
    gc.collect()
    off.stats()  # drains the release: the copy is still running
    assert off.runtime.writer.awaiting_copy == [block]
    while off.runtime.writer.awaiting_copy:
        with off.runtime.lock:
            off.runtime.writer.poll_copies()
    assert fake.waited_with_lock == []
    assert all(c.slot is None and c.offset < 0 for c in block.chunks)
    off.close()


class _FakeStream:
    def __init__(self, log: list[str]) -> None:
        self.log = log

    def synchronize(self) -> None:
        self.log.append("stream")


def test_finalizer_drains_copy_streams_before_freeing_pools(
    make_offloader: MakeOffloader, disk_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An Offloader collected without close(): its copy streams are synchronized before its
    staging memory is given back (a copy still queued would write into freed memory)."""
    log: list[str] = []
    for cls in (SlotPool, ReadPool, PagePool):  # staging; read-backs and bounce pages

        def close(self: Any, real: Any = cls.close) -> None:
            log.append("pool")
            real(self)

        monkeypatch.setattr(cls, "close", close)
    off = make_offloader(disk_dir, min_bytes=1)
    x = torch.ones(1, requires_grad=True)
    with off:
        y = SavePayload.apply(x, torch.randn(1 << 16))
    y.sum().backward()
    off.synchronize()
    assert off.runtime.writer.pools
    off.runtime.ordering._streams[0] = _FakeStream(log)  # type: ignore[attr-defined]
    del off
    gc.collect()
    assert log[:2] == ["stream", "pool"], log
