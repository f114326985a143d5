"""The native engine on its own: both backends, odd sizes, unaligned buffers, errors, cancel."""

from __future__ import annotations

import errno
import os
import random
import select
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from offloadd import Config, Offloader
from offloadd.io import native
from offloadd.io.buffers import AlignedBuffer
from offloadd.io.engine_choice import open_host_engine
from offloadd.io.native import NativeEngine
from offloadd.io.request import Op, Request, RequestState
from tests._support.helpers import SavePayload

BACKENDS = ["threads", "uring"]
ENGINE_PARAMS = ("default",)  # disk_dir once: these tests choose their engines themselves


@pytest.fixture(params=BACKENDS)
def engine(request: pytest.FixtureRequest) -> Iterator[NativeEngine]:
    if request.param == "uring" and not native.uring_available()[0]:
        pytest.skip(f"io_uring unavailable: {native.uring_available()[1]}")
    eng = NativeEngine(4, chunk_bytes=64 << 10, backend=request.param, depth=16)
    yield eng
    eng.close()


def _direct_file(disk_dir: Path, name: str = "data") -> tuple[int, str]:
    path = str(disk_dir / name)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
    return fd, path


class Waiter:
    """Collects callbacks; ``wait(n)`` returns the first n finished requests."""

    def __init__(self) -> None:
        self.done: list[Request] = []
        self.cond = threading.Condition()

    def __call__(self, r: Request) -> None:
        with self.cond:
            self.done.append(r)
            self.cond.notify_all()

    def wait(self, n: int, timeout: float = 30.0) -> list[Request]:
        with self.cond:
            assert self.cond.wait_for(lambda: len(self.done) >= n, timeout), "engine hung"
            return list(self.done)


def _bytes(n: int, seed: int) -> torch.Tensor:
    return torch.randint(
        0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed)
    )


def _io(engine: NativeEngine, op: Op, fd: int, path: str, offset: int, t: torch.Tensor) -> Request:
    w = Waiter()
    req = Request(op, fd, path, offset, t.data_ptr(), t.numel(), w, keepalive=t)
    engine.submit(req)
    (got,) = w.wait(1)
    return got


@pytest.mark.parametrize("nbytes", [1, 4095, 4096, 4097, (1 << 20) + 3])
@pytest.mark.parametrize("misalign", [0, 1, 100])
def test_odd_sizes_unaligned_buffers(
    engine: NativeEngine, disk_dir: Path, nbytes: int, misalign: int
) -> None:
    """O_DIRECT files with buffers at any address and any length: the engine stages them."""
    fd, path = _direct_file(disk_dir)
    src = _bytes(nbytes + misalign, nbytes)[misalign:]
    assert _io(engine, Op.WRITE, fd, path, 0, src).error is None
    dst_base = torch.zeros(nbytes + 7, dtype=torch.uint8)
    dst = dst_base[7:]  # misaligned by 7
    assert _io(engine, Op.READ, fd, path, 0, dst).error is None
    assert torch.equal(dst, src)
    assert torch.count_nonzero(dst_base[:7]) == 0  # nothing written before the buffer
    os.close(fd)
    os.unlink(path)


@pytest.mark.slow
def test_199_mib_plus_one(engine: NativeEngine, disk_dir: Path) -> None:
    fd, path = _direct_file(disk_dir)
    src = _bytes((199 << 20) + 1, 1)
    assert _io(engine, Op.WRITE, fd, path, 0, src).error is None
    dst = torch.empty_like(src)
    assert _io(engine, Op.READ, fd, path, 0, dst).error is None
    assert torch.equal(dst, src)
    os.close(fd)
    os.unlink(path)


def test_many_concurrent_requests(engine: NativeEngine, disk_dir: Path) -> None:
    """300 requests of mixed sizes over 3 files in 3 directories, all in flight together."""
    rng = random.Random(0)
    files = []
    for i in range(3):
        d = disk_dir / f"d{i}"
        d.mkdir()
        files.append(_direct_file(d))
    sizes = [rng.choice([1, 4096, 5000, 65536, 200_000]) for _ in range(300)]
    srcs = [_bytes(n, i) for i, n in enumerate(sizes)]
    offsets = []
    nxt = [0, 0, 0]
    for i, n in enumerate(sizes):
        k = i % 3
        offsets.append((k, nxt[k]))
        nxt[k] += (n + 4095) // 4096 * 4096
    w = Waiter()
    for (k, off), src in zip(offsets, srcs, strict=True):
        fd, path = files[k]
        engine.submit(Request(Op.WRITE, fd, path, off, src.data_ptr(), src.numel(), w))
    assert all(r.error is None for r in w.wait(300))
    dsts = [torch.empty_like(s) for s in srcs]
    w2 = Waiter()
    for (k, off), dst in zip(offsets, dsts, strict=True):
        fd, path = files[k]
        engine.submit(Request(Op.READ, fd, path, off, dst.data_ptr(), dst.numel(), w2))
    assert all(r.error is None for r in w2.wait(300))
    for s, d in zip(srcs, dsts, strict=True):
        assert torch.equal(s, d)
    for i, (fd, path) in enumerate(files):
        os.close(fd)
        os.unlink(path)
        (disk_dir / f"d{i}").rmdir()


