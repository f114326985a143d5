"""``offloadd serve`` for real, as a subprocess: security, faults, cleanup, status."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import socket
import stat
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from offloadd import Config, Offloader
from offloadd.config import DaemonConfig
from offloadd.wire import protocol as proto
from tests._support.daemon_proc import DaemonProc, RawSession, held_descriptors
from tests._support.helpers import (
    SavePayload,
    assert_bitwise_equal,
    loop_ext4,
    small_offloader,
    train,
)
from tests.properties.test_equivalence import MODELS

ROOT = Path(__file__).resolve().parents[2]


def _client_leftovers(d: DaemonProc) -> dict[str, int]:
    return held_descriptors(os.getpid(), [str(x) for x in d.dirs])


def test_socket_and_directory_permissions(daemon: DaemonProc) -> None:
    assert stat.S_IMODE(os.stat(daemon.socket).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(os.path.dirname(daemon.socket)).st_mode) == 0o700


def test_an_existing_socket_directory_keeps_its_mode(
    own_daemon: Callable[..., DaemonProc],
) -> None:
    """The daemon sets the mode only of a socket directory it creates. One that exists (a home
    directory: ``--socket ~/d.sock``) and passes the trust rule is used as it is: the socket's
    own mode and the uid check at accept keep the others out. With allowed_uids, a directory
    they cannot pass through is logged as such."""
    d = own_daemon()
    run = Path(d.socket).parent
    run.mkdir()
    os.chmod(run, 0o755)
    d.start()
    assert stat.S_IMODE(os.stat(run).st_mode) == 0o755
    assert stat.S_IMODE(os.stat(d.socket).st_mode) == 0o600
    assert d.stop() == 0
    os.chmod(run, 0o700)
    allowed = own_daemon("--config", str(_toml(d.root, "[daemon]\nallowed_uids = [65534]")))
    allowed.start()
    assert stat.S_IMODE(os.stat(run).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(allowed.socket).st_mode) == 0o666
    log = allowed.log_text()
    assert "allowed_uids cannot reach" in log and f"{str(run)!r} (mode 0700)" in log, log


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to connect as another user")
def test_peer_uid_is_checked(own_daemon: Callable[..., DaemonProc]) -> None:
    """SO_PEERCRED: a foreign uid is refused even when file permissions would let it in."""
    code = (
        "import os,socket,sys;os.setuid(65534);s=socket.socket(socket.AF_UNIX);"
        "s.connect(sys.argv[1]);s.settimeout(10)\n"
        "try: print(len(s.recv(1)))\nexcept OSError as e: print('err', e.errno)"
    )
    d = own_daemon().start()
    os.chmod(d.root, 0o755)
    os.chmod(os.path.dirname(d.socket), 0o755)  # open the door: only the uid check remains
    os.chmod(d.socket, 0o777)
    out = subprocess.run([sys.executable, "-c", code, d.socket], capture_output=True, text=True)
    assert out.stdout.strip() in ("0", f"err {errno.ECONNRESET}"), out
    assert d.status()["refused_connections"] == 1
    assert "refused a connection from uid 65534" in d.log_text()
    d.stop()
    allowed = own_daemon("--config", str(_toml(d.root, "[daemon]\nallowed_uids = [65534]"))).start()
    os.chmod(os.path.dirname(allowed.socket), 0o755)
    os.chmod(allowed.socket, 0o777)
    hello = proto.encode_hello(0, "nobody").hex()
    talk = (
        "import os,socket,sys;os.setuid(65534);s=socket.socket(socket.AF_UNIX);"
        "s.connect(sys.argv[1]);s.settimeout(10);s.sendall(bytes.fromhex(sys.argv[2]));"
        "print(len(s.recv(4096)))"
    )
    out = subprocess.run(
        [sys.executable, "-c", talk, allowed.socket, hello], capture_output=True, text=True
    )
    assert int(out.stdout.strip() or 0) > 0, out.stderr  # the hello was answered
    assert allowed.status()["refused_connections"] == 0


def _toml(root: Path, text: str) -> Path:
    p = root / f"daemon-{time.monotonic_ns()}.toml"
    p.write_text(text + "\n")
    return p


def test_sessions_touch_only_their_own_blocks(daemon: DaemonProc) -> None:
    a, b = RawSession(daemon.socket), RawSession(daemon.socket)
    try:
        data = os.urandom(4096)
        w = a.write(data)
        assert w.status == 0 and w.block > 0
        r, _ = b.read(w.block)
        assert r.status == errno.EPERM and b"another session" in r.tail
        assert b.call(proto.Msg.FREE, block=w.block).status == errno.EPERM
        assert b.call(proto.Msg.FREE, block=10**12).status == errno.ENOENT
        r, got = a.read(w.block)
        assert r.status == 0 and got == data  # A's block survived B's attempts
        assert a.call(proto.Msg.FREE, block=w.block).status == 0
        r, _ = a.read(w.block)
        assert r.status == errno.ENOENT  # freed means gone
        bad = a.call(proto.Msg.WRITE, shm_offset=1 << 40, nbytes=4096)
        assert bad.status == errno.EINVAL  # outside the shared memory: refused, not crashed
    finally:
        a.close()
        b.close()
    assert not daemon.wait_idle()["sessions"]


def test_the_daemon_serves_without_torch(daemon: DaemonProc) -> None:
    """A daemon that wrote and read a block has not loaded libtorch: it starts in a fraction of
    the time and holds ~30 MB instead of ~230 MB on a node where every byte is wanted."""
    raw = RawSession(daemon.socket)
    try:
        data = os.urandom(4096)
        w = raw.write(data)
        r, got = raw.read(w.block)
        assert r.status == 0 and got == data
    finally:
        raw.close()
    maps = Path(f"/proc/{daemon.pid}/maps").read_text()
    assert "libtorch" not in maps, "the daemon imported torch"


def test_protocol_version_mismatch_and_garbage_drop_only_that_connection(
    daemon: DaemonProc,
) -> None:
    keep = RawSession(daemon.socket)
    try:
        s = socket.socket(socket.AF_UNIX)
        s.connect(daemon.socket)
        s.settimeout(10)
        s.sendall(proto.encode_hello(os.getpid(), "old client", version=99))
        reply = proto.decode_reply(proto.split_frames(bytearray(s.recv(4096)), proto.MAX_REPLY)[0])
        assert reply.status == errno.EPROTONOSUPPORT
        assert s.recv(1) == b""  # then dropped
        s.close()
        for junk in (b"\xff" * 64, b"\x00\x00\x00\x00", (1 << 20).to_bytes(4, "little")):
            s = socket.socket(socket.AF_UNIX)
            s.connect(daemon.socket)
            s.settimeout(10)
            s.sendall(junk)
            assert s.recv(1) == b""
            s.close()
        data = os.urandom(4096)
        w = keep.write(data)  # the other session is unaffected
        r, got = keep.read(w.block)
        assert r.status == 0 and got == data
    finally:
        keep.close()
    assert "protocol error" in daemon.log_text()


def test_corrupted_block_raises_in_client(daemon: DaemonProc) -> None:
    """Flip bytes in the daemon's file: unpack raises, wrong bytes never reach autograd."""
    off = small_offloader(daemon.dirs[0], daemon={"socket": daemon.socket})
    SavePayload.seen.clear()
    x = torch.ones(1, requires_grad=True)
    with off:
        y = SavePayload.apply(x, torch.randn(1 << 16))
    off.synchronize()
    assert off.stats().bytes_written >= 1 << 18
    n = 0
    for name in os.listdir("/proc/self/fd"):  # the session's file, passed to us by the daemon
        try:
            link = os.readlink(f"/proc/self/fd/{name}")
        except OSError:  # the descriptor of the listing itself
            continue
        if link.startswith(str(daemon.dirs[0])):
            with open(f"/proc/self/fd/{name}", "r+b") as f:
                f.seek(100)
                f.write(b"\xa5" * 8)
            n += 1
    assert n == 1
    with pytest.raises(OSError, match="checksum mismatch"):
        y.sum().backward()
    assert not SavePayload.seen
    assert daemon.status()["io_errors"] >= 1
    off.close()


