"""One daemon shared by two users: root runs it with ``allowed_uids = [65534]``; a client runs as
uid 65534 (nobody) while a session of root's holds a block.

The client is a child process that imports offloadd, torch and the test helpers as root (the
clone and its virtual environment may lie where nobody cannot read: a 0700 home in CI), runs
the reference step, then drops to uid 65534 and does everything else as that user, reporting
each outcome as JSON. It runs once for the module; each test checks its part of the report.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from offloadd.backend.daemon_link import connect_control, recv_frame
from offloadd.wire import protocol as proto
from tests._support.daemon_proc import DaemonProc, RawSession

ROOT = Path(__file__).resolve().parents[2]
USER = 65534  # nobody: the allowed user
STRANGER = 65533  # not allowed
QUOTA = 9 << 20
BIG_CHUNK = 2 << 20  # the quota holds four of them, and what is left of other sessions
CAP = 2  # max_sessions of the session cap's daemon

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as other uids")

_CHILD = r"""
import contextlib, errno, fcntl, io, json, mmap, os, sys, traceback
sock_path, root, uid, big = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
sys.path.insert(0, root)
import torch
import offloadd.backend.daemon, offloadd.backend.daemon_ending, offloadd.io.python_engine
from offloadd.backend.daemon_link import connect_control, recv_frame
from offloadd.wire import protocol as proto
from offloadd.cli import main as cli_main
from offloadd.backend.cmd_status import query
import offloadd.backend.cmd_stop
from tests._support.daemon_proc import RawSession
from tests._support.helpers import assert_bitwise_equal, small_offloader, train
from tests.properties.test_equivalence import MODELS

from offloadd.runtime import host_allocator
reference = train(*MODELS["gpt"], None, steps=1)  # as root: imports everything a step needs
host_allocator.acquire()  # its extension module, loaded as root
host_allocator.release()
from offloadd.wire.checksum import checksum_function
checksum_function("xxh3")  # imports xxhash
os.setgroups([])
os.setgid(uid)
os.setuid(uid)
out = {}

def check(name, fn):
    try:
        out[name] = fn()
    except BaseException as e:
        out[name] = {"error": "".join(traceback.format_exception_only(e)).strip()}

def step():
    off = small_offloader("/nonexistent", daemon={"socket": sock_path})
    try:
        got = train(*MODELS["gpt"], off, steps=1)
        off.synchronize()
        st = off.stats()
    finally:
        off.close()
    assert_bitwise_equal(reference, got)
    return {"bytes_written": st.bytes_written, "fallbacks": st.fallbacks}

def descriptors():
    sock = connect_control(sock_path)
    sock.sendall(proto.encode_open(1, 4096, 4096, 4096, False))
    fds = []
    r = proto.decode_reply(recv_frame(sock, bytearray(), fds))
    assert r.status == 0, r.tail
    info = json.loads(r.tail)
    shm = mmap.mmap(fds[0], info["shm_bytes"])
    shm[:4096] = b"\xa7" * 4096
    sock.sendall(proto.encode_request(proto.Command(proto.Msg.WRITE, 2, shm_offset=0, nbytes=4096)))
    w = proto.decode_reply(recv_frame(sock, bytearray()))
    assert w.status == 0, w.tail
    files = []
    for fd, buffered in zip(fds[1:], info["buffered"]):
        flags = fcntl.fcntl(fd, fcntl.F_GETFL)
        try:
            os.write(fd, b"")
            written = 0
        except OSError as e:
            written = e.errno
        files.append({
            "read_only": flags & os.O_ACCMODE == os.O_RDONLY,
            "direct": bool(flags & os.O_DIRECT),
            "buffered": buffered,
            "write_errno": written,
        })
    page = mmap.mmap(-1, 4096)  # page-aligned, as O_DIRECT wants
    n = os.preadv(fds[1 + w.file], [page], w.offset)
    back = n == 4096 and page[:] == b"\xa7" * 4096
    shm.close()
    for fd in fds:
        os.close(fd)
    sock.close()
    return {"files": files, "read_back": back}

def stats():
    keep = RawSession(sock_path)  # a session of ours, open while we look
    try:
        doc = json.loads(query(sock_path).tail)
    finally:
        keep.close()
    return {"uids": [s["uid"] for s in doc["sessions"]], "errors": doc["recent_errors"]}

def quota():
    a, b = RawSession(sock_path, chunk=big, slots=1), RawSession(sock_path, chunk=big, slots=1)
    try:
        wa = [a.write(b"").status for _ in range(3)]
        wb = [b.write(b"") for _ in range(2)]
        return {"a": wa, "b": [r.status for r in wb], "b_why": wb[-1].tail.decode()}
    finally:
        a.close()
        b.close()

