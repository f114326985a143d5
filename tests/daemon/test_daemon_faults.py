"""Faults a multi-day job on a shared node must survive in daemon mode: a daemon that stops
answering (SIGSTOP, wedged), a slow or hung file system under the daemon, a daemon lost more than
once; and ``offloadd serve`` on a base install (no extras)."""

from __future__ import annotations

import ctypes
import errno
import importlib.metadata
import logging
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

from offloadd import Config, Offloader
from offloadd.backend import daemon_ending
from offloadd.backend.daemon import DaemonBackend
from offloadd.config import DaemonConfig
from offloadd.io import python_engine as engine_module
from offloadd.io.buffers import AlignedBuffer
from offloadd.io.request import Op, Request
from offloadd.runtime import stall_watch
from offloadd.wire import protocol as proto
from tests._support.daemon_proc import DaemonProc, RawSession, held_descriptors
from tests._support.helpers import small_offloader

ROOT = Path(__file__).resolve().parents[2]
NOTHING = {"files": 0, "memfds": 0, "mappings": 0}
CHUNK = 64 << 10


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
    b.submit(Request(op, *b.target(0), voffset, address, CHUNK, done))
    return done


def _stopped_daemon_holding_a_write_and_a_read(
    d: DaemonProc, b: DaemonBackend, dest: AlignedBuffer
) -> tuple[_Done, _Done, bytes]:
    """Write a chunk, SIGSTOP the daemon, then send a write and a read of that chunk that it
    never answers. Returns (the write, the read, the chunk's bytes)."""
    data = os.urandom(CHUNK)
    staging = b.staging()
    slot_a, slot_b = staging.acquire(), staging.acquire()
    assert slot_a is not None and slot_b is not None
    ctypes.memmove(staging.address(slot_a), data, CHUNK)
    _, written = b.place(0)
    w = _submit(b, Op.WRITE, written, staging.address(slot_a))
    assert w.event.wait(30) and w.error is None
    d.pause()
    w2 = _submit(b, Op.WRITE, b.place(0)[1], staging.address(slot_b))
    r = _submit(b, Op.READ, written, dest.address)
    time.sleep(0.3)
    assert not w2.event.is_set() and not r.event.is_set()  # in flight, never answered
    return w2, r, data


def _backend(d: DaemonProc, warned: list[str]) -> DaemonBackend:
    cfg = Config(
        ssd_dirs=[str(d.dirs[0])],
        daemon=DaemonConfig(socket=d.socket),
        chunk_bytes=CHUNK,
        staging_bytes=4 * CHUNK,
        prefetch_bytes=4 * CHUNK,
    )
    return DaemonBackend(cfg, warn=lambda _key, message: warned.append(message))


def _timed_close(b: DaemonBackend, caplog: pytest.LogCaptureFixture) -> tuple[float, list[str]]:
    """close() on a thread; (seconds it took, the warnings logged). Fails if it hangs."""
    closer = threading.Thread(target=b.close, name="test-close", daemon=True)
    with caplog.at_level(logging.WARNING, logger="offloadd"):
        t0 = time.monotonic()
        closer.start()
        closer.join(15)
        took = time.monotonic() - t0
    assert not closer.is_alive(), "close() still waits after 15 s"
    return took, [rec.getMessage() for rec in caplog.records if rec.levelno == logging.WARNING]


