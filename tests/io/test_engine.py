"""The SSD path: O_DIRECT alignment, odd sizes, concurrency, striping, errors."""

from __future__ import annotations

import errno
import os
import threading
from pathlib import Path

import pytest
import torch

from offloadd import Offloader
from offloadd.io.buffers import AlignedBuffer
from offloadd.io.files import DiskStore, SlotFile
from offloadd.io.python_engine import PythonEngine
from offloadd.io.request import Op, Request
from tests._support.helpers import MakeEngine, MakeOffloader, SavePayload, loop_ext4

pytestmark = pytest.mark.every_engine  # the engines' own tests: each engine, by default


def test_o_direct_is_really_on(disk_dir: Path) -> None:
    """The test directory enforces O_DIRECT alignment (so the other tests mean something)."""
    f = SlotFile(str(disk_dir), 1 << 20, "on")
    assert f.direct
    buf = AlignedBuffer(8192)
    with pytest.raises(OSError) as e:
        os.pwrite(f.fd, memoryview(buf._mmap)[1:4097], 0)  # misaligned address
    assert e.value.errno == errno.EINVAL
    f.close()
    buf.close()


@pytest.mark.parametrize("nbytes", [1, 4095, 4096, 4097, 3 * 65536 + 7])
def test_round_trip_odd_sizes(make_offloader: MakeOffloader, nbytes: int, disk_dir: Path) -> None:
    _round_trip(make_offloader, nbytes, disk_dir, chunk_bytes=64 << 10)


@pytest.mark.slow
def test_round_trip_199_mib_plus_one(make_offloader: MakeOffloader, disk_dir: Path) -> None:
    _round_trip(make_offloader, (199 << 20) + 1, disk_dir, chunk_bytes=4 << 20)


def test_round_trip_larger_than_staging(make_offloader: MakeOffloader, disk_dir: Path) -> None:
    _round_trip(make_offloader, (9 << 20) + 1, disk_dir, chunk_bytes=1 << 20)  # staging is 1 MiB


def _round_trip(
    make_offloader: MakeOffloader, nbytes: int, disk_dir: Path, chunk_bytes: int
) -> None:
    payload = torch.randint(
        0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(nbytes)
    )
    off = make_offloader(
        disk_dir, min_bytes=1, chunk_bytes=chunk_bytes, staging_bytes=max(1 << 20, chunk_bytes)
    )
    SavePayload.seen.clear()
    x = torch.ones(1, requires_grad=True)
    with off:
        y = SavePayload.apply(x, payload)
    off.synchronize()  # everything on disk: the read really comes from the file
    st = off.stats()
    assert st.bytes_written >= nbytes and st.forwarded_bytes == 0
    y.sum().backward()
    assert torch.equal(SavePayload.seen[0], payload)
    assert off.stats().bytes_read >= nbytes
    off.close()


def test_engine_concurrent_requests(make_engine: MakeEngine, disk_dir: Path) -> None:
    store = DiskStore([str(disk_dir)], 64 << 10, "auto")
    f = store.files[0]
    engine = make_engine(4)
    n = 64
    src = AlignedBuffer(n * (64 << 10))
    src.tensor.copy_(torch.randint(0, 256, (src.nbytes,), dtype=torch.uint8))
    done = threading.Semaphore(0)
    errors: list[BaseException] = []

    def cb(r: Request) -> None:
        if r.error:
            errors.append(r.error)
        done.release()

    offsets = [f.alloc() for _ in range(n)]
    for i, o in enumerate(offsets):
        engine.submit(
            Request(Op.WRITE, f.fd, f.path, o, src.address + i * (64 << 10), 64 << 10, cb)
        )
    for _ in range(n):
        done.acquire()
    dst = AlignedBuffer(src.nbytes)
    for i, o in enumerate(offsets):
        engine.submit(Request(Op.READ, f.fd, f.path, o, dst.address + i * (64 << 10), 64 << 10, cb))
    for _ in range(n):
        done.acquire()
    engine.close()
    assert not errors
    assert torch.equal(dst.tensor, src.tensor)
    dst.close()
    store.close()
    src.close()


def test_engine_error_names_path(make_engine: MakeEngine, disk_dir: Path) -> None:
    engine = make_engine(1)  # first: engines open descriptors of their own (eventfd, ring)
    f = SlotFile(str(disk_dir), 4096, "auto")
    fd, path = f.fd, f.path
    f.close()  # the descriptor is now invalid
    got: list[Request] = []
    buf = AlignedBuffer(4096)
    ev = threading.Event()
    engine.submit(
        Request(Op.WRITE, fd, path, 0, buf.address, 4096, lambda r: (got.append(r), ev.set()))
    )
    assert ev.wait(10)
    engine.close()
    err = got[0].error
    assert isinstance(err, OSError) and err.errno == errno.EBADF and err.filename == path
    buf.close()