_CLIENT = """
import sys, time, torch
sys.path.insert(0, sys.argv[2])
from offloadd import Offloader
from tests._support.helpers import SavePayload
off = Offloader(daemon={"socket": sys.argv[1]}, min_bytes=1, chunk_bytes=1 << 16, staging_bytes=1 << 20)
x = torch.ones(1, requires_grad=True)
with off:
    y = SavePayload.apply(x, torch.randn(1 << 20))
off.synchronize()
print("ready", flush=True)
time.sleep(600)
"""


def test_kill_9_of_a_client_frees_its_blocks_within_1s(daemon: DaemonProc) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", _CLIENT, daemon.socket, str(ROOT)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        doc = daemon.status()
        mine = [s for s in doc["sessions"] if s["pid"] == proc.pid]
        assert mine and mine[0]["bytes_held"] >= 4 << 20
        assert daemon.held()["files"] >= 1
        proc.kill()
        proc.wait()
        t0 = time.monotonic()
        while daemon.status()["sessions"] or daemon.held() != {
            "files": 0,
            "memfds": 0,
            "mappings": 0,
        }:
            assert time.monotonic() - t0 < 1.0, daemon.status()
            time.sleep(0.01)
        assert daemon.status()["bytes_held"] == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _steps(
    off: Offloader,
    n: int,
    *,
    hook: Callable[[int, str], None],
) -> list[list[torch.Tensor]]:
    """``helpers.train`` on the tiny GPT, calling ``hook(step, at)`` at ``"start"`` of each step
    and in the middle of its ``"forward"`` and its ``"backward"``."""
    make_model, make_input = MODELS["gpt"]
    torch.manual_seed(0)
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(1)
    step = [0]
    mid = [m for m in model.modules() if isinstance(m, nn.Linear)][3]
    mid.register_forward_hook(lambda *_: hook(step[0], "forward"))
    mid.register_full_backward_hook(lambda *_: hook(step[0], "backward"))
    out = []
    for i in range(n):
        step[0] = i
        hook(i, "start")
        x = make_input(gen)
        with off:
            loss = model(x).float().square().mean()
        loss.backward()
        rng = torch.get_rng_state()
        out.append([loss.detach().clone(), rng] + [p.grad.clone() for p in model.parameters()])
        opt.step()
        opt.zero_grad()
    return out


