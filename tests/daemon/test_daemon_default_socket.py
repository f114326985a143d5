"""Where the node's daemon is found with no path given, and the refusal of a socket where none
listens (offloadd/wire/address.py).

``offloadd serve``, the Offloader, ``offloadd status`` and ``offloadd stop`` share one rule for
the default socket; these tests run them with ``XDG_RUNTIME_DIR`` unset (ssh, containers, root),
where it is ``/tmp/offloadd-run-$UID/daemon.sock``. That path is the machine's, not the test's:
the tests that serve there hold a lock file, and skip where a daemon of this user already
listens there.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import subprocess
import sys
import time
import traceback
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from offloadd import Offloader
from offloadd.backend.daemon_link import DaemonError
from tests._support.envrun import (
    CLIENTS,
    PYTHON,
    clean_env,
    last_json,
    run,
    same_as_plain,
    summary_lines,
)
from tests._support.helpers import SavePayload

DEFAULT = f"/tmp/offloadd-run-{os.getuid()}/daemon.sock"
PLAIN = str(CLIENTS / "plain_train.py")
# What a shell makes of the README's old $XDG_RUNTIME_DIR/offloadd/daemon.sock without it.
UNEXPANDED = "/offloadd/daemon.sock"


def _no_xdg(**extra: str) -> dict[str, str]:
    env = clean_env(**extra)
    env.pop("XDG_RUNTIME_DIR", None)
    return env


def _answers(path: str) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        try:
            s.connect(path)
        except OSError:
            return False
    return True


@contextlib.contextmanager
def _default_daemon(data: Path) -> Iterator[subprocess.Popen[str]]:
    """``offloadd serve --dir data`` with no socket given and ``XDG_RUNTIME_DIR`` unset, once it
    answers at :data:`DEFAULT`; stopped (if still running) and its directory removed after."""
    with open(f"/tmp/offloadd-default-socket-tests-{os.getuid()}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one test at a time serves at the default path
        if _answers(DEFAULT):
            pytest.skip(f"a daemon of this user already listens at {DEFAULT}")
        made = not os.path.lexists(os.path.dirname(DEFAULT))
        cmd = [sys.executable, "-m", "offloadd", "serve", "--dir", str(data)]
        proc = subprocess.Popen(cmd, env=_no_xdg(), stderr=subprocess.PIPE, text=True)
        try:
            deadline = time.monotonic() + 60
            while not _answers(DEFAULT):
                assert proc.poll() is None, proc.communicate()[1]
                assert time.monotonic() < deadline, f"no daemon answered at {DEFAULT}"
                time.sleep(0.05)
            yield proc
        finally:
            if proc.poll() is None:
                proc.terminate()
            proc.communicate(timeout=30)
            if made:
                with contextlib.suppress(OSError):
                    os.rmdir(os.path.dirname(DEFAULT))


def test_serve_client_status_and_stop_meet_at_the_default_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No path given anywhere, ``XDG_RUNTIME_DIR`` unset: the daemon listens at the default,
    an Offloader with ``daemon.socket = "default"`` offloads through it (gradients bit for
    bit), and ``offloadd status`` and ``offloadd stop`` find it."""
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    for var in [v for v in os.environ if v.startswith("OFFLOADD")]:
        monkeypatch.delenv(var)
    (tmp_path / "data").mkdir()
    with _default_daemon(tmp_path / "data") as proc:
        off = Offloader(tier="ssd", min_bytes=4096, daemon={"socket": "default"})
        x = torch.ones(1, requires_grad=True)
        payload = torch.randn(1 << 16)
        with off:
            y = SavePayload.apply(x, payload)
        off.synchronize()
        status = subprocess.run(
            [sys.executable, "-m", "offloadd", "status", "--json"],
            env=_no_xdg(),
            capture_output=True,
            text=True,
        )
        assert status.returncode == 0, status.stderr
        doc = json.loads(status.stdout)
        assert doc["socket"] == DEFAULT
        assert [s["bytes_held"] for s in doc["sessions"]] == [off.config.chunk_bytes]
        y.sum().backward()
        assert torch.equal(SavePayload.seen[-1], payload) and off.stats().bytes_read > 0
        assert off.stats().engine == "daemon"
        off.close()
        stop = subprocess.run(
            [sys.executable, "-m", "offloadd", "stop"],
            env=_no_xdg(),
            capture_output=True,
            text=True,
        )
        assert stop.returncode == 0 and DEFAULT in stop.stdout, stop.stderr
        assert proc.wait(30) == 0
    assert not list((tmp_path / "data").iterdir())