def test_striping_over_three_dirs(engine_options: dict[str, str], disk_dir: Path) -> None:
    dirs = [disk_dir / f"d{i}" for i in range(3)]
    for d in dirs:
        d.mkdir()
    off = Offloader(
        ssd_dirs=[str(d) for d in dirs],
        min_bytes=1,
        chunk_bytes=64 << 10,
        staging_bytes=4 << 20,
        **engine_options,  # type: ignore[arg-type]
    )
    x = torch.ones(1, requires_grad=True)
    payload = torch.randn(1 << 18)  # 1 MiB = 16 chunks
    SavePayload.seen.clear()
    with off:
        y = SavePayload.apply(x, payload)
    off.synchronize()
    disk = off.runtime.backend._disk  # type: ignore[union-attr]
    used = [f.used_slots for f in disk.files]
    assert all(u >= 5 for u in used), used
    y.sum().backward()
    assert torch.equal(SavePayload.seen[0], payload)
    off.close()
    for d in dirs:
        assert not list(d.iterdir())
        d.rmdir()


class FaultyEngine(PythonEngine):
    """Fails writes after ``ok_writes`` (ENOSPC), or every read (EIO)."""

    def __init__(self, *, ok_writes: int = 10**9, fail_reads: bool = False) -> None:
        super().__init__(2)
        self.ok_writes = ok_writes
        self.fail_reads = fail_reads
        self._n = 0
        self._lock2 = threading.Lock()

    def submit(self, request: Request) -> None:
        if request.op is Op.WRITE:
            with self._lock2:
                self._n += 1
                fail = self._n > self.ok_writes
            if fail:
                request.before = _raiser(errno.ENOSPC, request.path)
        elif self.fail_reads:
            request.before = _raiser(errno.EIO, request.path)
        super().submit(request)


def _raiser(code: int, path: str):  # type: ignore[no-untyped-def]
    def f() -> None:
        raise OSError(code, os.strerror(code), path)

    return f


def test_disk_full_keeps_tensors_and_result(make_offloader: MakeOffloader, disk_dir: Path) -> None:
    from tests._support.helpers import assert_bitwise_equal, train
    from tests.properties.test_equivalence import MODELS

    make_model, make_input = MODELS["gpt"]
    reference = train(make_model, make_input, None)
    off = make_offloader(disk_dir, io_engine=FaultyEngine(ok_writes=5))
    with pytest.warns(RuntimeWarning, match="write failed"):
        got = train(make_model, make_input, off)
    assert_bitwise_equal(reference, got)
    off.synchronize()
    st = off.stats()
    assert st.fallbacks > 0 and st.resident_bytes == 0 and st.disk_bytes == 0
    off.close()


def test_read_error_raises_never_wrong_bytes(make_offloader: MakeOffloader, disk_dir: Path) -> None:
    off = make_offloader(disk_dir, io_engine=FaultyEngine(fail_reads=True))
    x = torch.randn(512, 512, requires_grad=True)
    with off:
        z = (x * 2).sin()
    off.synchronize()
    with pytest.raises(OSError, match="reading back") as e:
        z.sum().backward()
    assert e.value.filename is not None and str(disk_dir) in e.value.filename
    off.close()


def test_real_enospc_on_small_filesystem(
    make_offloader: MakeOffloader, tmp_path: Path, engine_name: str
) -> None:
    """A 16 MiB loop-mounted ext4: the disk really fills up, and the engine says so (ENOSPC,
    not a generic EIO, even when the last write before the end was short)."""
    with loop_ext4(tmp_path) as mnt:
        from tests._support.helpers import assert_bitwise_equal, train
        from tests.properties.test_equivalence import mlp

        def make_input(g: torch.Generator) -> torch.Tensor:
            return torch.randn(16384, 64, generator=g)  # ~ 50 MiB of activations per step

        reference = train(mlp, make_input, None, steps=2)
        off = make_offloader(mnt, staging_bytes=4 << 20)
        with pytest.warns(RuntimeWarning, match=r"write failed \(\[Errno 28\]"):
            got = train(mlp, make_input, off, steps=2)
        assert_bitwise_equal(reference, got)
        assert off.stats().fallbacks > 0
        off.close()
        assert not [p for p in mnt.iterdir() if p.name != "lost+found"]