@pytest.mark.parametrize("where", ["forward", "backward"])
# A write in flight when the daemon dies fails and keeps its tensors in memory (as it should).
@pytest.mark.filterwarnings("ignore:offloadd. write failed:RuntimeWarning")
def test_kill_9_of_the_daemon_mid_step(where: str, own_daemon: Callable[..., DaemonProc]) -> None:
    """The step completes bit-identically; the restarted daemon serves the next steps."""
    reference = train(*MODELS["gpt"], None, steps=4)
    d = own_daemon().start()
    off = small_offloader(d.dirs[0], daemon={"socket": d.socket})
    assert off.runtime.backend is not None
    again = own_daemon(dirs=d.dirs)
    used: list[dict[str, object]] = []

    def hook(step: int, at: str) -> None:
        if step == 1 and at == where:
            d.kill()
        elif step == 2 and at == "start":
            assert not off.runtime.backend.connected
            again.start()
        elif step == 3 and at == "backward":
            used.append(again.status())

    with pytest.warns(RuntimeWarning, match="lost the daemon"):
        got = _steps(off, 4, hook=hook)
    assert_bitwise_equal(reference, got)
    assert off.runtime.backend.connected
    sessions = used[0]["sessions"]
    assert isinstance(sessions, list) and len(sessions) == 1 and sessions[0]["bytes_written"] > 0
    off.close()
    assert _client_leftovers(d) == {"files": 0, "memfds": 0, "mappings": 0}
    assert not again.wait_idle()["sessions"]
    assert again.held() == {"files": 0, "memfds": 0, "mappings": 0}
    assert again.stop() == 0


