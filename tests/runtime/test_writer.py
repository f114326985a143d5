"""The write path on its own (offloadd/runtime/writer.py): a captured block's chunks through
slots or in place to the embedded backend, the host tier's pool and its spills, failed writes
kept in memory, and chunks given back (tests/_support/parts.py wires the parts)."""

from __future__ import annotations

import errno
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from offloadd.io.python_engine import PythonEngine
from offloadd.io.request import Op
from offloadd.runtime.blocks import Out
from tests._support.helpers import SlowEngine, StagedEngine
from tests._support.parts import CHUNK, Failing, HeldWrites, Parts, parts_in

pytestmark = pytest.mark.unit


@pytest.fixture
def staged(tmp_path: Path) -> Iterator[Parts]:
    yield from parts_in(tmp_path, StagedEngine(2))


@pytest.fixture
def in_place(tmp_path: Path) -> Iterator[Parts]:
    yield from parts_in(tmp_path, PythonEngine(2))


def _payload(nbytes: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)


def test_staged_chunks_are_written_and_their_slots_given_back(staged: Parts) -> None:
    assert staged.writer.in_place is None
    t = _payload(3 * CHUNK + 5)
    ref = staged.pack(t)
    block = ref.block
    assert block.skew == 0  # through staging: the record starts at the storage's first byte
    staged.capture(block)
    assert block.out is Out.CAPTURED and block.source is None
    staged.settle()
    assert all(c.on_disk and c.slot is None and c.request is None for c in block.chunks)
    assert staged.stats.bytes_written == block.padded
    assert staged.stats.offloaded_bytes == t.numel()
    assert staged.stats.resident_bytes == 0  # the source released, the slots free again
    assert staged.backend is not None and staged.backend.used_bytes >= block.padded
    del ref
    staged.drain()
    assert staged.backend.used_bytes == 0 and staged.live() == []


def test_in_place_blocks_keep_the_storages_page_offset(in_place: Parts) -> None:
    assert in_place.writer.in_place is not None
    t = _payload(5 * 4096)[100:]  # a view: its storage still starts on its own address
    ref = in_place.pack(t)
    block = ref.block
    assert block.skew == t.untyped_storage().data_ptr() % 4096
    assert block.padded == -(-(block.skew + block.nbytes) // 4096) * 4096
    in_place.capture(block)
    in_place.settle()
    assert all(c.on_disk for c in block.chunks)
    assert block.in_place and in_place.stats.bytes_written == block.padded
    del ref
    in_place.drain()


def test_skew_is_zero_where_nothing_is_written_in_place(staged: Parts, in_place: Parts) -> None:
    assert staged.writer.skew_of(torch.device("cpu"), 4096 + 17) == 0
    assert in_place.writer.skew_of(torch.device("cpu"), 4096 + 17) == 17
    assert in_place.writer.skew_of(torch.device("cpu"), 8192) == 0


def test_writes_wait_for_a_slot_when_staging_is_full(tmp_path: Path) -> None:
    """Staging of 2 chunks, a block of 6: the writer waits for writes to give slots back
    (each write delayed, so that none can finish before the writer wants a third slot)."""
    for parts in parts_in(tmp_path, SlowEngine(pages=False), staging_bytes=2 * CHUNK):
        t = _payload(6 * CHUNK, seed=1)
        ref = parts.pack(t)
        parts.capture(ref.block)
        parts.settle()
        assert all(c.on_disk for c in ref.block.chunks)
        assert parts.stats.backpressure_waits >= 1
        assert torch.equal(parts.unpack(ref), t)
        del ref


def test_a_failed_write_keeps_the_chunk_in_memory(tmp_path: Path) -> None:
    for parts in parts_in(tmp_path, Failing(Op.WRITE, errno.ENOSPC)):
        t = _payload(2 * CHUNK, seed=2)
        ref = parts.pack(t)
        with pytest.warns(RuntimeWarning, match="write failed"):
            parts.capture(ref.block)
            parts.settle()
            parts.ledger.flush_warnings()
        block = ref.block
        assert all(c.mem is not None and not c.on_disk and c.offset == -1 for c in block.chunks)
        assert parts.stats.fallbacks == len(block.chunks)
        assert parts.backend is not None and parts.backend.used_bytes == 0
        assert torch.equal(parts.unpack(ref), t)  # read back from the kept copies
        del ref
        parts.drain()
        assert parts.stats.resident_bytes == 0


def test_the_cpu_tier_keeps_chunks_in_its_pool(tmp_path: Path) -> None:
    for parts in parts_in(tmp_path, StagedEngine(2), tier="cpu", host_budget_bytes=16 * CHUNK):
        t = _payload(3 * CHUNK, seed=3)
        ref = parts.pack(t)
        parts.capture(ref.block)
        parts.settle()
        block = ref.block
        assert all(c.slot is not None and not c.on_disk for c in block.chunks)
        assert parts.stats.bytes_written == 0
        assert parts.stats.resident_bytes == block.padded  # the pool's slots hold it
        del ref
        parts.drain()
        assert parts.stats.resident_bytes == 0


def test_a_full_host_pool_spills_the_oldest_chunks(tmp_path: Path) -> None:
    for parts in parts_in(tmp_path, StagedEngine(2), tier="cpu", host_budget_bytes=4 * CHUNK):
        old = parts.pack(_payload(3 * CHUNK, seed=4))
        parts.capture(old.block)
        new_t = _payload(3 * CHUNK, seed=5)
        new = parts.pack(new_t)
        parts.capture(new.block)  # needs slots the old block holds: spills it
        parts.settle()
        assert parts.stats.bytes_written > 0
        assert any(c.on_disk for c in old.block.chunks)
        assert torch.equal(parts.unpack(new), new_t)
        del old, new
        parts.settle()  # a chunk freed mid-write gives its disk space back when the write ends
        assert parts.backend is not None and parts.backend.used_bytes == 0


def test_release_chunks_cancels_and_gives_everything_back(tmp_path: Path) -> None:
    engine = HeldWrites()
    for parts in parts_in(tmp_path, engine):
        ref = parts.pack(_payload(2 * CHUNK, seed=6))
        parts.capture(ref.block)
        assert parts.writer.in_flight == 2 and len(engine.held) == 2
        with parts.ledger.lock:
            parts.writer.release_chunks(ref.block)
        assert parts.writer.in_flight == 0 and not engine.held
        assert all(
            c.slot is None and c.request is None and c.offset == -1 for c in ref.block.chunks
        )
        assert parts.backend is not None and parts.backend.used_bytes == 0
        del ref
        parts.drain()
