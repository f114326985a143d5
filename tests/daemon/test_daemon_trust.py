"""Whom a client of the daemon talks to: the process listening at the socket, and the socket's
directory (see offloadd/wire/trust.py [who trusts whom]).

The impostors are real processes: a listener that binds as root and drops to another uid before
``listen()`` (SO_PEERCRED reports the uid of ``listen()``), and records the bytes each connection
sent it before it was closed.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from offloadd import Offloader
from offloadd.backend.daemon_link import DaemonError, connect_control
from offloadd.cli import main as cli_main
from tests._support.daemon_proc import DaemonProc

OTHER_UID = 65534  # nobody

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another uid")

# argv: socket path, uid to run as (after bind, before listen). Prints "listening"; when its
# stdin closes, takes the connections still waiting, and prints what each one sent (hex).
_LISTENER = r"""
import json, os, select, socket, sys
path, uid = sys.argv[1], int(sys.argv[2])
srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
srv.bind(path)
os.chmod(path, 0o666)
if uid != os.geteuid():
    os.setgroups([]); os.setgid(uid); os.setuid(uid)
srv.listen(16)
print("listening", flush=True)
got = []
def take():
    c, _ = srv.accept()
    c.settimeout(10)
    try:
        got.append(c.recv(65536).hex())  # what it sent before it closed ("" if nothing)
    except OSError as e:
        got.append(f"error {e}")
    c.close()
while True:
    ready, _, _ = select.select([srv, sys.stdin], [], [], 60)
    if not ready or sys.stdin in ready:
        break
    take()
srv.setblocking(False)
while True:
    try:
        take()
    except BlockingIOError:
        break
print(json.dumps(got), flush=True)
"""


class Listener:
    """A process listening at ``path`` as ``uid`` that answers nothing."""

    def __init__(self, path: str, uid: int) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _LISTENER, path, str(uid)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().strip()
        assert line == "listening", self.proc.stderr.read() if self.proc.stderr else line

    def received(self) -> list[str]:
        """What each connection sent, once the listener has taken them all."""
        out, err = self.proc.communicate(timeout=30)
        assert self.proc.returncode == 0, err
        got: list[str] = json.loads(out.strip().splitlines()[-1])
        return got


@pytest.fixture
def place() -> Iterator[Path]:
    """A directory of root's, mode 0755, for sockets (the listener binds in it as root)."""
    d = Path(tempfile.mkdtemp(prefix="offloadd-trust-"))
    os.chmod(d, 0o755)
    yield d
    shutil.rmtree(d)


def _clients(path: str, tmp: Path, capsys: pytest.CaptureFixture[str]) -> list[str]:
    """Try the Offloader, ``offloadd status`` and ``offloadd stop`` on ``path``; each must be
    refused. Returns their error messages."""
    errors = []
    with pytest.raises(DaemonError) as info:
        Offloader(tier="ssd", ssd_dirs=[str(tmp)], daemon={"socket": path})
    errors.append(str(info.value))
    for command in ("status", "stop"):
        capsys.readouterr()
        assert cli_main([command, "--socket", path]) == 1
        errors.append(capsys.readouterr().err)
    return errors