def test_quota_exceeded_falls_back_other_sessions_unaffected(
    own_daemon: Callable[..., DaemonProc],
) -> None:
    d = own_daemon("--quota-bytes", "512KiB").start()
    other = RawSession(d.socket, chunk=64 << 10, slots=2)  # a session already holding a block
    data = os.urandom(64 << 10)
    held = other.write(data)
    assert held.status == 0
    reference = train(*MODELS["gpt"], None)
    off = small_offloader(d.dirs[0], daemon={"socket": d.socket})
    with pytest.warns(RuntimeWarning, match="quota"):
        got = train(*MODELS["gpt"], off)
    assert_bitwise_equal(reference, got)
    off.synchronize()
    st = off.stats()
    assert st.fallbacks > 0 and st.bytes_written > 0 and st.resident_bytes == 0
    assert st.disk_bytes == 0
    off.close()
    r, got_back = other.read(held.block)
    assert r.status == 0 and got_back == data  # the other session kept its block
    assert other.write(data, slot=1).status == 0  # and may still write within its quota
    doc = d.status()
    assert doc["refused_requests"] > 0
    other.close()
    assert not d.wait_idle()["sessions"]


def test_real_disk_full_falls_back(tmp_path: Path, own_daemon: Callable[..., DaemonProc]) -> None:
    """The daemon's directory is a 16 MiB loop-mounted ext4 that really fills up."""
    with loop_ext4(tmp_path) as mnt:
        from tests.properties.test_equivalence import mlp

        def make_input(g: torch.Generator) -> torch.Tensor:
            return torch.randn(16384, 64, generator=g)  # ~ 50 MiB of activations per step

        data = mnt / "offload"
        data.mkdir()
        d = own_daemon(dirs=[data]).start()
        reference = train(mlp, make_input, None, steps=2)
        off = small_offloader(data, daemon={"socket": d.socket}, staging_bytes=4 << 20)
        with pytest.warns(RuntimeWarning, match="write failed"):
            got = train(mlp, make_input, off, steps=2)
        assert_bitwise_equal(reference, got)
        assert off.stats().fallbacks > 0
        off.close()
        assert d.status()["io_errors"] > 0
        assert d.stop() == 0
        assert not list(data.iterdir())


def test_status_json_and_metrics(
    own_daemon: Callable[..., DaemonProc], capsys: pytest.CaptureFixture[str]
) -> None:
    with socket.socket() as s:  # a free port
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    d = own_daemon("--metrics-port", str(port)).start()
    raw = RawSession(d.socket)
    assert raw.write(os.urandom(4096)).status == 0
    out = subprocess.run(
        [sys.executable, "-m", "offloadd", "status", "--json", "--socket", d.socket],
        capture_output=True,
        text=True,
        check=True,
    )
    doc = json.loads(out.stdout)
    (sess,) = doc["sessions"]
    assert sess["bytes_held"] == 4096 and sess["blocks"] == 1 and sess["pid"] == os.getpid()
    for key in ("write_bytes_per_s", "read_bytes_per_s", "queue", "io_errors", "recent_errors"):
        assert key in doc
    assert doc["dirs"][0]["free_bytes"] > 0
    from offloadd.cli import main as cli

    assert cli(["status", "--socket", d.socket]) == 0
    human = capsys.readouterr().out
    assert "1 session(s)" in human and "free" in human
    time.sleep(1.2)  # the metrics document is refreshed every second
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    assert "offloadd_sessions 1.0" in text
    assert "offloadd_session_bytes_held{" in text and "offloadd_dir_free_bytes{" in text
    raw.close()
    assert cli(["stop", "--socket", d.socket]) == 0
    assert d.proc is not None and d.proc.wait(30) == 0
    assert not os.path.exists(d.socket)
    capsys.readouterr()
    assert cli(["status", "--socket", d.socket]) == 1
    assert f"no daemon listens at {d.socket!r}" in capsys.readouterr().err


