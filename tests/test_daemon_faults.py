"""Faults a multi-day job on a shared node must survive in daemon mode: a daemon that stops
answering (SIGSTOP, wedged)."""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from offloadd import OffloadConfig
from offloadd.daemon import client
from offloadd.daemon.client import DaemonBackend
from offloadd.engine import Op, Request
from offloadd.staging import AlignedBuffer

from .conftest import _disk_root
from .daemon_proc import DaemonProc, held_descriptors

NOTHING = {"files": 0, "memfds": 0, "mappings": 0}
CHUNK = 64 << 10


@pytest.fixture
def own() -> Iterator[Callable[..., DaemonProc]]:
    """Daemons of the test's own, stopped (and resumed first) afterwards; no file may be left."""
    root = Path(tempfile.mkdtemp(prefix="offloadd-faults-", dir=_disk_root()))
    procs: list[DaemonProc] = []

    def make(
        *args: str, dirs: list[Path] | None = None, env: dict[str, str] | None = None
    ) -> DaemonProc:
        p = DaemonProc(root, *args, dirs=dirs, env=env)
        procs.append(p)
        return p

    yield make
    for p in procs:
        if p.proc is not None and p.proc.poll() is None:
            p.resume()
            p.stop()
    leftovers = [q for p in procs for d in p.dirs if d.exists() for q in d.iterdir()]
    shutil.rmtree(root, ignore_errors=True)
    assert not leftovers, f"files left behind: {leftovers}"


# -- close() while the daemon does not answer ------------------------------------------------------


class _Done:
    """A request's callback that remembers the outcome."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.error: BaseException | None = None

    def __call__(self, req: Request) -> None:
        self.error = req.error
        self.event.set()


def _submit(b: DaemonBackend, op: Op, voffset: int, address: int) -> _Done:
    done = _Done()
    b.engine.submit(Request(op, -1, b.disk.files[0].path, voffset, address, CHUNK, done))
    return done


def test_close_returns_when_the_daemon_stops_answering(
    own: Callable[..., DaemonProc],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A SIGSTOPped daemon holds a write and a read: close() gives up after its deadline, fails
    the write, reads the chunk from the session's file itself, and releases every descriptor."""
    monkeypatch.setattr(client, "CLOSE_TIMEOUT_S", 1.0, raising=False)
    d = own().start()
    cfg = OffloadConfig(
        ssd_dirs=[str(d.dirs[0])],
        daemon_socket=d.socket,
        chunk_bytes=CHUNK,
        staging_bytes=4 * CHUNK,
        prefetch_bytes=4 * CHUNK,
    )
    warned: list[str] = []
    b = DaemonBackend(cfg, warn=lambda _key, message: warned.append(message))
    closer = threading.Thread(target=b.close, name="test-close", daemon=True)
    dest = AlignedBuffer(CHUNK)
    try:
        vfile = b.disk.files[0]
        data = os.urandom(CHUNK)
        slot_a, slot_b = b.staging.acquire(), b.staging.acquire()
        assert slot_a is not None and slot_b is not None
        ctypes.memmove(b.staging.address(slot_a), data, CHUNK)
        written = vfile.alloc()
        w = _submit(b, Op.WRITE, written, b.staging.address(slot_a))
        assert w.event.wait(30) and w.error is None
        d.pause()
        w2 = _submit(b, Op.WRITE, vfile.alloc(), b.staging.address(slot_b))
        r = _submit(b, Op.READ, written, dest.address)
        time.sleep(0.3)
        assert not w2.event.is_set() and not r.event.is_set()  # in flight, never answered
        with caplog.at_level(logging.WARNING, logger="offloadd"):
            t0 = time.monotonic()
            closer.start()
            closer.join(15)
            took = time.monotonic() - t0
        assert not closer.is_alive(), "close() still waits for the stopped daemon after 15 s"
        assert 1.0 <= took < 5.0, took
        assert isinstance(w2.error, OSError) and w2.error.errno == errno.EPIPE
        assert r.event.is_set() and r.error is None
        assert bytes(dest.tensor.numpy()) == data  # read back from the session's file
        msgs = [rec.getMessage() for rec in caplog.records if rec.levelno == logging.WARNING]
        assert any(d.socket in m and "1 write" in m and "1 read" in m for m in msgs), msgs
        assert not warned  # closing: the Offloader is not told the daemon was lost
        dest.close()
        assert held_descriptors(os.getpid(), [str(x) for x in d.dirs]) == NOTHING
    finally:
        d.resume()
        if closer.is_alive():
            closer.join(30)
        dest.close()
    # The daemon, running again, ends the session that the client abandoned.
    assert not d.wait_idle()["sessions"]
    assert d.held() == NOTHING
    assert d.stop() == 0
