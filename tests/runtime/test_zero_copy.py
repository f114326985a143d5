"""Zero-copy writes (CPU tensors written from their own pages) and warm, recycled read-backs."""

from __future__ import annotations

import ctypes
import gc
import mmap
import threading
from pathlib import Path

import pytest
import torch

from offloadd.io.buffers import SlotPool
from offloadd.io.pools import ReadPool, size_class
from offloadd.io.request import Op, Request
from offloadd.runtime.host_allocator import MIN_BYTES
from tests._support.helpers import MakeOffloader, SavePayload, SlowEngine


def _payload(nbytes: int, skew: int, seed: int) -> tuple[torch.Tensor, object]:
    """A uint8 tensor of ``nbytes`` whose storage starts ``skew`` bytes into a page."""
    raw = mmap.mmap(-1, nbytes + skew + 4096)
    window = (ctypes.c_char * nbytes).from_buffer(raw, skew)
    t = torch.frombuffer(window, dtype=torch.uint8)
    gen = torch.Generator().manual_seed(seed)
    t.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen))
    return t, (raw, window)


@pytest.mark.parametrize(
    ("nbytes", "skew"),
    [(4096, 0), (5000, 0), (100, 4000), (4096, 64), (8192, 4032), (300_000, 1), (200_003, 4095)],
)
def test_round_trip_from_any_offset_in_a_page(
    make_offloader: MakeOffloader, nbytes: int, skew: int, disk_dir: Path
) -> None:
    """Storages starting anywhere in a page, of any length, come back bit for bit from the file:
    the interior written in place, the ends through bounce pages, the read laid out alike."""
    payload, keep = _payload(nbytes, skew, seed=nbytes + skew)
    expect = payload.clone()
    off = make_offloader(disk_dir, min_bytes=1)
    assert off.runtime.writer.in_place is not None, "the embedded engines write in place"
    SavePayload.seen.clear()
    x = torch.ones(1, requires_grad=True)
    with off:
        y = SavePayload.apply(x, payload)
    off.synchronize()
    st = off.stats()
    assert st.bytes_written >= nbytes and st.forwarded_bytes == 0
    assert not any(isinstance(p, SlotPool) for p in off.runtime.writer.pools), "no staging copy"
    y.sum().backward()
    assert torch.equal(SavePayload.seen[0], expect)
    after = off.stats()
    assert after.bytes_read >= nbytes
    if after.host_allocator == "caching" and nbytes >= MIN_BYTES:
        assert (
            off.runtime.reader.pool.created == 0
        )  # read into a block of the host cache: [one pool]
        assert after.peak_resident_bytes >= nbytes
    else:
        assert after.peak_buffer_bytes >= nbytes  # the read buffer (and bounce pages) counted
    off.close()
    del keep


def test_views_with_offsets_round_trip(make_offloader: MakeOffloader, disk_dir: Path) -> None:
    """Saved views into one storage (offsets, strides) rebuild exactly on the read buffer."""
    base = torch.randn(3, 700, 33)
    views = [base[1], base[:, 5:400:3], base.transpose(0, 2)]
    off = make_offloader(disk_dir, min_bytes=1)
    got: list[torch.Tensor] = []
    strides: list[tuple[int, ...]] = []

    class Save(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, *vs):  # type: ignore[no-untyped-def]
            ctx.save_for_backward(*vs)
            return x.clone()

        @staticmethod
        def backward(ctx, g):  # type: ignore[no-untyped-def]
            strides.extend(v.stride() for v in ctx.saved_tensors)
            got.extend(v.clone() for v in ctx.saved_tensors)
            return (g, *([None] * len(ctx.saved_tensors)))

    x = torch.ones(1, requires_grad=True)
    with off:
        y = Save.apply(x, *views)
    off.synchronize()
    y.sum().backward()
    for v, g, stride in zip(views, got, strides, strict=True):
        assert stride == v.stride() and torch.equal(g, v)
    off.close()


def test_changed_while_written_in_place_raises(
    make_offloader: MakeOffloader, disk_dir: Path
) -> None:
    """A change in place while the write reads the tensor's own pages: backward raises, as
    autograd does, instead of reading back bytes from before or after the change."""
    off = make_offloader(disk_dir, min_bytes=1, io_engine=SlowEngine(0.2))
    a = torch.randn(256, 256, requires_grad=True)
    with off:
        h = a * 2
        y = h.sin()  # saves h
        y2 = y * 1  # a later op: h is captured, its write starts (slowly)
    h.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y2.sum().backward()
    off.close()


def test_backward_takes_the_source_while_it_is_written(
    make_offloader: MakeOffloader, disk_dir: Path
) -> None:
    """The last tensors of a forward, still being written, are not read back: backward uses
    the source itself and cancels the writes not yet started."""
    off = make_offloader(disk_dir, min_bytes=1, io_engine=SlowEngine(0.05))
    payload = torch.randn(1 << 18)
    SavePayload.seen.clear()
    x = torch.ones(1, requires_grad=True)
    with off:
        y = SavePayload.apply(x, payload)
    y.sum().backward()
    assert torch.equal(SavePayload.seen[0], payload)
    st = off.stats()
    assert st.forwarded_bytes >= payload.nbytes and st.bytes_read == 0
    off.synchronize()
    assert off.stats().resident_bytes == 0
    off.close()


