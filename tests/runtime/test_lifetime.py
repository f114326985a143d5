"""A block's life on its own (offloadd/runtime/lifetime.py): capture checks the source against
what pack recorded, drain applies the releases queued without the lock, and a freed block gives
back its source, resident copy, slots and places (tests/_support/parts.py wires the parts)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from offloadd.io.request import Request
from offloadd.runtime.blocks import Back, Out
from offloadd.runtime.identity import Facts
from tests._support.helpers import StagedEngine
from tests._support.parts import CHUNK, Parts, floats, parts_in

pytestmark = pytest.mark.unit


@pytest.fixture
def parts(tmp_path: Path) -> Iterator[Parts]:
    yield from parts_in(tmp_path, StagedEngine(2))


def test_capture_moves_a_pending_block_out_once(parts: Parts) -> None:
    ref = parts.pack(floats(CHUNK // 4))
    block = ref.block
    assert block.out is Out.PENDING and parts.stats.resident_bytes == block.nbytes
    parts.capture(block)
    assert block.out is Out.CAPTURED and block.source is None
    parts.capture(block)  # captured already: nothing
    parts.settle()
    assert parts.stats.offloaded_bytes == block.nbytes and parts.stats.resident_bytes == 0
    del ref


def test_capture_due_and_capture_all_take_what_this_thread_packed(parts: Parts) -> None:
    refs = [parts.pack(floats(CHUNK // 4, seed=i)) for i in range(3)]
    parts.life.capture_all()
    assert all(r.block.out is Out.CAPTURED for r in refs)
    parts.life.capture_all()  # nothing left
    parts.settle()
    del refs


def test_a_source_changed_in_place_is_dropped_never_written(parts: Parts) -> None:
    t = floats(CHUNK // 4)
    ref = parts.pack(t)
    t.mul_(2)
    parts.capture(ref.block)
    assert ref.block.modified and ref.block.out is Out.DROPPED and ref.block.source is None
    assert parts.stats.bytes_written == 0 and parts.stats.resident_bytes == 0
    del ref


def test_a_resized_storage_is_held_as_it_is(parts: Parts) -> None:
    t = floats(CHUNK // 4)
    ref = parts.pack(t)
    t.untyped_storage().resize_(0)  # as FSDP does to unsharded parameters
    parts.capture(ref.block)
    assert ref.block.out is Out.HELD and ref.block.source is not None
    assert parts.stats.bytes_written == 0
    del ref
    parts.drain()
    assert parts.live() == [] and parts.stats.resident_bytes == 0


def test_a_closed_lifetime_holds_what_is_still_pending(parts: Parts) -> None:
    t = floats(CHUNK // 4)
    ref = parts.pack(t)
    parts.life.closed = True
    parts.capture(ref.block)
    assert ref.block.out is Out.HELD
    assert torch.equal(parts.unpack(ref), t)  # the source itself
    del ref


def test_releases_apply_at_drain_in_order(parts: Parts) -> None:
    parts.index.dedup = True
    t = floats(2 * CHUNK // 4)
    a, b = parts.pack(t), parts.pack(t)
    block = a.block
    parts.capture(block)
    parts.settle()
    del a
    assert block.refs == 2 and len(parts.life.released) == 1  # queued, not applied
    parts.drain()
    assert block.refs == 1 and not block.freed and parts.live() == [block]
    del b
    parts.drain()
    assert block.refs == 0 and block.freed and parts.live() == []
    assert parts.backend is not None and parts.backend.used_bytes == 0
    assert parts.index.lookup(parts.index.key(t, Facts(t)), t) is None


def test_a_block_freed_before_capture_is_dropped_never_written(parts: Parts) -> None:
    ref = parts.pack(floats(CHUNK // 4))
    block = ref.block
    del ref
    parts.capture(block)  # drains first: the block is freed, then skipped
    assert block.freed and block.out is Out.DROPPED
    assert parts.stats.bytes_written == 0 and parts.stats.resident_bytes == 0


def test_freeing_a_resident_block_drops_its_copy(parts: Parts) -> None:
    parts.index.dedup = True
    t = floats(CHUNK // 4)
    a, b = parts.pack(t), parts.pack(t)
    parts.capture(a.block)
    parts.settle()
    parts.unpack(a)  # resident for b still
    block = a.block
    assert block.back is Back.RESIDENT and parts.stats.resident_bytes == block.padded
    del a, b
    parts.drain()
    assert block.back is Back.ABSENT and block.resident is None
    assert parts.stats.resident_bytes == 0


def test_a_block_freed_while_written_gives_its_places_back_when_done(tmp_path: Path) -> None:
    class Slow(StagedEngine):
        def __init__(self) -> None:
            super().__init__(2)
            self.held: list[Request] = []

        def submit(self, request: Request) -> None:
            self.held.append(request)

        def cancel(self, request: Request) -> bool:
            return False  # as if already started

    engine = Slow()
    for parts in parts_in(tmp_path, engine):
        ref = parts.pack(floats(2 * CHUNK // 4))
        block = ref.block
        parts.capture(block)
        del ref
        parts.drain()
        assert block.freed and parts.writer.in_flight == 2
        assert parts.backend is not None and parts.backend.used_bytes > 0  # still being written
        for r in engine.held:
            StagedEngine.submit(engine, r)
        engine.held.clear()
        parts.settle()
        assert parts.backend.used_bytes == 0 and parts.stats.resident_bytes == 0


def test_a_failed_capture_keeps_the_tensor(parts: Parts, monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(block: object, t: object) -> None:
        raise RuntimeError("no room")

    monkeypatch.setattr(parts.writer, "write_out", refuse)
    t = floats(CHUNK // 4)
    ref = parts.pack(t)
    with pytest.warns(RuntimeWarning, match="offloading failed, keeping the tensor"):
        parts.capture(ref.block)
        parts.ledger.flush_warnings()
    assert ref.block.out is Out.HELD and parts.stats.fallbacks == 1
    assert torch.equal(parts.unpack(ref), t)
    del ref