def test_close_returns_when_the_daemon_stops_answering(
    own_daemon: Callable[..., DaemonProc],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A SIGSTOPped daemon holds a write and a read: close() gives up after its deadline, fails
    the write, reads the chunk from the session's file itself, and releases every descriptor."""
    monkeypatch.setattr(daemon_ending, "CLOSE_TIMEOUT_S", 1.0)
    d = own_daemon().start()
    warned: list[str] = []
    b = _backend(d, warned)
    dest = AlignedBuffer(CHUNK)
    try:
        w2, r, data = _stopped_daemon_holding_a_write_and_a_read(d, b, dest)
        took, msgs = _timed_close(b, caplog)
        assert 1.0 <= took < 5.0, took
        assert isinstance(w2.error, OSError) and w2.error.errno == errno.EPIPE
        assert r.event.is_set() and r.error is None
        assert bytes(dest.tensor.numpy()) == data  # read back from the session's file
        assert any(d.socket in m and "1 write" in m and "1 read" in m for m in msgs), msgs
        assert not warned  # closing: the Offloader is not told the daemon was lost
        dest.close()
        assert held_descriptors(os.getpid(), [str(x) for x in d.dirs]) == NOTHING
    finally:
        d.resume()
        dest.close()
    # The daemon, running again, ends the session that the client abandoned.
    assert not d.wait_idle()["sessions"]
    assert d.held() == NOTHING
    assert d.stop() == 0


def test_backward_waiting_on_a_stopped_daemon_says_so(
    own_daemon: Callable[..., DaemonProc],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A daemon SIGSTOPped between forward and backward: backward's wait for the read-back is
    logged once it has lasted STALL_WARN_S and again each time it has doubled, naming the
    daemon, its pid and its state; resumed, backward finishes with the gradients of a run
    without offloadd."""
    monkeypatch.setattr(stall_watch, "STALL_WARN_S", 0.3)
    d = own_daemon().start()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
    x = torch.randn(512, 64)
    model(x).square().sum().backward()
    want = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
    model.zero_grad()
    off = Offloader(
        tier="ssd",
        ssd_dirs=[str(d.dirs[0])],
        daemon=DaemonConfig(socket=d.socket),
        min_bytes=4096,
        chunk_bytes=CHUNK,
        staging_bytes=16 * CHUNK,
        prefetch_bytes=4 * CHUNK,
    )
    try:
        with off:
            loss = model(x).square().sum()
        off.synchronize()  # every write acknowledged: only backward's reads meet the stop
        assert off.stats().bytes_written > 0
        d.pause()
        back = threading.Thread(target=loss.backward, name="test-backward", daemon=True)
        with caplog.at_level(logging.WARNING, logger="offloadd"):
            back.start()
            time.sleep(1.5)
            d.resume()
            back.join(30)
        assert not back.is_alive(), "backward still waits after the daemon resumed"
        msgs = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        stalls = [m for m in msgs if "has waited" in m]
        assert len(stalls) >= 2, msgs  # at 0.3 s, 0.6 s, 1.2 s
        assert all("read-back" in m and d.socket in m for m in stalls), stalls
        assert any(f"pid {d.pid}, stopped" in m for m in stalls), stalls
        got = [p.grad for p in model.parameters()]
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))  # type: ignore[arg-type]
    finally:
        d.resume()
        off.close()
    assert d.stop() == 0


def test_close_returns_when_the_local_read_is_stuck_too(
    own_daemon: Callable[..., DaemonProc],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The daemon stops answering and the read close() makes from the session's file itself
    hangs on the disk as well: close() still returns within its deadlines, says so, and leaves
    the file open under the read, which completes with the right bytes once the disk answers."""
    monkeypatch.setattr(daemon_ending, "CLOSE_TIMEOUT_S", 1.0)
    monkeypatch.setattr(daemon_ending, "_TEARDOWN_TIMEOUT_S", 1.0)
    disk = threading.Event()
    real_transfer = engine_module.transfer

    def hung_reads(req: Request) -> None:
        if req.op is Op.READ:
            assert disk.wait(60), "the test never let the read go on"
        real_transfer(req)

    monkeypatch.setattr(engine_module, "transfer", hung_reads)
    d = own_daemon().start()
    b = _backend(d, [])
    dest = AlignedBuffer(CHUNK)
    try:
        _w2, r, data = _stopped_daemon_holding_a_write_and_a_read(d, b, dest)
        took, msgs = _timed_close(b, caplog)
        assert 2.0 <= took < 5.0, took  # both deadlines ran out, nothing more
        assert not r.event.is_set()
        assert any("still stuck" in m and "leaving those files open" in m for m in msgs), msgs
        disk.set()
        assert r.event.wait(30) and r.error is None
        assert bytes(dest.tensor.numpy()) == data  # its descriptor was never closed or reused
    finally:
        disk.set()
        d.resume()
        dest.close()
    assert d.stop() == 0


# -- a slow file system under the daemon -----------------------------------------------------------

# Makes psutil.disk_usage in the daemon take as many seconds as FLAG holds (when FLAG exists).
_SLOW_PROBE = """
import os, time
import psutil
_disk_usage = psutil.disk_usage
def disk_usage(path):
    try:
        with open({flag!r}) as f:
            time.sleep(float(f.read()))
    except FileNotFoundError:
        pass
    return _disk_usage(path)
psutil.disk_usage = disk_usage
"""


def test_a_slow_file_system_probe_never_stalls_sessions(
    own_daemon: Callable[..., DaemonProc], tmp_path: Path
) -> None:
    """psutil.disk_usage takes 2 s (an NFS mount, a dying disk): round trips stay fast; a daemon
    whose probe hangs still stops."""
    hook, flag = tmp_path / "hook", tmp_path / "slow"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(_SLOW_PROBE.format(flag=str(flag)))
    d = own_daemon(env=dict(os.environ, PYTHONPATH=str(hook))).start()
    raw = RawSession(d.socket)
    try:
        flag.write_text("2")
        time.sleep(1.2)  # the next sample (every second) starts a probe that takes 2 s
        worst_write = worst_stats = 0.0
        running: list[float] = []
        end = time.monotonic() + 3.0
        while time.monotonic() < end:
            t0 = time.monotonic()
            w = raw.write(os.urandom(4096))
            assert w.status == 0
            assert raw.call(proto.Msg.FREE, block=w.block).status == 0
            t1 = time.monotonic()
            doc = d.status()  # a new connection, handshake and STATS: no I/O
            t2 = time.monotonic()
            worst_write, worst_stats = max(worst_write, t1 - t0), max(worst_stats, t2 - t1)
            if doc.get("dirs_probe_running_s") is not None:
                running.append(doc["dirs_probe_running_s"])
            time.sleep(0.02)
        # a round trip behind the probe would take its 2 s; 1 s leaves room for a busy machine
        # (0.52 s seen with both cores taken by other tests)
        assert worst_write < 1.0, f"a write and free took {worst_write:.2f} s"
        assert worst_stats < 1.0, f"a status query took {worst_stats:.2f} s"
        assert running, "no probe was seen running: the test did not exercise a slow probe"
        (entry,) = d.status()["dirs"]
        assert entry["free_bytes"] > 0 and entry["age_s"] >= 0
        flag.write_text("3600")  # a hung file system
        deadline = time.monotonic() + 10
        while (running_s := d.status()["dirs_probe_running_s"] or 0.0) < 2.5:
            assert time.monotonic() < deadline, "no probe of the hung file system was seen"
            time.sleep(0.1)  # (a probe still reading "2" ends after 2 s)
        threads = len(os.listdir(f"/proc/{d.pid}/task"))
        time.sleep(2.5)  # samples go on, and do not start another probe beside the hung one
        assert d.status()["dirs_probe_running_s"] >= running_s + 2.4
        assert len(os.listdir(f"/proc/{d.pid}/task")) == threads
        w = raw.write(os.urandom(4096))
        assert w.status == 0
    finally:
        raw.close()
    t0 = time.monotonic()
    assert d.stop() == 0  # it does not wait for the hung probe
    assert time.monotonic() - t0 < 10


# -- every loss of the daemon is reported ----------------------------------------------------------


def test_every_daemon_loss_is_reported(own_daemon: Callable[..., DaemonProc]) -> None:
    """Two losses of two daemons (each gave this client session 1): two warnings, not one."""
    first = own_daemon().start()
    off = small_offloader(first.dirs[0], daemon={"socket": first.socket})
    daemon = off.runtime.backend
    assert daemon is not None

    def lose(d: DaemonProc) -> None:
        d.kill()
        deadline = time.monotonic() + 10
        while daemon.connected:
            assert time.monotonic() < deadline, "the client did not see the daemon go"
            time.sleep(0.01)

    with pytest.warns(RuntimeWarning) as got:
        lose(first)
        second = own_daemon(dirs=first.dirs).start()
        with off:
            pass
        assert daemon.connected
        lose(second)
        with off:  # flushes the Offloader's warnings
            pass
    lost = [str(w.message) for w in got if "lost the daemon" in str(w.message)]
    assert len(lost) == 2, lost
    off.close()
    assert held_descriptors(os.getpid(), [str(first.dirs[0])]) == NOTHING


# -- offloadd serve on a base install --------------------------------------------------------------


def _core_requirements() -> set[str]:
    """Names of the installed offloadd's requirements that no extra guards."""
    names = set()
    for line in importlib.metadata.requires("offloadd") or []:
        if "extra ==" in line:
            continue
        m = re.match(r"[A-Za-z0-9._-]+", line)
        assert m is not None, line
        names.add(m.group(0).lower().replace("_", "-"))
    return names


def test_serve_needs_no_extra(own_daemon: Callable[..., DaemonProc]) -> None:
    """uvloop and xxhash (the default checksum) are core dependencies; the ``daemon`` extra is
    kept (prometheus-client), and ``offloadd serve`` with the documented defaults warns of
    neither."""
    assert {"uvloop", "xxhash", "torch", "psutil"} <= _core_requirements()
    extras = importlib.metadata.metadata("offloadd").get_all("Provides-Extra") or []
    assert "daemon" in extras
    d = own_daemon("--config", str(ROOT / "configs" / "daemon.toml")).start()
    assert d.status()["checksum"] == "xxh3"
    assert d.stop() == 0
    log = d.log_text()
    assert "event loop: uvloop" in log
    warnings = [line for line in log.splitlines() if " WARNING " in line or " ERROR " in line]
    assert not [w for w in warnings if "uvloop" in w or "xxhash" in w], warnings


@pytest.mark.slow
def test_serve_on_a_fresh_base_install(tmp_path: Path) -> None:
    """The quick start's install in a fresh venv (torch first, then ``pip install
    --no-build-isolation <repo>``: not editable, no extras), then ``offloadd serve``,
    ``offloadd status`` and ``offloadd stop``."""
    src = tmp_path / "src"
    shutil.copytree(
        ROOT,
        src,
        ignore=shutil.ignore_patterns(
            ".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", "*.so", ".*_cache"
        ),
    )
    venv = tmp_path / "venv"
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("OFFLOADD", "PYTHON", "VIRTUAL_ENV"))
    }
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, env=env)
    pip = str(venv / "bin" / "pip")
    for args in (
        ["torch==2.13.0", "setuptools>=77"],
        ["--no-build-isolation", str(src)],
    ):
        done = subprocess.run(
            [pip, "install", "-q", *args], capture_output=True, text=True, env=env, timeout=1800
        )
        assert done.returncode == 0, done.stdout + done.stderr
    offloadd = str(venv / "bin" / "offloadd")
    sock = str(tmp_path / "run" / "daemon.sock")
    data = tmp_path / "data"
    data.mkdir()
    log_path = tmp_path / "serve.log"
    with open(log_path, "wb") as log:
        serve = subprocess.Popen(
            [offloadd, "serve", "--socket", sock, "--dir", str(data)],
            stdout=log,
            stderr=log,
            cwd=tmp_path,
            env=env,
        )
    try:
        deadline = time.monotonic() + 120
        while True:
            st = subprocess.run(
                [offloadd, "status", "--socket", sock],
                capture_output=True,
                text=True,
                cwd=tmp_path,
                env=env,
            )
            if st.returncode == 0:
                break
            assert serve.poll() is None, log_path.read_text()
            assert time.monotonic() < deadline, st.stderr + log_path.read_text()
            time.sleep(0.2)
        assert "checksum xxh3" in st.stdout, st.stdout
        stop = subprocess.run(
            [offloadd, "stop", "--socket", sock], capture_output=True, text=True, env=env
        )
        assert stop.returncode == 0, stop.stderr
        assert serve.wait(60) == 0
    finally:
        if serve.poll() is None:
            serve.kill()
            serve.wait()
    log_text = log_path.read_text()
    assert "event loop: uvloop" in log_text, log_text
    assert " WARNING " not in log_text and " ERROR " not in log_text, log_text
    assert not os.path.exists(sock) and not list(data.iterdir())
