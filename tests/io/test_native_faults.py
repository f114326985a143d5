"""The native engine under faults: allocation failures, a failing io_uring_enter, failures while
completions are handed to Python. None may kill the process, lose a request or hang one: every
submitted request calls back exactly once, with an ``OSError``/``MemoryError`` or with its data
intact, and the engine goes on working (after a ring failure, on its thread pool).

The faults come from test hooks (``_native._inject_fault``, ``_native._hold_copies``) that only
the test build of the extension holds (tests/io/native_build.py; the fixtures of
tests/io/conftest.py put it in place of the installed module). Scenarios that used to ``abort()``
run in a child process, so that a regression fails the test instead of killing pytest."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

from offloadd.io import native
from tests.io.native_build import CHILD_INSTALL, SANITIZE

ENGINE_PARAMS = ("default",)  # disk_dir once: these tests choose their engines themselves

needs_uring = pytest.mark.skipif(
    not native.uring_available()[0], reason=f"io_uring unavailable: {native.uring_available()[1]}"
)

# Shared by the child processes: argv[1] is a directory on disk for O_DIRECT files, argv[2] the
# test build of offloadd.io._native (CHILD_INSTALL puts it in place).
_PRELUDE = (
    CHILD_INSTALL
    + r"""
import collections, errno, json, logging, os, sys, threading
import torch
from offloadd.io import _native
from offloadd.io.request import Op, Request
from offloadd.io.native import NativeEngine

DIR = sys.argv[1]
RECORDS = []


class Keep(logging.Handler):
    def emit(self, record):
        RECORDS.append(record)


logging.getLogger("offloadd").addHandler(Keep())
logging.getLogger("offloadd").setLevel(logging.INFO)


def data(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


def unaligned(t, by):
    # a copy of t at an address that is `by` bytes past a 4096 boundary
    base = torch.empty(t.numel() + 8192, dtype=torch.uint8)
    skip = (-base.data_ptr()) % 4096 + by
    out = base[skip : skip + t.numel()]
    out.copy_(t)
    return out


def direct_file(name):
    path = os.path.join(DIR, name)
    return os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600), path


class Batch:
    # counts callbacks per request: each must come exactly once
    def __init__(self):
        self.calls = collections.Counter()
        self.cond = threading.Condition()

    def __call__(self, r):
        with self.cond:
            self.calls[id(r)] += 1
            self.cond.notify_all()

    def run(self, eng, reqs, timeout=60):
        for r in reqs:
            eng.submit(r)
        with self.cond:
            ok = self.cond.wait_for(lambda: all(self.calls[id(r)] for r in reqs), timeout)
        left = sum(not self.calls[id(r)] for r in reqs)
        assert ok, f"engine hung: {left} of {len(reqs)} requests never called back"
        return reqs

    def check_once(self, reqs):
        assert all(self.calls[id(r)] == 1 for r in reqs), "a request called back twice"
        assert sum(self.calls.values()) == len(reqs), "callbacks for unknown requests"


def layout(sizes):
    offsets, at = [], 0
    for n in sizes:
        offsets.append(at)
        at += (n + 4095) // 4096 * 4096
    return offsets


def write_read(eng, fd, path, sizes, seed, batch, misalign=(0, 100)):
    # write `sizes` (every other buffer unaligned), read everything back; return (writes, reads)
    offsets = layout(sizes)
    srcs = [unaligned(data(n, seed + i), misalign[i % len(misalign)]) for i, n in enumerate(sizes)]
    writes = batch.run(eng, [
        Request(Op.WRITE, fd, path, off, t.data_ptr(), t.numel(), batch, keepalive=t)
        for off, t in zip(offsets, srcs)
    ])
    dsts = [unaligned(torch.zeros(n, dtype=torch.uint8), misalign[-1 - i % len(misalign)])
            for i, n in enumerate(sizes)]
    reads = batch.run(eng, [
        Request(Op.READ, fd, path, off, t.data_ptr(), t.numel(), batch, keepalive=t)
        for off, t in zip(offsets, dsts)
    ])
    for w, r, s, d in zip(writes, reads, srcs, dsts):
        if w.error is None and r.error is None:
            assert torch.equal(s, d), "data did not round-trip"
    return writes, reads
