"""Blocks, chunks and the block map on their own (offloadd/runtime/blocks.py): the record's
layout, chunking, and the map's order; the two sides' table is tests/runtime/test_block_sides.py."""

from __future__ import annotations

import pytest
import torch

from offloadd.runtime.blocks import Back, Block, BlockMap, Out

pytestmark = pytest.mark.unit

CPU = torch.device("cpu")


@pytest.mark.parametrize(
    ("nbytes", "skew", "chunk", "sizes"),
    [
        (1, 0, 8192, [4096]),  # one byte: one page
        (4096, 0, 8192, [4096]),
        (4097, 0, 8192, [8192]),
        (8192, 0, 4096, [4096, 4096]),
        (10000, 0, 4096, [4096, 4096, 4096]),
        (4096, 100, 4096, [4096, 4096]),  # the skew pushes the last byte into a second page
        (20000, 4000, 8192, [8192, 8192, 8192]),
    ],
)
def test_a_record_is_whole_pages_cut_into_chunks(
    nbytes: int, skew: int, chunk: int, sizes: list[int]
) -> None:
    b = Block(1, nbytes, CPU, chunk, skew)
    assert b.padded % 4096 == 0 and b.padded >= skew + nbytes > b.padded - 4096
    assert [c.nbytes for c in b.chunks] == sizes
    assert [c.index for c in b.chunks] == list(range(len(sizes)))
    assert sum(sizes) == b.padded


def test_a_new_block_is_pending_absent_and_holds_nothing() -> None:
    b = Block(7, 5000, CPU, 4096)
    assert (b.seq, b.out, b.back, b.refs) == (7, Out.PENDING, Back.ABSENT, 0)
    assert b.source is None and b.resident is None and b.key is None
    assert not (b.freed or b.modified or b.prefetched or b.kept)
    c = b.chunks[0]
    assert (c.file, c.offset, c.slot, c.request, c.mem) == (-1, -1, None, None, None)
    assert not c.on_disk and not c.filling
    assert b.copy_completed()  # no asynchronous copy: done
    assert not b.upload_pending()


def test_copy_completed_asks_the_copy_without_waiting() -> None:
    class Copy:
        def __init__(self) -> None:
            self.finished, self.asked = False, []

        def done(self, wait: bool) -> bool:
            self.asked.append(wait)
            return self.finished

    b = Block(1, 1, CPU, 4096)
    b.copy_done = copy = Copy()
    assert not b.copy_completed()
    copy.finished = True
    assert b.copy_completed() and copy.asked == [False, False]


def test_upload_pending_forgets_an_event_once_it_completed() -> None:
    class Event:
        ready = False

        def query(self) -> bool:
            return self.ready

    b = Block(1, 1, CPU, 4096)
    b.slots_read = ev = Event()
    assert b.upload_pending() and b.slots_read is ev
    ev.ready = True
    assert not b.upload_pending() and b.slots_read is None


def test_the_map_numbers_blocks_in_pack_order_each_with_one_ref() -> None:
    m = BlockMap()
    made = [m.new(4096 * (i + 1), CPU, 4096) for i in range(4)]
    assert [b.seq for b in made] == [1, 2, 3, 4]
    assert all(b.refs == 1 for b in made)
    assert list(m) == made
    assert [m.seq_at(i) for i in range(4)] == [1, 2, 3, 4] and m.at(2) is made[2]


def test_forgetting_keeps_the_order_and_never_reuses_a_seq() -> None:
    m = BlockMap()
    a, b, c = (m.new(4096, CPU, 4096) for _ in range(3))
    m.forget(b)
    assert list(m) == [a, c]
    m.forget(b)  # twice: nothing more
    m.forget(Block(99, 1, CPU, 4096))  # never in the map
    assert list(m) == [a, c]
    d = m.new(4096, CPU, 4096)
    assert d.seq == 4 and list(m) == [a, c, d]
    for x in (a, c, d):
        m.forget(x)
    assert list(m) == [] and m.position_below(10) == -1


def test_position_below_finds_the_last_block_packed_before() -> None:
    m = BlockMap()
    blocks = [m.new(4096, CPU, 4096) for _ in range(5)]  # seqs 1..5
    m.forget(blocks[2])  # seq 3 gone: order 1, 2, 4, 5
    assert m.position_below(1) == -1
    assert m.position_below(3) == 1 and m.seq_at(m.position_below(3)) == 2
    assert m.seq_at(m.position_below(4)) == 2
    assert m.seq_at(m.position_below(5)) == 4
    assert m.seq_at(m.position_below(100)) == 5


def test_any_loading_counts_reads_in_flight() -> None:
    m = BlockMap()
    a, b = m.new(4096, CPU, 4096), m.new(4096, CPU, 4096)
    assert not m.any_loading()
    b.loading = 2
    assert m.any_loading()
    m.forget(b)
    assert not m.any_loading() and a.loading == 0