def test_kernel_eio_surfaces_as_oserror_with_path(engine: NativeEngine) -> None:
    """A real EIO from the kernel: /proc/self/mem at address 0, which is never mapped."""
    fd = os.open("/proc/self/mem", os.O_RDWR)
    buf = torch.zeros(8192, dtype=torch.uint8)
    for op in (Op.READ, Op.WRITE):
        r = _io(engine, op, fd, "/proc/self/mem", 0, buf)
        assert isinstance(r.error, OSError)
        assert r.error.errno == errno.EIO and r.error.filename == "/proc/self/mem"
    os.close(fd)


def test_unaligned_offset_on_o_direct_is_refused_with_path(
    engine: NativeEngine, disk_dir: Path
) -> None:
    fd, path = _direct_file(disk_dir)
    r = _io(engine, Op.WRITE, fd, path, 5, torch.zeros(4096, dtype=torch.uint8))
    assert isinstance(r.error, OSError) and r.error.errno == errno.EINVAL
    assert r.error.filename == path
    os.close(fd)
    os.unlink(path)


def test_cancel_and_close_drain(disk_dir: Path) -> None:
    """Cancelled requests never call back; close() finishes every other one."""
    eng = NativeEngine(1, chunk_bytes=64 << 10, backend="threads")
    fd, path = _direct_file(disk_dir)
    src = _bytes(64 << 10, 0)
    w = Waiter()
    reqs = [
        Request(Op.WRITE, fd, path, i * (64 << 10), src.data_ptr(), src.numel(), w)
        for i in range(200)
    ]
    for r in reqs:
        eng.submit(r)
    cancelled = [r for r in reversed(reqs) if eng.cancel(r)]
    assert cancelled, "the last of 200 queued writes on one thread should still be pending"
    eng.close()
    assert len(w.done) == 200 - len(cancelled)
    assert all(r.state is RequestState.CANCELLED for r in cancelled)
    assert all(r.state is RequestState.DONE and r.error is None for r in w.done)
    assert not eng.cancel(reqs[0])
    with pytest.raises(RuntimeError, match="closed"):
        eng.submit(reqs[0])
    os.close(fd)
    os.unlink(path)


def test_eventfd_signals_completion(disk_dir: Path) -> None:
    from offloadd.io import _native

    eng = _native.Engine(threads=2, chunk_bytes=4096)
    fd, path = _direct_file(disk_dir)
    buf = _bytes(4096, 3)
    eng.submit(7, 1, fd, 0, buf.data_ptr(), 4096)
    readable, _, _ = select.select([eng.fileno()], [], [], 10)
    assert readable
    assert eng.reap(timeout=0) == [(7, 0, 4096)]
    assert eng.reap(timeout=0.01) == []
    assert eng.counters()["bytes_written"] == 4096
    eng.close()
    os.close(fd)
    os.unlink(path)


def test_bad_arguments_name_the_value() -> None:
    from offloadd.io import _native

    with pytest.raises(ValueError, match=r"chunk_bytes .* got 1000"):
        _native.Engine(chunk_bytes=1000)
    with pytest.raises(ValueError, match=r"backend .* 'disk'"):
        _native.Engine(backend="disk")
    with pytest.raises(ValueError, match=r"threads .* got 0"):
        _native.Engine(threads=0)
    with pytest.raises(ValueError, match="backend"):
        NativeEngine(backend="fast")


def test_auto_falls_back_to_python_and_says_why(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, disk_dir: Path
) -> None:
    monkeypatch.setattr(native, "_load", lambda: (None, "simulated: extension not built"))
    with caplog.at_level("INFO", logger="offloadd"):
        eng, choice = open_host_engine(Config(engine="auto"))
    eng.close()
    assert choice.name == "python" and "simulated" in choice.reason
    assert "simulated: extension not built" in caplog.text
    with pytest.raises(RuntimeError, match="engine = native, but simulated"):
        open_host_engine(Config(engine="native"))
    # and training still works, on the fallback
    off = Offloader(ssd_dirs=[str(disk_dir)], min_bytes=1, engine="auto")
    assert off.stats().engine == "python"
    x = torch.ones(1, requires_grad=True)
    payload = torch.randn(4096)
    SavePayload.seen.clear()
    with off:
        y = SavePayload.apply(x, payload)
    y.sum().backward()
    assert torch.equal(SavePayload.seen[0], payload)
    off.close()