def test_metrics_name_sessions_by_number_only(own_daemon: Callable[..., DaemonProc]) -> None:
    """The metrics port is readable by every local user, so it shows daemon-wide figures and
    each session's bytes under its number alone: no identity, pid or uid (``offloadd status``,
    which shows other users only their own sessions, is where those are seen)."""
    with socket.socket() as s:  # a free port
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    d = own_daemon("--metrics-port", str(port)).start()
    raw = RawSession(d.socket)
    try:
        assert raw.write(os.urandom(4096)).status == 0
        (sess,) = d.status()["sessions"]
        time.sleep(1.2)  # the metrics document is refreshed every second
        url = f"http://127.0.0.1:{port}/metrics"
        text = urllib.request.urlopen(url, timeout=10).read().decode()
    finally:
        raw.close()
    assert f'offloadd_session_bytes_held{{session="{raw.session}"}} 4096.0' in text, text
    assert sess["identity"] not in text, text
    for labels in re.findall(r"\{([^}]*)\}", text):
        for name, value in re.findall(r'(\w+)="([^"]*)"', labels):
            assert name in ("session", "queue", "dir"), labels
            assert value != str(os.getpid()) and f"pid {os.getpid()}" not in value, labels


def test_a_client_that_does_not_read_never_stalls_others(daemon: DaemonProc) -> None:
    """A session floods writes and never reads a reply; another session's steps go on."""
    flood = RawSession(daemon.socket, chunk=4096, slots=4)
    msgs = b"".join(
        proto.encode_request(proto.Command(proto.Msg.WRITE, 100 + i, shm_offset=0, nbytes=4096))
        for i in range(3000)
    )
    flood.sock.setblocking(False)
    with contextlib.suppress(BlockingIOError):
        flood.sock.send(msgs)  # as much as the socket takes; the replies are never read
    reference = train(*MODELS["mlp"], None, steps=2)
    off = small_offloader(daemon.dirs[0], daemon={"socket": daemon.socket})
    t0 = time.monotonic()
    got = train(*MODELS["mlp"], off, steps=2)
    assert time.monotonic() - t0 < 60
    assert_bitwise_equal(reference, got)
    off.close()
    flood.close()
    assert not daemon.wait_idle()["sessions"]


@pytest.mark.parametrize("kind", ["crc32", "none"])
def test_checksum_choices(kind: str, own_daemon: Callable[..., DaemonProc]) -> None:
    d = own_daemon("--checksum", kind).start()
    assert d.status()["checksum"] == kind
    reference = train(*MODELS["gpt"], None, steps=2)
    off = small_offloader(d.dirs[0], daemon={"socket": d.socket})
    got = train(*MODELS["gpt"], off, steps=2, settle_first=True)
    assert_bitwise_equal(reference, got)
    assert off.stats().bytes_read > 0
    off.close()


def test_daemon_toml_documents_the_defaults() -> None:
    assert Config.from_toml(ROOT / "configs" / "daemon.toml") == Config()


