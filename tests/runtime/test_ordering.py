"""The device-ordering code, run without a GPU against a simulated asynchronous device.

``SimulatedOrdering`` makes every CPU tensor behave like a CUDA one: its copy into a slot is only
enqueued, and a worker thread does it later, after a random delay. The write path, the read path
and the Offloader run the same ordering code as on CUDA (see [device ordering] in
offloadd/runtime/ordering.py), so a missing wait reads bytes that are not there yet and the
gradients differ. The last tests remove a wait on purpose and check that the simulation sees it.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from offloadd.runtime.ordering import StagedCopy
from offloadd.runtime.simulated import SimulatedOrdering
from tests._support.helpers import (
    MakeOffloader,
    SavePayload,
    assert_bitwise_equal,
    train,
    train_and_compare,
)
from tests.properties.test_equivalence import MODELS


@pytest.fixture
def sim(request: pytest.FixtureRequest) -> Iterator[SimulatedOrdering]:
    # A seed per test, the same in every run (str hashes differ between processes).
    ordering = SimulatedOrdering(seed=zlib.crc32(request.node.name.encode()), max_delay_s=0.002)
    yield ordering
    ordering.close()


# A staging pool of 4 chunks: most chunks are written and read back from disk, not forwarded.
_TIGHT = {"chunk_bytes": 64 << 10, "staging_bytes": 256 << 10, "host_budget_bytes": 256 << 10}


@pytest.mark.usefixtures("backend")
@pytest.mark.parametrize("tier", ["ssd", "cpu"])
@pytest.mark.parametrize("model", sorted(MODELS))
def test_simulated_device_is_lossless(
    make_offloader: MakeOffloader, model: str, tier: str, disk_dir: Path, sim: SimulatedOrdering
) -> None:
    off = make_offloader(disk_dir, tier=tier, ordering=sim, **_TIGHT)
    st = train_and_compare(*MODELS[model], off)
    assert sim.copies > 0, "the simulated device was not used"
    if tier == "cpu":  # blocks still in their slots go back on the upload stream, late too
        assert sim.uploads > 0, "no block was copied back from its slots"
    if tier == "ssd":
        assert st.bytes_read > 0, "nothing was read back: the test would not see wrong bytes"
    assert st.resident_bytes == 0 and st.disk_bytes == 0


def test_blocks_larger_than_the_pool_stream_through_it(
    make_offloader: MakeOffloader, disk_dir: Path
) -> None:
    """A block of 16 chunks through a pool of 2: slots are reused while copies are in flight."""
    sim = SimulatedOrdering(seed=7, max_delay_s=0.004)
    payload = torch.randn(16 * (64 << 10) // 4)
    off = make_offloader(
        disk_dir, ordering=sim, chunk_bytes=64 << 10, staging_bytes=128 << 10, prefetch_bytes=0
    )
    try:
        SavePayload.seen.clear()
        x = torch.ones(4, requires_grad=True)
        with off:
            y = SavePayload.apply(x, payload)
        y.sum().backward()
        st = off.stats()
    finally:
        off.close()
        sim.close()
    assert torch.equal(SavePayload.seen[-1], payload)
    assert st.backpressure_waits > 0


def test_inplace_change_before_the_copy_ran_raises(
    make_offloader: MakeOffloader, disk_dir: Path
) -> None:
    """Changed in place after capture, before the late copy ran: backward raises, never uses
    the changed bytes (the version is checked once the copy completed)."""
    sim = SimulatedOrdering(seed=3, max_delay_s=0.05)
    off = make_offloader(disk_dir, ordering=sim)
    try:
        a = torch.randn(256, 256, requires_grad=True)
        with off:
            h = a * 2
            y = h.sin()  # saves h
        off.synchronize()  # captured: its copy is in flight on the simulated stream
        with torch.no_grad():
            h.add_(1)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            y.sum().backward()
    finally:
        off.close()
        sim.close()


def _train_with_writes_that_do_not_wait(
    make_offloader: MakeOffloader, disk_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> tuple[list[list[torch.Tensor]], list[list[torch.Tensor]]]:
    def chunk_without_event(self: StagedCopy, dst: torch.Tensor, src: torch.Tensor):  # type: ignore[no-untyped-def]
        real_chunk(self, dst, src)
        return lambda: None  # the write no longer waits for its copy

    real_chunk = StagedCopy.chunk
    monkeypatch.setattr(StagedCopy, "chunk", chunk_without_event)
    make_model, make_input = MODELS["mlp"]
    reference = train(make_model, make_input, None)
    # The copies run only when something waits for them (or a second later): never before the
    # writes that skip their events.
    sim = SimulatedOrdering(seed=11, max_delay_s=0.005, lag_s=1.0)
    off = make_offloader(disk_dir, ordering=sim, min_bytes=64 << 10, **_TIGHT)
    try:
        got = train(make_model, make_input, off)
    finally:
        off.close()
        sim.close()
    return reference, got


def test_the_simulation_catches_a_write_that_skips_its_event(
    make_offloader: MakeOffloader, disk_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The mutation test of the simulation: with the per-chunk event wait removed, writes take
    slots before their copy filled them, and the gradients are wrong. If this ever passes
    without the wait, the simulated device has lost its teeth."""
    reference, got = _train_with_writes_that_do_not_wait(make_offloader, disk_dir, monkeypatch)
    with pytest.raises(AssertionError, match="differs"):
        assert_bitwise_equal(reference, got)