def stop():
    said = io.StringIO()
    with contextlib.redirect_stderr(said), contextlib.redirect_stdout(said):
        code = cli_main(["stop", "--socket", sock_path])  # offloadd stop
    out = {"code": code, "said": said.getvalue()}
    try:
        r = query(sock_path, proto.Msg.STOP)
        out.update(status=r.status, why=r.tail.decode())
    except Exception as e:
        out.update(status=None, why=repr(e))
    return out

for name, fn in [("step", step), ("descriptors", descriptors), ("stats", stats),
                 ("quota", quota), ("stop", stop)]:
    check(name, fn)
print(json.dumps(out))
"""

_STRANGER = (
    "import os,socket,sys;os.setuid(int(sys.argv[2]));s=socket.socket(socket.AF_UNIX);"
    "s.settimeout(10);s.connect(sys.argv[1])\n"
    "try: print(len(s.recv(1)))\nexcept OSError as e: print('err', e.errno)"
)


def _searchable_tmp() -> str:
    """A temporary directory every user may pass through (the socket's must be reachable)."""
    for cand in (tempfile.gettempdir(), "/tmp", "/var/tmp"):
        p, ok = Path(cand).resolve(), True
        for d in (p, *p.parents):
            ok = ok and bool(os.stat(d).st_mode & stat.S_IXOTH)
        if ok:
            return str(p)
    pytest.skip("no temporary directory that other users may pass through")


class Shared:
    """The shared daemon (started), root's session in it holding a block, and the report of the
    child that ran as the allowed user."""

    def __init__(self, d: DaemonProc) -> None:
        self.daemon = d
        self.modes = [stat.S_IMODE(os.stat(p).st_mode) for p in (Path(d.socket).parent, d.socket)]
        stranger = subprocess.run(
            [sys.executable, "-c", _STRANGER, d.socket, str(STRANGER)],
            capture_output=True,
            text=True,
        )
        self.stranger = stranger.stdout.strip() or stranger.stderr
        self.refused = d.status()["refused_connections"]
        with socket.socket(socket.AF_UNIX) as junk:  # root's error, in the recent errors
            junk.settimeout(10)
            junk.connect(d.socket)
            junk.sendall(b"\xff" * 64)
            assert junk.recv(1) == b""
        self.mine = RawSession(d.socket)
        self.data = os.urandom(4096)
        self.block = self.mine.write(self.data).block
        child = subprocess.run(
            [sys.executable, "-c", _CHILD, d.socket, str(ROOT), str(USER), str(BIG_CHUNK)],
            capture_output=True,
            text=True,
            timeout=300,
            env={k: v for k, v in os.environ.items() if not k.startswith("OFFLOADD")},
        )
        assert child.returncode == 0, child.stderr
        self.report: dict[str, Any] = json.loads(child.stdout.strip().splitlines()[-1])

    def part(self, name: str) -> Any:
        got = self.report[name]
        if isinstance(got, dict) and "error" in got:
            pytest.fail(f"{name}, as uid {USER}: {got['error']}")
        return got


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Shared]:
    base = Path(tempfile.mkdtemp(prefix="offloadd-multi-", dir=_searchable_tmp()))
    os.chmod(base, 0o711)  # the test's own directory: nobody may pass through to the socket's
    data = tmp_path_factory.mktemp("multiuser-data")
    config = base / "daemon.toml"
    config.write_text(f"[daemon]\nallowed_uids = [{USER}]\nquota_bytes = {QUOTA}\n")
    d = DaemonProc(base, "--config", str(config), dirs=[data])
    s: Shared | None = None
    try:
        s = Shared(d.start())
        yield s
    finally:
        if s is not None:
            s.mine.close()
        if d.proc is not None:
            d.stop()
        shutil.rmtree(base, ignore_errors=True)
    assert not list(data.iterdir()), "files left behind"


def test_allowed_uids_open_the_socket_to_them_alone(shared: Shared) -> None:
    """With allowed_uids the directory is 0711 and the socket 0666: the allowed user connects
    with nothing chmod'ed by hand, and trains a step through the daemon with bit-identical
    gradients; SO_PEERCRED still refuses every other uid."""
    step = shared.part("step")  # bit-identical: checked in the child
    assert step["bytes_written"] > 0 and step["fallbacks"] == 0  # through the daemon, all of it
    assert shared.modes == [0o711, 0o666]
    assert shared.stranger in ("0", f"err {errno.ECONNRESET}"), shared.stranger
    assert shared.refused == 1


def test_stats_shows_another_user_its_own_sessions_only(shared: Shared) -> None:
    """The allowed user's STATS lists its own sessions only, and none of the recent errors
    (they name other clients); root's lists everything."""
    stats = shared.part("stats")
    assert stats["uids"] == [USER] and stats["errors"] == [], stats
    doc = shared.daemon.status()  # root's view
    assert 0 in [s["uid"] for s in doc["sessions"]] and doc["recent_errors"], doc