def test_bad_daemon_settings_name_the_key(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text('[daemon]\nquota = "1GiB"\n')
    with pytest.raises(ValueError, match=r"daemon\.quota: unknown key.*bad\.toml"):
        Config.from_toml(bad)
    bad.write_text('[daemon]\nchecksum = "md5"\n')
    with pytest.raises(ValueError, match=r"daemon\.checksum: 'md5' is not one of xxh3"):
        Config.from_toml(bad)
    bad.write_text('[daemon]\nquota_bytes = "lots"\n')
    with pytest.raises(ValueError, match=r"daemon\.quota_bytes: 'lots' is not a size"):
        Config.from_toml(bad)
    # A settings directory is the daemon's to check, not to make (a --dir option's is made:
    # tests/test_cli_dirs.py)
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "offloadd",
            "serve",
            "--socket",
            str(tmp_path / "s" / "d.sock"),
        ],
        capture_output=True,
        text=True,
        env={**os.environ, "OFFLOADD_DAEMON_DIRS": str(tmp_path / "missing")},
        timeout=120,
    )
    assert out.returncode == 2 and "does not exist" in out.stderr


def test_serve_settings_file_then_environment_then_options(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import argparse

    from offloadd.daemon.cmd_serve import add_arguments, config_from_args

    def settings(*argv: str) -> DaemonConfig:
        p = argparse.ArgumentParser()
        add_arguments(p)
        return config_from_args(p.parse_args(argv))

    f = tmp_path / "serve.toml"
    f.write_text('min_bytes = "4k"\n[daemon]\nchecksum = "crc32"\nquota_bytes = "1GiB"\n')
    assert settings("--config", str(f)) == DaemonConfig(checksum="crc32", quota_bytes=1 << 30)
    monkeypatch.setenv("OFFLOADD_DAEMON_QUOTA_BYTES", "2GiB")
    monkeypatch.setenv("OFFLOADD_DAEMON_MAX_SESSIONS", "3")
    # the training side's variables are not the daemon's: neither read nor checked
    monkeypatch.setenv("OFFLOADD_CONFIG", str(tmp_path / "missing.toml"))
    monkeypatch.setenv("OFFLOADD_MIN_BYTE", "typo")
    got = settings("--config", str(f), "--quota-bytes", "3GiB")
    assert (got.checksum, got.quota_bytes, got.max_sessions) == ("crc32", 3 << 30, 3)
    assert settings("--config", str(f)).quota_bytes == 2 << 30
    monkeypatch.setenv("OFFLOADD_DAEMON_QUOTA_BYTES", "12 apples")
    with pytest.raises(ValueError, match=r"'12 apples' is not a size.*OFFLOADD_DAEMON_QUOTA_BYTES"):
        settings()
    monkeypatch.setenv("OFFLOADD_DAEMON_QUOTA_BYTES", "0")
    monkeypatch.setenv("OFFLOADD_DAEMON_QUOTA", "1GiB")
    with pytest.raises(ValueError, match="unknown environment variable OFFLOADD_DAEMON_QUOTA="):
        settings()


def test_serve_status_and_stop_find_the_socket_in_the_environment(tmp_path: Path) -> None:
    sock = str(tmp_path / "run" / "d.sock")
    (tmp_path / "data").mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("OFFLOADD")}
    env.update(
        OFFLOADD_DAEMON_SOCKET=sock,
        OFFLOADD_DAEMON_DIRS=str(tmp_path / "data"),
        OFFLOADD_DAEMON_CHECKSUM="crc32",
    )
    offloadd = [sys.executable, "-m", "offloadd"]
    proc = subprocess.Popen([*offloadd, "serve"], env=env, stderr=subprocess.PIPE, text=True)
    try:
        _wait_serving(sock, proc)
        out = subprocess.run(
            [*offloadd, "status", "--json"], env=env, capture_output=True, text=True
        )
        assert out.returncode == 0, out.stderr
        doc = json.loads(out.stdout)
        assert (doc["socket"], doc["checksum"]) == (sock, "crc32")
        assert [d["path"] for d in doc["dirs"]] == [str(tmp_path / "data")]
        out = subprocess.run([*offloadd, "stop"], env=env, capture_output=True, text=True)
        assert out.returncode == 0 and sock in out.stdout, out.stderr
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()
    bad = {**env, "OFFLOADD_DAEMON_CHECKSUM": "md5"}
    for cmd in ("serve", "status"):
        out = subprocess.run([*offloadd, cmd], env=bad, capture_output=True, text=True)
        assert out.returncode == 2, out.stderr
        assert "daemon.checksum: 'md5' is not one of xxh3, crc32, none" in out.stderr


