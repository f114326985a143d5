"""The read path on its own (offloadd/runtime/reader.py): unpack before and after capture, reads
from disk, forwarding from slots, consumption by every ref, read errors, and the prefetch window
(tests/_support/parts.py wires the parts)."""

from __future__ import annotations

import errno
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from offloadd.io.request import Op
from offloadd.runtime.blocks import Back, Out
from tests._support.helpers import StagedEngine
from tests._support.parts import CHUNK, Failing, HeldWrites, Parts, floats, parts_in

pytestmark = pytest.mark.unit


@pytest.fixture
def parts(tmp_path: Path) -> Iterator[Parts]:
    yield from parts_in(tmp_path, StagedEngine(2))


def test_before_capture_unpack_views_the_source_itself(parts: Parts) -> None:
    t = floats(3000)
    ref = parts.pack(t[10:20])
    got = parts.unpack(ref)
    assert got.data_ptr() == t[10:20].data_ptr() and torch.equal(got, t[10:20])
    assert parts.stats.bytes_read == 0 and ref.block.back is Back.ABSENT
    del got, ref


def test_a_block_on_disk_is_read_back_with_its_views_layout(parts: Parts) -> None:
    t = floats(4 * CHUNK // 4, seed=1).view(64, -1)
    ref = parts.pack(t.t()[3:])  # strided, with an offset
    parts.capture(ref.block)
    parts.settle()
    got = parts.unpack(ref)
    want = t.t()[3:]
    assert torch.equal(got, want)
    assert (got.stride(), got.storage_offset()) == (want.stride(), want.storage_offset())
    assert parts.stats.bytes_read == ref.block.padded and parts.stats.on_demand_reads == 1
    del got, ref


def test_every_ref_consumes_the_load_before_it_is_dropped(parts: Parts) -> None:
    parts.index.dedup = True
    t = floats(2 * CHUNK // 4, seed=2)
    a, b = parts.pack(t), parts.pack(t[1:])  # one storage: one block, two refs
    block = a.block
    assert b.block is block and block.refs == 2
    parts.capture(block)
    parts.settle()
    assert torch.equal(parts.unpack(a), t)
    assert block.back is Back.RESIDENT and block.unconsumed == 1
    assert torch.equal(parts.unpack(b), t[1:])
    assert block.back is Back.ABSENT and block.resident is None  # consumed by both: dropped
    assert parts.stats.bytes_read == block.padded  # read once
    assert torch.equal(parts.unpack(a), t)  # again (retain_graph): read again
    assert parts.stats.bytes_read == 2 * block.padded
    del a, b


def test_a_chunk_still_in_its_slot_is_forwarded_and_its_write_cancelled(tmp_path: Path) -> None:
    engine = HeldWrites()
    for parts in parts_in(tmp_path, engine):
        t = floats(2 * CHUNK // 4, seed=3)
        ref = parts.pack(t)
        parts.capture(ref.block)
        assert len(engine.held) == 2
        got = parts.unpack(ref)
        assert torch.equal(got, t)
        assert not engine.held and parts.stats.bytes_written == 0 and parts.stats.bytes_read == 0
        assert parts.stats.forwarded_bytes == ref.block.padded
        assert ref.block.pinned_resident  # the only copy left: kept until every ref is gone
        del got, ref
        parts.drain()
        assert parts.stats.resident_bytes == 0


def test_a_failed_read_raises_never_wrong_bytes(tmp_path: Path) -> None:
    for parts in parts_in(tmp_path, Failing(Op.READ, errno.EIO)):
        ref = parts.pack(floats(CHUNK // 4, seed=4))
        parts.capture(ref.block)
        parts.settle()
        with pytest.raises(OSError, match="reading back a saved activation failed"):
            parts.unpack(ref)
        del ref
        parts.drain()


def test_a_change_in_place_before_capture_is_refused_at_unpack(parts: Parts) -> None:
    t = floats(CHUNK // 4, seed=5)
    ref = parts.pack(t)
    t.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        parts.unpack(ref)
    parts.capture(ref.block)
    assert ref.block.modified and ref.block.out is Out.DROPPED
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        parts.unpack(ref)
    del ref


def test_unpack_after_close_raises(tmp_path: Path) -> None:
    for parts in parts_in(tmp_path, StagedEngine(2)):
        ref = parts.pack(floats(CHUNK // 4, seed=6))
        parts.capture(ref.block)
        parts.settle()
        parts.life.closed = True
        with pytest.raises(RuntimeError, match=r"after Offloader\.close\(\)"):
            parts.unpack(ref)
        del ref


def test_unpack_reads_ahead_the_blocks_packed_before(parts: Parts) -> None:
    ts = [floats(CHUNK // 4, seed=10 + i) for i in range(6)]
    refs = [parts.pack(t) for t in ts]
    parts.capture(*(r.block for r in refs))
    parts.settle()
    assert torch.equal(parts.unpack(refs[-1]), ts[-1])
    ahead = [r.block for r in refs[:-1] if r.block.back is not Back.ABSENT]
    assert ahead, "nothing was read ahead"
    assert all(b.prefetched for b in ahead)
    # newest first, within the window (4 chunks here)
    assert [b.seq for b in ahead] == [r.block.seq for r in refs[-1 - len(ahead) : -1]]
    assert parts.reader.prefetch_live <= parts.reader.window
    parts.settle()
    for r, t in zip(reversed(refs[:-1]), reversed(ts[:-1]), strict=True):
        assert torch.equal(parts.unpack(r), t)
    assert parts.stats.prefetched_bytes >= len(ahead) * CHUNK
    del refs


def test_the_window_follows_the_median_block(parts: Parts) -> None:
    cfg = parts.config
    assert parts.reader._size_window() == cfg.prefetch_bytes  # no block: the configured bytes
    refs = [parts.pack(floats(1024 // 4)) for _ in range(3)]  # 4 KiB records
    with parts.ledger.lock:
        window = parts.reader._size_window()
    assert window == min(cfg.prefetch_bytes, max(2 * cfg.chunk_bytes, 8 * 4096))
    del refs