def test_only_the_daemons_uid_or_root_may_stop_it(shared: Shared) -> None:
    """The allowed user's STOP is refused with EPERM, and ``offloadd stop`` says so; the daemon
    and root's session go on."""
    stop = shared.part("stop")
    assert stop["code"] == 1 and "refused" in stop["said"] and "uid 0" in stop["said"], stop
    assert stop["status"] == errno.EPERM and "uid 0" in stop["why"], stop
    d = shared.daemon
    assert d.proc is not None and d.proc.poll() is None, "the daemon stopped"
    r, got = shared.mine.read(shared.block)
    assert r.status == 0 and got == shared.data  # root's session kept its block throughout


def test_the_quota_is_per_user(shared: Shared) -> None:
    """Two sessions of the allowed user together hold at most the quota (four big chunks); root's
    block does not count against it."""
    q = shared.part("quota")
    assert q["a"] == [0, 0, 0] and q["b"] == [0, errno.EDQUOT], q
    assert "per user" in q["b_why"] and f"uid {USER}" in q["b_why"], q


def test_clients_get_read_only_descriptors(shared: Shared) -> None:
    """The session's files reach the client open for reading only (a write fails with EBADF:
    no writing past the quota through them), with O_DIRECT where the daemon's own descriptor
    has it, and a block the daemon wrote reads back through them (the path after a daemon
    loss)."""
    got = shared.part("descriptors")
    assert got["files"], got
    for f in got["files"]:
        assert f["write_errno"] == errno.EBADF and f["read_only"], got
        assert f["direct"] == (not f["buffered"]), got
    assert got["read_back"], got


def _open(path: str) -> tuple[int, str, socket.socket]:
    """OPEN a small session: (status, reason, the connection, kept open with its session)."""
    sock = connect_control(path)
    sock.sendall(proto.encode_open(1, 4096, 4096, 4096, False))
    fds: list[int] = []
    r = proto.decode_reply(recv_frame(sock, bytearray(), fds))
    for fd in fds:
        os.close(fd)
    return r.status, r.tail.decode(errors="replace"), sock


# argv: socket path, clone, uid, sessions to open. Imports as root, opens them as uid (each kept
# open until it exits), prints [[status, reason], ...].
_OPEN_AS = r"""
import json, os, sys
sock_path, root, uid, n = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
sys.path.insert(0, root)
import offloadd.config
from offloadd.backend.daemon_link import connect_control, recv_frame
from offloadd.wire import protocol as proto
os.setgroups([])
os.setgid(uid)
os.setuid(uid)
kept, got = [], []
for _ in range(n):
    sock = connect_control(sock_path)
    sock.sendall(proto.encode_open(1, 4096, 4096, 4096, False))
    fds = []
    r = proto.decode_reply(recv_frame(sock, bytearray(), fds))
    for fd in fds:
        os.close(fd)
    kept.append(sock)
    got.append([r.status, r.tail.decode(errors="replace")])
print(json.dumps(got))
"""


def test_the_session_cap_is_per_user(tmp_path: Path) -> None:
    """``max_sessions`` bounds the sessions of each uid, not of everyone together: root at its
    cap is refused (EUSERS), and the allowed user still opens as many of its own, no more."""
    base = Path(tempfile.mkdtemp(prefix="offloadd-cap-", dir=_searchable_tmp()))
    os.chmod(base, 0o711)
    config = base / "daemon.toml"
    config.write_text(f"[daemon]\nallowed_uids = [{USER}]\nmax_sessions = {CAP}\n")
    d = DaemonProc(base, "--config", str(config), dirs=[tmp_path / "data"])
    mine: list[tuple[int, str, socket.socket]] = []
    try:
        d.start()
        mine = [_open(d.socket) for _ in range(CAP + 1)]
        child = subprocess.run(
            [sys.executable, "-c", _OPEN_AS, d.socket, str(ROOT), str(USER), str(CAP + 1)],
            capture_output=True,
            text=True,
            timeout=120,
            env={k: v for k, v in os.environ.items() if not k.startswith("OFFLOADD")},
        )
        assert child.returncode == 0, child.stderr
        theirs = json.loads(child.stdout.strip().splitlines()[-1])
    finally:
        for _status, _why, sock in mine:
            sock.close()
        if d.proc is not None:
            d.stop()
        shutil.rmtree(base, ignore_errors=True)
    assert [status for status, _why, _sock in mine] == [0] * CAP + [errno.EUSERS], mine
    assert [status for status, _why in theirs] == [0] * CAP + [errno.EUSERS], theirs
    assert "uid 0" in mine[-1][1] and "per user" in mine[-1][1], mine
    assert f"uid {USER}" in theirs[-1][1] and "per user" in theirs[-1][1], theirs