def test_unreachable_daemon_raises_at_construction(tmp_path: Path) -> None:
    from offloadd.backend.daemon import DaemonError

    with pytest.raises(DaemonError, match="no daemon listens at"):
        Offloader(daemon={"socket": str(tmp_path / "none.sock")})
    with pytest.raises(ValueError, match="io_engine cannot be combined"):
        from offloadd.io.python_engine import PythonEngine

        Offloader(daemon={"socket": str(tmp_path / "none.sock")}, io_engine=PythonEngine(1))


def test_runs_on_uvloop_and_without_it(tmp_path: Path, daemon: DaemonProc) -> None:
    assert "event loop: uvloop" in daemon.log_text()
    sock = str(tmp_path / "run" / "d.sock")
    (tmp_path / "data").mkdir()
    code = (
        "import sys; sys.modules['uvloop'] = None\n"  # import uvloop now raises ImportError
        "from offloadd.cli import main; raise SystemExit(main(sys.argv[1:]))"
    )
    cmd = [sys.executable, "-c", code, "serve", "--socket", sock, "--dir", str(tmp_path / "data")]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    try:
        _wait_serving(sock, proc)
        raw = RawSession(sock)
        data = os.urandom(4096)
        r, got = raw.read(raw.write(data).block)
        assert r.status == 0 and got == data
        raw.close()
    finally:
        proc.send_signal(2)  # SIGINT stops it cleanly too
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert "uvloop is not installed; using asyncio's default event loop" in err
    assert not os.path.exists(sock) and not list((tmp_path / "data").iterdir())


def test_offloader_dropped_without_close_ends_its_session(daemon: DaemonProc) -> None:
    import gc

    off = small_offloader(daemon.dirs[0], daemon={"socket": daemon.socket})
    x = torch.ones(1, requires_grad=True)
    with off:
        y = SavePayload.apply(x, torch.randn(1 << 16))
    off.synchronize()
    assert daemon.status()["bytes_held"] > 0
    del off, y
    gc.collect()
    assert not daemon.wait_idle()["sessions"]
    assert held_descriptors(os.getpid(), [str(daemon.dirs[0])]) == {
        "files": 0,
        "memfds": 0,
        "mappings": 0,
    }


def test_env_variable_selects_the_daemon(daemon: DaemonProc) -> None:
    cfg = Config.from_env({"OFFLOADD_DAEMON_SOCKET": daemon.socket, "OFFLOADD_MIN_BYTES": "4096"})
    assert cfg.daemon.socket == daemon.socket
    off = Offloader(cfg)
    x = torch.randn(256, 256, requires_grad=True)
    expected = torch.autograd.grad((x * 2).sin().sum(), x)[0]
    with off:
        z = (x * 2).sin()
    off.synchronize()
    assert [s["bytes_held"] for s in daemon.status()["sessions"]] == [cfg.chunk_bytes]  # 1 slot
    (g,) = torch.autograd.grad(z.sum(), x)
    assert torch.equal(g, expected)
    off.close()


def test_start_is_logged_once_without_repeating_the_prefix(
    own_daemon: Callable[..., DaemonProc],
) -> None:
    """The engine's choice is logged once, and the daemon's own lines do not start with the
    "offloadd" that the log format already puts before them."""
    d = own_daemon().start()
    assert d.stop() == 0
    log = d.log_text()
    assert log.count("I/O engine") == 1, log
    own = [line for line in log.splitlines() if " offloadd.daemon: " in line]
    assert any("serving" in line for line in own) and own[-1].endswith(": stopped"), log
    assert not [line for line in own if "offloadd.daemon: offloadd" in line], log