def test_the_simulation_catches_an_unpack_that_skips_the_upload(
    make_offloader: MakeOffloader, disk_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The mutation test of the read path: with the consumer's wait for a block's copy from its
    slots removed, unpack views a buffer the late copy has not filled, and the gradients are
    wrong (the wait is what [device ordering]'s H2D rule asks of every consumer)."""
    from offloadd.runtime.reader import Reader

    make_model, make_input = MODELS["mlp"]
    reference = train(make_model, make_input, None)
    monkeypatch.setattr(Reader, "_await_upload", lambda self, block, buf, h2d: None)
    sim = SimulatedOrdering(seed=13, max_delay_s=0.005, lag_s=30.0)  # copies up run when waited for
    off = make_offloader(disk_dir, tier="cpu", ordering=sim, min_bytes=64 << 10)
    try:
        got = train(make_model, make_input, off)
    finally:
        off.close()
        sim.close()
    assert sim.uploads > 0
    with pytest.raises(AssertionError, match="differs"):
        assert_bitwise_equal(reference, got)


def test_synchronize_waits_for_the_copies_of_blocks_backward_never_took(
    make_offloader: MakeOffloader, disk_dir: Path
) -> None:
    """A block the prefetcher copied up from its slots but backward never unpacked (a branch the
    loss does not reach) is freed with that copy in flight, its slots held until it ends:
    ``synchronize()`` waits for it, so afterwards nothing is resident."""
    sim = SimulatedOrdering(seed=5, max_delay_s=0.1)
    off = make_offloader(disk_dir, tier="cpu", ordering=sim, host_budget_bytes=1 << 20)
    two_chunks = 2 * (64 << 10) // 4
    try:
        x = torch.ones(4, requires_grad=True)
        with off:
            unused = SavePayload.apply(x, torch.randn(two_chunks))
            y = SavePayload.apply(x, torch.randn(two_chunks))
        off.synchronize()  # both copied into their slots: the prefetcher may take the first
        y.sum().backward()  # unpacks the second, prefetches the first
        del unused
        off.synchronize()
        st = off.stats()
    finally:
        off.close()
        sim.close()
    assert sim.uploads == 4, "both blocks were to be copied back from their slots"
    assert st.resident_bytes == 0, st.summary()


def test_a_prefetch_without_device_memory_leaves_the_block_to_its_unpack(
    make_offloader: MakeOffloader, disk_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The prefetcher's copies from the slots take device memory ahead of use: one that finds
    none stops reading ahead, with a warning, and backward copies each block up when it needs
    it, as without the prefetcher; it never fails a backward that fits without it."""
    from offloadd.runtime.reader import Reader

    real_upload = Reader._upload
    refused: list[int] = []

    def upload(self: Reader, block: Any, prefetch: bool) -> None:
        if prefetch:  # as torch.empty on a full device would
            refused.append(block.seq)
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        real_upload(self, block, prefetch)

    monkeypatch.setattr(Reader, "_upload", upload)
    sim = SimulatedOrdering(seed=17, max_delay_s=0.002)
    off = make_offloader(disk_dir, tier="cpu", ordering=sim, host_budget_bytes=4 << 20)
    try:
        with pytest.warns(RuntimeWarning, match="reading ahead"):
            st = train_and_compare(*MODELS["mlp"], off)
    finally:
        sim.close()
    assert refused, "the prefetcher never copied a block up: the test would not see it"
    assert sim.uploads > 0 and st.resident_bytes == 0


def test_a_block_made_resident_before_close_is_unpacked_without_reading_ahead(
    make_offloader: MakeOffloader,
    disk_dir: Path,
) -> None:
    """close() gives the slots back to the system: backward may still take a block made
    resident before it (as the prefetcher makes them), but copies nothing more up from the
    slots, and the next block raises as any unpack after close does."""
    sim = SimulatedOrdering(seed=23)
    off = make_offloader(disk_dir, tier="cpu", ordering=sim, host_budget_bytes=1 << 20)
    two_chunks = 2 * (64 << 10) // 4
    try:
        x = torch.ones(4, requires_grad=True)
        with off:
            a = SavePayload.apply(x, torch.randn(two_chunks))
            b = SavePayload.apply(a, torch.randn(two_chunks))
        off.synchronize()  # copied into their slots
        with off.runtime.lock:
            last = list(off.runtime.blocks)[-1]
            off.runtime.reader.load(last, prefetch=True)  # as the prefetcher does ahead of unpack
        off.close()
        with pytest.raises(RuntimeError, match=r"unpack after Offloader.close\(\)"):
            b.sum().backward()
    finally:
        off.close()
        sim.close()
    assert sim.uploads == 2, "only the block made resident before close was copied up"