def test_read_buffers_are_recycled_warm(make_offloader: MakeOffloader, disk_dir: Path) -> None:
    """After the first step, read-backs reuse the pool's buffers: nothing new is mapped."""
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(6)])
    x = torch.randn(64, 256)
    off = make_offloader(disk_dir, min_bytes=1)
    created = []
    for _ in range(4):
        with off:
            loss = model(x).tanh().sum()
        off.synchronize()  # all written: backward reads from the files
        loss.backward()
        gc.collect()
        created.append(off.runtime.reader.pool.created)
    assert off.stats().bytes_read > 0
    assert created[0] > 0 and created[-1] == created[1], created
    off.close()


def test_read_pool_lends_and_takes_back() -> None:
    pool = ReadPool()
    buf = pool.take(10_000)
    t = pool.lend(buf, 64, 9000)
    assert t.data_ptr() == buf.address + 64 and t.numel() == 9000
    v = t[10:20]
    del t
    assert pool.take(10_000) is not buf  # still viewed: not lent again
    del v
    gc.collect()
    pool.collect()
    assert pool.take(10_000) is buf  # back, and warm
    pool.close()


def test_size_classes() -> None:
    assert [size_class(n) for n in (1, 4096, 4097, 65536, 65537, 69632)] == [
        4096,
        4096,
        8192,
        65536,
        69632,
        69632,
    ]
    for n in (1, 5000, 123_457, 3 << 20, (7 << 20) + 5):
        c = size_class(n)
        assert n <= c <= max(n + 4095, n * 17 // 16) and c % 4096 == 0
        assert size_class(c) == c


def test_read_pool_classes_keep_their_own_and_idle_classes_go() -> None:
    pool = ReadPool()
    big = pool.take(100_000)  # the 100 KiB class
    t = pool.lend(big, 0, 100_000)
    del t
    small = pool.take(10_000)  # the 12 KiB class: never the idle 100 KiB buffer
    assert small is not big and pool.created == 2
    assert pool.take(101_000) is big  # warm, its own class
    for buf, n in ((big, 100_000), (small, 10_000)):
        t = pool.lend(buf, 0, n)
        del t
    pool.new_step()  # both classes were taken during the step that ended: kept, idle
    assert pool.mapped_bytes == pool.idle_bytes == (100 + 12) << 10
    pool.take(300_000)  # another class only
    pool.new_step()  # both taken in the step before the one that ended
    assert pool.mapped_bytes == (100 + 12 + 304) << 10
    pool.new_step()  # a step that took nothing does not count (a forward entered again)
    assert pool.mapped_bytes == (100 + 12 + 304) << 10
    pool.take(300_000)
    pool.new_step()  # two steps without either class: unmapped
    assert pool.mapped_bytes == (304 + 304) << 10
    pool.close()


def test_read_buffers_do_not_follow_the_heap_layout(
    make_offloader: MakeOffloader, disk_dir: Path
) -> None:
    """The same saved sizes at other offsets in a page each step (the heap's layout changes
    between steps) are served by the buffers of the first step: the class of a block depends on
    its size, not on its skew."""
    off = make_offloader(disk_dir, min_bytes=1)
    created = []
    for step in range(4):
        skew = (0, 16, 4032, 0)[step]  # a 64 KiB storage fits 16 pages only at skew 0
        payloads = [_payload(64 << 10, skew, seed=step * 10 + k) for k in range(5)]
        x = torch.ones(1, requires_grad=True)
        with off:
            y = x
            for p, _keep in payloads:
                y = SavePayload.apply(y, p)
        off.synchronize()
        y.sum().backward()
        del y
        gc.collect()
        created.append(off.runtime.reader.pool.created)
    assert off.stats().bytes_read >= 5 * (64 << 10)
    assert created == [created[0]] * 4, created
    off.close()


def test_lent_buffer_returns_from_another_thread() -> None:
    pool = ReadPool()
    buf = pool.take(1 << 16)
    t = pool.lend(buf, 0, 1 << 16)
    box = [t]
    del t
    th = threading.Thread(target=box.clear)
    th.start()
    th.join()
    assert pool.take(1 << 16) is buf
    pool.close()


def test_request_segments_in_file_order() -> None:
    r = Request(Op.WRITE, 0, "f", 8192, 1 << 20, 5 * 4096, lambda r: None, head=7, tail=9)
    assert r.segments() == [(8192, 7, 4096), (12288, (1 << 20) + 4096, 3 * 4096), (24576, 9, 4096)]


class _PairProduct(torch.nn.Module):
    """Each layer's matmul saves two activations, packed in one order and unpacked in the same
    order: backward's unpacks jump above the read-ahead sweep's start once per layer."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.a = torch.nn.Linear(width, width)
        self.b = torch.nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.a(x) @ self.b(x).T @ x)


def test_read_buffers_are_recycled_when_backward_jumps_between_sweeps(
    make_offloader: MakeOffloader, disk_dir: Path
) -> None:
    """Buffers age by training step, not by read-ahead sweep: backward restarts its sweep many
    times (a node unpacks its saved tensors in pack order), and once aged per sweep, classes that
    two restarts in a row did not take were unmapped and mapped again in every step (HF GPT-2:
    112 buffers a step, 0.4 s of page faults)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[_PairProduct(w) for w in (64, 64, 64, 64, 64, 64)])
    x = torch.randn(96, 64)
    sizes = [torch.randn(n, 64) for n in (96, 200, 400)]  # three size classes, layer by layer
    off = make_offloader(disk_dir, min_bytes=1)
    created = []
    for _ in range(5):
        with off:
            y = sum(model(s[:, :]).sum() for s in (x, *sizes))
        off.synchronize()
        assert isinstance(y, torch.Tensor)
        y.backward()
        del y
        gc.collect()
        created.append(off.runtime.reader.pool.created)
    assert off.stats().bytes_read > 0
    assert created[1] > 0 and created[-1] == created[1], created
    off.close()