def test_an_unmodified_script_finds_the_default_daemon(tmp_path: Path) -> None:
    """``OFFLOADD=1 OFFLOADD_DAEMON_SOCKET=default``: a plain script's forwards offload through
    the node's daemon, found with no path and ``XDG_RUNTIME_DIR`` unset; same losses and
    weights as without offloadd."""
    base = last_json(run([PYTHON, PLAIN, "1"], _no_xdg()).stdout)
    (tmp_path / "data").mkdir()
    report = tmp_path / "report.json"
    env = _no_xdg(
        OFFLOADD="1",
        OFFLOADD_DAEMON_SOCKET="default",
        OFFLOADD_MIN_BYTES="16KiB",
        OFFLOADD_CHUNK_BYTES="256KiB",
        OFFLOADD_STAGING_BYTES="8MiB",
        OFFLOADD_REPORT=str(report),
    )
    with _default_daemon(tmp_path / "data"):
        proc = run([PYTHON, PLAIN, "1"], env)
    same_as_plain(last_json(proc.stdout), base, [PYTHON, PLAIN, "1"], _no_xdg())
    stats = json.loads(report.read_text())["stats"]
    assert stats["engine"] == "daemon" and stats["offloaded_bytes"] > 0
    assert len(summary_lines(proc.stderr)) == 1


def _refusal_names_both_paths(text: str, tried: str) -> None:
    assert "\n" not in text, text
    assert f"{tried!r}" in text and f"{DEFAULT!r}" in text, text
    assert "offloadd serve" in text and "default" in text, text


def test_a_socket_where_no_daemon_listens_is_refused_at_construction_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The Offloader refuses a socket with no daemon behind it when it is built, in one line
    that names the path tried, where the default daemon listens and how to start it; the
    exception chains no lower-level error (its traceback is the calls that built it)."""
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    stale = tmp_path / "stale.sock"  # a socket file nothing listens on (a killed daemon's)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.bind(str(stale))
    for tried in (UNEXPANDED, str(tmp_path / "none.sock"), str(stale)):
        with pytest.raises(DaemonError) as info:
            Offloader(tier="ssd", daemon={"socket": tried})
        _refusal_names_both_paths(str(info.value), tried)
        assert info.value.__cause__ is None and info.value.__suppress_context__
        assert "During handling" not in "".join(traceback.format_exception(info.value))


def test_a_missing_socket_fails_an_unmodified_script_in_one_line(tmp_path: Path) -> None:
    """Under ``OFFLOADD=1``, a socket with no daemon behind it (the README's old example with
    ``XDG_RUNTIME_DIR`` unset) fails the script where the Offloader is built, at its first
    forward (a daemon started just before the job has until then to listen), with one line
    naming the path tried and the default daemon's, and no chained lower-level error."""
    (tmp_path / "d").mkdir()
    env = _no_xdg(
        OFFLOADD="1", OFFLOADD_SSD_DIRS=str(tmp_path / "d"), OFFLOADD_DAEMON_SOCKET=UNEXPANDED
    )
    proc = subprocess.run([PYTHON, PLAIN, "1"], env=env, capture_output=True, text=True)
    assert proc.returncode != 0 and proc.stdout == ""
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("offloadd.backend.daemon_link.DaemonError: "), proc.stderr
    assert "OFFLOADD_DAEMON_SOCKET" in last, proc.stderr
    _refusal_names_both_paths(last.split(": ", 1)[1], UNEXPANDED)
    assert "During handling" not in proc.stderr and "direct cause" not in proc.stderr


def test_a_daemon_that_cannot_be_reached_is_not_called_absent(tmp_path: Path) -> None:
    """Where something listens but the connection fails (its backlog full), the line says it
    could not connect, not that no daemon listens there (nor to start one at that path)."""
    from offloadd.backend.daemon_link import connect_control

    tmp_path.chmod(0o700)
    path = str(tmp_path / "daemon.sock")
    with contextlib.ExitStack() as stack:
        server = stack.enter_context(socket.socket(socket.AF_UNIX, socket.SOCK_STREAM))
        server.bind(path)
        server.listen(0)
        for _ in range(4):  # fill the backlog
            c = stack.enter_context(socket.socket(socket.AF_UNIX, socket.SOCK_STREAM))
            c.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                c.connect(path)
        with pytest.raises(DaemonError) as info:
            connect_control(path, timeout=1)
    text = str(info.value)
    assert f"cannot connect to {path!r}" in text and "no daemon listens" not in text, text