def test_a_daemon_of_another_uid_gets_nothing(
    place: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A process of another user listening at the socket path: the Offloader, ``status`` and
    ``stop`` connect, see its uid and close without sending a byte."""
    path = str(place / "daemon.sock")
    impostor = Listener(path, OTHER_UID)
    try:
        errors = _clients(path, tmp_path, capsys)
    finally:
        got = impostor.received()
    assert got == ["", "", ""], f"the impostor received {got}"
    for e in errors:
        assert path in e and f"uid {OTHER_UID}" in e and f"uid {os.geteuid()}" in e, e
        assert "daemon.trusted_uids" in e, e


def test_an_untrusted_socket_directory_is_refused(
    place: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A directory another uid owns, or one that group or others may write to (who can write
    there can put their own socket in): refused before connecting."""
    foreign = place / "foreign"
    foreign.mkdir(mode=0o700)
    os.chown(foreign, OTHER_UID, OTHER_UID)
    loose = place / "loose"
    loose.mkdir()
    os.chmod(loose, 0o777)
    group = place / "group"
    group.mkdir()
    os.chmod(group, 0o770)
    cases = {foreign: f"uid {OTHER_UID}", loose: "mode 0777", group: "mode 0770"}
    for d, why in cases.items():
        path = str(d / "daemon.sock")
        listener = Listener(path, os.geteuid())  # root itself listens: only the place is wrong
        try:
            errors = _clients(path, tmp_path, capsys)
        finally:
            got = listener.received()
        assert not any(got), f"{d}: the listener received {got}"
        for e in errors:
            assert str(d) in e and why in e, e


def test_trusted_uids_opt_in(
    place: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``daemon.trusted_uids`` names a service user whose daemon the client talks to."""
    path = str(place / "daemon.sock")
    monkeypatch.setenv("OFFLOADD_DAEMON_TRUSTED_UIDS", str(OTHER_UID))
    listener = Listener(path, OTHER_UID)
    try:
        with pytest.raises(DaemonError, match="closed the connection"):
            connect_control(path)  # the listener answers nothing: only the hello went
    finally:
        got = listener.received()
    assert len(got) == 1 and bytes.fromhex(got[0])[5:9] == b"OFLD", got


def test_trusted_uids_from_the_offloader_s_own_config(
    place: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``Offloader(daemon={"trusted_uids": [...]})`` is what the Offloader trusts, not only the
    environment's ``OFFLOADD_DAEMON_TRUSTED_UIDS``."""
    path = str(place / "daemon.sock")
    monkeypatch.delenv("OFFLOADD_DAEMON_TRUSTED_UIDS", raising=False)
    listener = Listener(path, OTHER_UID)
    try:
        with pytest.raises(DaemonError, match="closed the connection"):
            Offloader(
                tier="ssd",
                ssd_dirs=[str(tmp_path)],
                daemon={"socket": path, "trusted_uids": [OTHER_UID]},
            )
    finally:
        got = listener.received()
    assert len(got) == 1 and bytes.fromhex(got[0])[5:9] == b"OFLD", got


def test_the_daemon_refuses_a_directory_others_may_write(tmp_path: Path) -> None:
    """The daemon applies the same rule to its socket's directory (it once made /tmp 0700)."""
    run = tmp_path / "run"
    run.mkdir()
    os.chmod(run, 0o1777)
    d = DaemonProc(tmp_path)
    try:
        with pytest.raises(RuntimeError, match=r"(?s)daemon exited with 2: .*run.*mode 1777"):
            d.start()
    finally:
        if d.proc is not None:
            d.stop()
    assert stat.S_IMODE(os.stat(run).st_mode) == 0o1777  # left as it was
    assert not os.path.exists(d.socket)


def _link_to_a_directory_of_ours(where: Path) -> tuple[Path, Path]:
    """``where/run``: a symbolic link, another user's, to ``where/victim``, a directory of this
    uid's (mode 0755, as /etc is), made before the daemon starts: the default socket directory
    ``/tmp/offloadd-run-$UID`` lies where any local user may create it first."""
    victim = where / "victim"
    victim.mkdir()
    os.chmod(victim, 0o755)
    link = where / "run"
    link.symlink_to(victim)
    os.lchown(link, OTHER_UID, OTHER_UID)
    return link, victim


@pytest.mark.parametrize("named_by", ["option", "setting"])
def test_the_daemon_refuses_a_socket_directory_that_is_a_symbolic_link(
    tmp_path: Path, named_by: str
) -> None:
    """The daemon neither follows the link nor changes the directory it points to (it once made
    it 0700 and bound its socket there), whether ``--socket`` or ``daemon.socket`` names it."""
    link, victim = _link_to_a_directory_of_ours(tmp_path)
    data = tmp_path / "data"
    data.mkdir()
    sock = str(link / "daemon.sock")
    env = {k: v for k, v in os.environ.items() if not k.startswith("OFFLOADD")}
    args = ["--dir", str(data)]
    if named_by == "option":
        args += ["--socket", sock]
    else:
        env["OFFLOADD_DAEMON_SOCKET"] = sock
    proc = subprocess.Popen(
        [sys.executable, "-m", "offloadd", "serve", *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.monotonic() + 60
    while proc.poll() is None and not any(victim.iterdir()) and time.monotonic() < deadline:
        time.sleep(0.05)
    if proc.poll() is None:
        proc.kill()  # it serves (or hangs): the checks below say what it did
    out, _ = proc.communicate(timeout=30)
    assert stat.S_IMODE(os.stat(victim).st_mode) == 0o755, out  # left as it was
    assert not list(victim.iterdir()), out  # no socket bound in it
    assert proc.returncode == 2, out
    assert f"{str(link)!r} is a symbolic link" in out, out


def test_a_socket_directory_that_is_a_symbolic_link_is_refused(
    place: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Clients refuse it too, before connecting, even where it points to a directory they would
    trust: whoever made the link may point it elsewhere."""
    real = place / "real"
    real.mkdir(mode=0o700)
    link = place / "link"
    link.symlink_to(real)
    os.lchown(link, OTHER_UID, OTHER_UID)
    listener = Listener(str(real / "daemon.sock"), os.geteuid())
    try:
        errors = _clients(str(link / "daemon.sock"), tmp_path, capsys)
    finally:
        got = listener.received()
    assert not any(got), f"the listener received {got}"
    for e in errors:
        assert f"{str(link)!r} is a symbolic link" in e, e


def test_a_relative_socket_path_is_checked_in_the_current_directory(tmp_path: Path) -> None:
    """``socket = "d.sock"``: its directory is ``.``, which passes (root's, 0700)."""
    old = os.getcwd()
    os.chdir(tmp_path)
    try:
        with socket.socket(socket.AF_UNIX) as srv:
            srv.bind("d.sock")
            srv.listen(1)
            with pytest.raises(DaemonError, match=r"timed out|closed"):
                connect_control("d.sock", timeout=0.2)
    finally:
        os.chdir(old)


@pytest.mark.parametrize("kind", ["regular file", "directory", "symbolic link"])
def test_the_daemon_never_removes_what_is_not_a_socket(tmp_path: Path, kind: str) -> None:
    """``--socket`` naming a user's file (a typo): refused, the file left as it was. The daemon
    removes only a socket nobody listens on (one left by a daemon that was killed)."""
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    there = run / "notes"
    if kind == "regular file":
        there.write_text("precious")
    elif kind == "directory":
        there.mkdir()
    else:
        there.symlink_to(tmp_path / "elsewhere")
    data = tmp_path / "data"
    data.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("OFFLOADD")}
    proc = subprocess.run(
        [sys.executable, "-m", "offloadd", "serve", "--dir", str(data), "--socket", str(there)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert f"{str(there)!r} exists and is not a socket (a {kind})" in proc.stderr, proc.stderr
    if kind == "regular file":
        assert there.read_text() == "precious"
    else:
        assert there.is_symlink() if kind == "symbolic link" else there.is_dir()