def test_buffered_fallback_when_o_direct_refused(
    make_offloader: MakeOffloader,
    disk_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A file system that refuses O_DIRECT (EINVAL at open) gets buffered I/O, logged and counted."""
    real_open = os.open

    def fake_open(path, flags, *a, **k):  # type: ignore[no-untyped-def]
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument", path)
        return real_open(path, flags, *a, **k)

    monkeypatch.setattr(os, "open", fake_open)
    with caplog.at_level("WARNING", logger="offloadd"):
        off = make_offloader(disk_dir)
    assert off.stats().buffered_io
    assert any("buffered" in r.message for r in caplog.records)
    monkeypatch.undo()
    _check_round_trip(off)
    with pytest.raises(ValueError, match="cannot create"):
        monkeypatch.setattr(os, "open", fake_open)
        make_offloader(disk_dir, direct_io="on")


def test_direct_io_off(make_offloader: MakeOffloader, disk_dir: Path) -> None:
    off = make_offloader(disk_dir, direct_io="off")
    assert off.stats().buffered_io
    _check_round_trip(off)


def _check_round_trip(off: Offloader) -> None:
    x = torch.randn(512, 512, requires_grad=True)
    expected = torch.autograd.grad((x * 2).sin().sum(), x)[0]
    with off:
        z = (x * 2).sin()
    off.synchronize()
    (g,) = torch.autograd.grad(z.sum(), x)
    assert torch.equal(g, expected)
    assert off.stats().bytes_read > 0
    off.close()


def test_callback_exception_does_not_kill_io_thread(
    make_engine: MakeEngine, disk_dir: Path
) -> None:
    f = SlotFile(str(disk_dir), 4096, "auto")
    engine = make_engine(1)
    buf = AlignedBuffer(4096)
    ok = threading.Event()

    def bad(r: Request) -> None:
        raise RuntimeError("callback bug")

    engine.submit(Request(Op.WRITE, f.fd, f.path, 0, buf.address, 4096, bad))
    engine.submit(Request(Op.WRITE, f.fd, f.path, 0, buf.address, 4096, lambda r: ok.set()))
    assert ok.wait(10), "the I/O thread died with the first callback"
    engine.close()
    f.close()
    buf.close()


@pytest.mark.parametrize(
    ("npages", "head", "tail"),
    [(1, True, False), (2, True, True), (2, False, True), (3, True, True), (700, True, True)],
)
def test_write_head_and_tail_pages(
    make_engine: MakeEngine, npages: int, head: bool, tail: bool, disk_dir: Path
) -> None:
    """A write's first and last page come from their own addresses (the zero-copy path's bounce
    pages), in file order; the rest from the request's address, cut into chunks as usual."""
    nbytes = npages * 4096
    f = SlotFile(str(disk_dir), nbytes, "on")
    engine = make_engine(4)
    src = AlignedBuffer(nbytes)
    src.tensor.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8))
    pages = AlignedBuffer(2 * 4096)
    pages.tensor.copy_(torch.randint(0, 256, (2 * 4096,), dtype=torch.uint8))
    expect = src.tensor.clone()
    if head:
        expect[:4096] = pages.tensor[:4096]
    if tail:
        expect[-4096:] = pages.tensor[4096:]
    ev = threading.Event()
    got: list[Request] = []
    req = Request(
        Op.WRITE,
        f.fd,
        f.path,
        0,
        src.address,
        nbytes,
        lambda r: (got.append(r), ev.set()),
        head=pages.address if head else 0,
        tail=pages.address + 4096 if tail else 0,
    )
    engine.submit(req)
    assert ev.wait(10) and got[0].error is None
    dst = AlignedBuffer(nbytes)
    ev.clear()
    engine.submit(Request(Op.READ, f.fd, f.path, 0, dst.address, nbytes, lambda r: ev.set()))
    assert ev.wait(10)
    engine.close()
    assert torch.equal(dst.tensor, expect)
    dst.close()
    f.close()
    src.close()
    pages.close()


def test_head_and_tail_pages_are_for_writes_of_whole_pages() -> None:
    with pytest.raises(ValueError, match="head/tail"):
        Request(Op.READ, 0, "x", 0, 0, 8192, lambda r: None, head=4096)
    with pytest.raises(ValueError, match="head/tail"):
        Request(Op.WRITE, 0, "x", 0, 0, 4096, lambda r: None, tail=4096)