"""
)


def _child(body: str, build: Path, disk_dir: Path, timeout: float = 120) -> dict[str, Any]:
    """Run ``_PRELUDE + body`` in a fresh interpreter (``-P``: the installed offloadd, with the
    test build ``build`` of its native engine); it must exit 0 and print one JSON line last."""
    code = _PRELUDE + body
    try:
        proc = subprocess.run(
            [sys.executable, "-P", "-c", code, str(disk_dir), str(build)],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
    except subprocess.TimeoutExpired:
        proc = None
    if proc is None:
        pytest.fail(f"child hung: still running after {timeout} s")
    how = f"killed by signal {-proc.returncode}" if proc.returncode < 0 else f"rc {proc.returncode}"
    assert proc.returncode == 0, f"child exited: {how}\n--- stderr\n{proc.stderr[-6000:]}"
    return dict(json.loads(proc.stdout.strip().splitlines()[-1]))


@pytest.fixture
def scratch(disk_dir: Path) -> Iterator[Path]:
    """``disk_dir``, emptied afterwards whatever happened (the files here are the test's own)."""
    try:
        yield disk_dir
    finally:
        for p in disk_dir.iterdir():
            p.unlink()


# -- completions -------------------------------------------------------------------------------


def test_completion_delivery_failing_loses_nothing(scratch: Path, native_test_build: Path) -> None:
    """Handing finished requests to Python fails for lack of memory (the completion list could
    not grow): the completions wait for the next reap(), none is lost, the process lives."""
    backends = ["threads", "uring"] if native.uring_available()[0] else ["threads"]
    out = _child(
        f"""
for backend in {backends!r}:
    eng = NativeEngine(2, chunk_bytes=64 << 10, backend=backend, depth=8)
    fd, path = direct_file(backend)
    batch = Batch()
    _native._inject_fault("completion", 3, errno.ENOMEM)
    writes, reads = write_read(eng, fd, path, [1, 4096, 70000, 200_001] * 5, 7, batch)
    eng.close()
    batch.check_once(writes + reads)
    assert all(r.error is None for r in writes + reads), [r.error for r in writes + reads]
    os.close(fd)

# the raw API: reap() raises MemoryError and keeps the completions for the next call
fd, path = direct_file("raw")
eng = _native.Engine(threads=1)
for token in (1, 2, 3):
    eng.submit(token, 0, fd, 0, 0, 0)  # empty requests complete at once
_native._inject_fault("completion", 1, errno.ENOMEM)
try:
    eng.reap(timeout=5)
except MemoryError:
    pass
else:
    raise SystemExit("reap() did not fail")
got = eng.reap(timeout=5)
eng.close()
assert got == [(1, 0, 0), (2, 0, 0), (3, 0, 0)], got
errors = [r.getMessage() for r in RECORDS if r.levelname == "ERROR"]
print(json.dumps({{"errors_logged": len(errors)}}))
""",
        native_test_build,
        scratch,
    )
    assert out["errors_logged"] >= 3  # the dispatcher said so each time, and went on


# -- allocations -------------------------------------------------------------------------------


@needs_uring
def test_ring_slot_table_allocation_failing_raises_memoryerror(
    scratch: Path, native_test_build: Path
) -> None:
    """No memory for the io_uring backend's slot table: Engine() raises MemoryError (the ring
    thread used to abort() the process); the next engine works."""
    out = _child(
        """
_native._inject_fault("alloc", 1, errno.ENOMEM)
try:
    _native.Engine(backend="uring", depth=8)
except MemoryError:
    pass
else:
    raise SystemExit("Engine() did not report the failed allocation")
eng = NativeEngine(2, chunk_bytes=64 << 10, backend="uring", depth=8)
fd, path = direct_file("after")
batch = Batch()
writes, reads = write_read(eng, fd, path, [4097, 65536], 1, batch)
eng.close()
assert all(r.error is None for r in writes + reads)
print(json.dumps({"ok": True}))
""",
        native_test_build,
        scratch,
    )
    assert out == {"ok": True}


@pytest.mark.parametrize("kind", ["threads", pytest.param("uring", marks=needs_uring)])
def test_bounce_buffer_allocation_failing_fails_the_request(
    scratch: Path, kind: str, native_faults: ModuleType
) -> None:
    """No memory for a bounce buffer: that request fails with OSError(ENOMEM, path); the next
    one succeeds and the data round-trips."""
    from offloadd.io.request import Op, Request
    from tests.io.test_native import Waiter, _bytes, _direct_file

    eng = native.NativeEngine(2, chunk_bytes=64 << 10, backend=kind, depth=8)
    fd, path = _direct_file(scratch)
    src = _bytes(5000 + 3, 11)[3:]  # unaligned and not a multiple of 4096: bounced
    try:
        native_faults._inject_fault("alloc", 1, errno.ENOMEM)
        w = Waiter()
        eng.submit(Request(Op.WRITE, fd, path, 0, src.data_ptr(), src.numel(), w))
        (failed,) = w.wait(1)
        assert isinstance(failed.error, OSError) and failed.error.errno == errno.ENOMEM
        assert failed.error.filename == path
        w = Waiter()
        eng.submit(Request(Op.WRITE, fd, path, 0, src.data_ptr(), src.numel(), w))
        dst = torch.zeros(src.numel(), dtype=torch.uint8)
        assert w.wait(1)[0].error is None
        w = Waiter()
        eng.submit(Request(Op.READ, fd, path, 0, dst.data_ptr(), dst.numel(), w))
        assert w.wait(1)[0].error is None
        assert torch.equal(dst, src)
    finally:
        native_faults._inject_fault("alloc", 0, 0)
        eng.close()
        os.close(fd)


# -- io_uring_enter ----------------------------------------------------------------------------

_RING_FAILS = """
eng = NativeEngine(3, chunk_bytes=1 << 20, backend="uring", depth=8)
fd, path = direct_file("ring")
batch = Batch()
before = write_read(eng, fd, path, [4096, 5000], 1, batch)
assert eng.backend == "uring" and getattr(eng, "fallback", None) is None
# Large writes keep chunks in the kernel when the ring fails; the fault hits the next enter.
big = [data(4 << 20, 100 + i) for i in range(6)]
fd2, path2 = direct_file("big")
reqs = [Request(Op.WRITE, fd2, path2, i * (4 << 20), t.data_ptr(), t.numel(), batch,
                keepalive=t) for i, t in enumerate(big)]
for r in reqs:
    eng.submit(r)
_native._inject_fault("uring_enter", FAULTS, ERRNO)
sizes = [1, 4096, 70000, (1 << 20) + 3, 200_001] * 6
after = write_read(eng, fd, path, sizes, 50, batch)
with batch.cond:
    assert batch.cond.wait_for(lambda: all(batch.calls[id(r)] for r in reqs), 60), "big writes"
backend, why = eng.backend, getattr(eng, "fallback", None)
# the big writes round-trip too, through the thread pool now
back = [torch.zeros_like(t) for t in big]
rreqs = batch.run(eng, [Request(Op.READ, fd2, path2, i * (4 << 20), t.data_ptr(), t.numel(),
                                batch, keepalive=t) for i, t in enumerate(back)])
eng.close()
_native._inject_fault("uring_enter", 0, 0)
everything = before[0] + before[1] + reqs + after[0] + after[1] + rreqs
batch.check_once(everything)
errors = [repr(r.error) for r in everything if r.error is not None]
assert not errors, errors
assert all(torch.equal(a, b) for a, b in zip(big, back)), "big writes did not round-trip"
warnings = [r.getMessage() for r in RECORDS if r.levelname == "WARNING"]
print(json.dumps({"backend": backend, "why": why, "warnings": warnings}))
"""


@needs_uring
def test_ring_failure_falls_back_to_threads(scratch: Path, native_test_build: Path) -> None:
    """io_uring_enter fails (EPERM, as from a seccomp filter): the engine moves to its thread pool
    for good, serves what it held and everything after, and says so once at WARNING."""
    body = _RING_FAILS.replace("FAULTS", "1").replace("ERRNO", "errno.EPERM")
    out = _child(body, native_test_build, scratch)
    assert out["backend"] == "threads"
    assert "io_uring_enter" in out["why"] and os.strerror(errno.EPERM) in out["why"]
    assert len(out["warnings"]) == 1, out["warnings"]
    assert "threads" in out["warnings"][0] and out["why"] in out["warnings"][0]


_RING_FAILS_IN_TRAINING = """
from offloadd import Offloader

def step(off):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.GELU())
                                  for _ in range(4)])
    x = torch.randn(64, 256)
    ctx = off if off is not None else torch.autograd.graph.saved_tensors_hooks(lambda t: t,
                                                                               lambda t: t)
    with ctx:
        loss = model(x).square().mean()
    if off is not None:
        off.synchronize()  # the writes run (on the failing ring) before backward can cancel them
    loss.backward()
    return [p.grad for p in model.parameters()]

reference = step(None)
off = Offloader(tier="ssd", ssd_dirs=[DIR], min_bytes=0, engine="native", io_uring="on")
first = off.stats().engine
_native._inject_fault("uring_enter", 1, errno.EPERM)
got = step(off)
_native._inject_fault("uring_enter", 0, 0)
st = off.stats()
off.close()
same = all(torch.equal(a, b) for a, b in zip(reference, got))
print(json.dumps({"first": first, "after": st.engine, "same": same, "written": st.bytes_written,
                  "fallbacks": st.fallbacks}))
"""


@needs_uring
def test_ring_failure_in_training_is_reported_and_lossless(
    scratch: Path, native_test_build: Path
) -> None:
    """The ring fails mid-step under an Offloader: gradients stay bit-identical, nothing falls
    back to memory, and stats() names the engine that now runs (it said native/uring before)."""
    out = _child(_RING_FAILS_IN_TRAINING, native_test_build, scratch)
    assert out["first"] == "native/uring" and out["after"] == "native/threads", out
    assert out["same"] and out["written"] > 0 and out["fallbacks"] == 0, out


@needs_uring
def test_ring_transient_errors_are_retried(scratch: Path, native_test_build: Path) -> None:
    """A few EAGAIN from io_uring_enter are retried: still io_uring, nothing fails, no warning."""
    body = _RING_FAILS.replace("FAULTS", "5").replace("ERRNO", "errno.EAGAIN")
    out = _child(body, native_test_build, scratch)
    assert out == {"backend": "uring", "why": None, "warnings": []}


@needs_uring
def test_ring_persistent_eagain_falls_back(scratch: Path, native_test_build: Path) -> None:
    """EAGAIN that never ends (the kernel out of memory for requests) is not retried forever:
    after about a second the engine falls back to threads."""
    body = _RING_FAILS.replace("FAULTS", "-1").replace("ERRNO", "errno.EAGAIN")
    out = _child(body, native_test_build, scratch, timeout=60)
    assert out["backend"] == "threads" and os.strerror(errno.EAGAIN) in out["why"]
    assert len(out["warnings"]) == 1


# -- bounce copies and the engine's mutex ------------------------------------------------------


@pytest.mark.parametrize("op", ["write", "read"])
@pytest.mark.parametrize("kind", ["threads", pytest.param("uring", marks=needs_uring)])
def test_bounce_copy_runs_without_the_engine_mutex(
    scratch: Path, kind: str, op: str, native_faults: ModuleType
) -> None:
    """While a bounce-buffer copy is in progress (held in place by a test hook, as a copy of
    hundreds of MiB would be), submit(), cancel() and counters() return at once: the copy does
    not hold the engine's mutex, which those take with the GIL held."""
    _native = native_faults
    eng = _native.Engine(threads=2, chunk_bytes=1 << 20, backend=kind, depth=4)
    fd = os.open(str(scratch / "data"), os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
    n = 100_000
    src = torch.randint(0, 256, (n + 5,), dtype=torch.uint8)[5:]  # unaligned: bounced
    dst = torch.zeros(n + 5, dtype=torch.uint8)[5:]
    # what a read finds there: the data for a read test, zeros for a write test (request 3, a
    # read of the first 4096 bytes, may run before or during the write)
    eng.submit(1, 1, fd, 0, (src if op == "read" else dst).data_ptr(), n)
    assert eng.reap(timeout=30) == [(1, 0, n)]
    _native._hold_copies(True)
    try:
        if op == "write":
            eng.submit(2, 1, fd, 0, src.data_ptr(), n)
        else:
            eng.submit(2, 0, fd, 0, dst.data_ptr(), n)
        deadline = time.monotonic() + 30
        while _native._held_copies() == 0:
            assert time.monotonic() < deadline, "the bounce copy never started"
            time.sleep(0.001)
        spare = torch.zeros(4096 * 2, dtype=torch.uint8)
        aligned = spare[(-spare.data_ptr()) % 4096 :][:4096]
        t0 = time.monotonic()
        assert eng.cancel(12345) is False
        eng.counters()
        eng.submit(3, 0, fd, 0, aligned.data_ptr(), 4096)
        took = time.monotonic() - t0
        assert took < 2.5, f"submit/cancel/counters waited {took:.2f} s for the bounce copy"
        assert _native._held_copies() == 1, "the copy went on before the test let it"
    finally:
        _native._hold_copies(False)
    got: list[tuple[int, int, int]] = []
    deadline = time.monotonic() + 30
    while len(got) < 2 and time.monotonic() < deadline:
        got += eng.reap(timeout=1)
    eng.close()
    assert sorted(got) == [(2, 0, n), (3, 0, 4096)]
    if op == "read":
        assert torch.equal(dst, src)
    else:
        check = torch.zeros(n, dtype=torch.uint8)
        with open(scratch / "data", "rb") as f:
            check.numpy()[:] = memoryview(f.read(n))
        assert torch.equal(check, src)
    os.close(fd)


def test_fault_hooks_refuse_unknown_names(native_faults: ModuleType) -> None:
    _native = native_faults

    with pytest.raises(ValueError, match="unknown fault point 'disk'"):
        _native._inject_fault("disk", 1, errno.EIO)
    with pytest.raises(ValueError, match="errno"):
        _native._inject_fault("alloc", 1, 0)
    _native._inject_fault("alloc", 0, 0)


# -- the builds --------------------------------------------------------------------------------

HOOKS = ("_inject_fault", "_hold_copies", "_held_copies")


def test_production_module_holds_no_fault_hooks() -> None:
    """The module setup.py builds has none of the hooks, not even as a name in its binary."""
    from offloadd.io import _native

    assert [h for h in HOOKS if hasattr(_native, h)] == []
    binary = Path(str(_native.__file__)).read_bytes()
    assert [h for h in HOOKS if h.encode() in binary] == []


def test_test_build_is_the_production_sources_and_faults_c(native_faults: ModuleType) -> None:
    """The test build compiles what setup.py compiles, plus faults.c: setup.py lists every C
    source of csrc/io_native/ but that one."""
    from tests.io import native_build

    assert all(hasattr(native_faults, h) for h in HOOKS)
    setup = (native_build.ROOT / "setup.py").read_text(encoding="utf-8")
    for path in native_build.sources(faults=True):
        listed = f'"csrc/io_native/{path.name}"' in setup
        assert listed == (path.name != native_build.FAULTS_SOURCE), path.name


@pytest.mark.skipif(not SANITIZE, reason="only in a sanitized run (csrc/tests/sanitize.sh)")
def test_a_sanitized_run_uses_the_sanitized_build() -> None:
    """Under NATIVE_TESTS_SANITIZE=1 the engine the tests get is the sanitized build."""
    from offloadd.io import _native

    assert "offloadd-native-sanitized-" in str(_native.__file__)
    assert native._load()[0] is _native