def test_auto_picks_native_and_logs(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("INFO", logger="offloadd"):
        eng, choice = open_host_engine(Config())
    eng.close()
    assert choice.name.startswith("native/")
    assert f"I/O engine {choice.name}" in caplog.text
    eng, choice = open_host_engine(Config(io_uring="off"))
    eng.close()
    assert choice.name == "native/threads"


def test_deleted_directory_while_training(disk_dir: Path) -> None:
    """Offload files are unnamed (O_TMPFILE) or unlinked: removing the directory mid-run is harmless."""
    sub = disk_dir / "gone"
    sub.mkdir()
    off = Offloader(ssd_dirs=[str(sub)], min_bytes=1, chunk_bytes=64 << 10, staging_bytes=1 << 20)
    x = torch.ones(1, requires_grad=True)
    payload = torch.randn(1 << 18)
    SavePayload.seen.clear()
    with off:
        y = SavePayload.apply(x, payload)
    sub.rmdir()
    off.synchronize()
    y.sum().backward()
    assert torch.equal(SavePayload.seen[0], payload)
    off.close()


def test_refused_io_uring_falls_back_to_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where a seccomp profile refuses io_uring, auto uses the thread pool and says why; on errors."""
    monkeypatch.setattr(native, "uring_available", lambda: (False, "simulated: EPERM"))
    eng, choice = open_host_engine(Config(io_uring="auto"))
    eng.close()
    assert choice.name == "native/threads" and "simulated: EPERM" in choice.reason
    with pytest.raises(RuntimeError, match=r"io_uring = on, but .*simulated: EPERM"):
        open_host_engine(Config(io_uring="on"))


def test_cancel_while_before_hook_runs_is_refused(disk_dir: Path) -> None:
    """Once the gate runs a request's hook it counts as started: cancel says no, and the request
    completes exactly once (here with the hook's error)."""
    eng = NativeEngine(1, chunk_bytes=64 << 10, backend="threads")
    fd, path = _direct_file(disk_dir)
    entered, release = threading.Event(), threading.Event()

    def hook() -> None:
        entered.set()
        release.wait(10)
        raise OSError(errno.EIO, "hook failed")

    buf = _bytes(4096, 5)
    w = Waiter()
    req = Request(Op.WRITE, fd, path, 0, buf.data_ptr(), 4096, w, before=hook)
    eng.submit(req)
    assert entered.wait(10)
    assert not eng.cancel(req)
    release.set()
    (done,) = w.wait(1)
    eng.close()
    assert len(w.done) == 1 and isinstance(done.error, OSError) and done.error.filename == path
    os.close(fd)
    os.unlink(path)


def test_engine_creation_failing_on_emfile_leaves_other_fds_alone() -> None:
    """No descriptors left: Engine() raises OSError and closes nothing it does not own."""
    code = """
import os, resource
from offloadd.io import _native
keep = []
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (64, hard))
try:
    while True:
        keep.append(os.open("/dev/null", os.O_RDONLY))
except OSError:
    pass
for backend in ("threads", "uring"):
    try:
        _native.Engine(backend=backend)
    except OSError:
        pass
    else:
        raise SystemExit("Engine() did not fail")
os.fstat(0); os.fstat(1); os.fstat(2)
print("ok")
"""
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


def test_read_overtakes_writes_in_flight(engine: NativeEngine, disk_dir: Path) -> None:
    """A read submitted while long writes run starts at once (the io_uring thread is woken, a
    free pool thread takes it): it finishes before them, not after the next write completes."""
    fd, path = _direct_file(disk_dir)
    small = _bytes(4096, 1)
    assert _io(engine, Op.WRITE, fd, path, 0, small).error is None
    big = AlignedBuffer(64 << 20)  # aligned, as the offloader's are: no bounce copies
    order: list[str] = []
    lock = threading.Lock()
    w = Waiter()

    def note(name: str) -> Callable[[Request], None]:
        def cb(r: Request) -> None:
            with lock:
                order.append(name)
            w(r)

        return cb

    eng = NativeEngine(5, chunk_bytes=64 << 20, backend=engine.backend, depth=6)
    # Overwrites, as offload slots are after the first step (ext4 serializes extending writes
    # with reads of the same file, whatever the engine does).
    lay = Waiter()
    for k in range(4):
        eng.submit(Request(Op.WRITE, fd, path, (k + 1) * (64 << 20), big.address, big.nbytes, lay))
    lay.wait(4)
    for k in range(4):
        eng.submit(
            Request(
                Op.WRITE, fd, path, (k + 1) * (64 << 20), big.address, big.nbytes, note(f"w{k}")
            )
        )
    dst = torch.zeros(4096, dtype=torch.uint8)
    eng.submit(Request(Op.READ, fd, path, 0, dst.data_ptr(), 4096, note("read")))
    w.wait(5)
    eng.close()
    big.close()
    assert order[-1] != "read", order  # not held back until every write is done
    assert torch.equal(dst, small)
    os.close(fd)
    os.unlink(path)