def test_the_directories_are_probed_once_at_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The daemon probes its directories before it serves; the sampler's first probe comes a
    second later, not at once beside that one."""
    import asyncio

    from offloadd.daemon import status
    from offloadd.daemon.core import Server

    probed: list[float] = []
    real = status.probe_dirs

    def probe_dirs(dirs: list[str]) -> list[dict[str, Any]]:
        probed.append(time.monotonic())
        return real(dirs)

    monkeypatch.setattr(status, "probe_dirs", probe_dirs)

    async def start() -> float:
        srv = Server(DaemonConfig(dirs=(str(tmp_path),), io_threads=1))
        try:
            t0 = time.monotonic()
            srv.status.start()
            while len(probed) < 2 and time.monotonic() < t0 + 10:
                await asyncio.sleep(0.05)
            return t0
        finally:
            srv.status.stop()
            srv.engine.close()

    t0 = asyncio.run(start())
    assert len(probed) == 2 and probed[0] < t0 and probed[1] >= t0 + 0.9, (probed, t0)


def test_a_write_done_after_its_session_ended_is_no_error() -> None:
    """A client that goes with writes in the engine: each that succeeds makes no block and no
    reply, and is no I/O error (it used to be counted and logged as one, with an empty text)."""
    from collections import Counter
    from types import SimpleNamespace

    from offloadd.daemon.handlers import Handlers
    from offloadd.daemon.scheduler import Job
    from offloadd.daemon.session import Block

    errors: list[str] = []
    replies: list[proto.Reply] = []
    status = SimpleNamespace(totals=Counter[str](), error=errors.append)
    handlers = Handlers(None, [], status, stop=print, drop=print)  # type: ignore[arg-type]
    conn = SimpleNamespace(reply=replies.append)
    sess = SimpleNamespace(id=1, closing=True, inflight=0, errors=0, blocks={}, bytes_written=0)
    job = Job(conn, sess, proto.Msg.WRITE, 7, 0, Block(0, 0, 4096, 0), 0, 4096)  # type: ignore[arg-type]
    handlers.done(job)
    assert (errors, replies, sess.errors, sess.blocks) == ([], [], 0, {})
    assert status.totals == Counter()
    job.status, job.message = errno.EIO, "disk gone"  # a write that failed still is one
    handlers.done(job)
    assert sess.errors == 1 and status.totals["io_errors"] == 1 and len(errors) == 1


def test_dispatch_order_reads_first_round_robin() -> None:
    """The daemon's queue policy: every waiting read before any write, sessions taking turns."""
    from types import SimpleNamespace

    from offloadd.daemon.scheduler import Job, Scheduler

    sched = Scheduler(None, 0, None, None, None)  # type: ignore[arg-type]  # depth 0: all wait
    for sid in (1, 2):
        sess = SimpleNamespace(id=sid, queued_reads=0, queued_writes=0)
        sched.add(sid)
        for kind, n in ((proto.Msg.WRITE, 3), (proto.Msg.READ, 2)):
            for i in range(n):
                sched.submit(Job(None, sess, kind, i, 0, None, 0, 4096))  # type: ignore[arg-type]
    got = []
    while (job := sched.pick()) is not None:
        got.append((job.kind.name, job.session.id))
    assert got == [("READ", 1), ("READ", 2)] * 2 + [("WRITE", 1), ("WRITE", 2)] * 3


def _wait_serving(sock: str, proc: subprocess.Popen[str]) -> None:
    """Until the daemon ``proc`` answers on ``sock`` (a minute at most; fails if it exits)."""
    from offloadd.backend.cmd_status import query
    from offloadd.backend.daemon import DaemonError

    for _ in range(1200):
        try:
            query(sock)
            return
        except DaemonError:
            assert proc.poll() is None, proc.communicate()[1]
            time.sleep(0.05)
    raise AssertionError(f"no daemon answered on {sock} within a minute")
