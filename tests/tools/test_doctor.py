"""``offloadd doctor``: real directories, file systems, sockets and a real daemon.

Most cases run the command in this process (``offloadd.cli.main``), since a fresh interpreter
costs seconds for torch's import; one runs ``python -m offloadd doctor`` to check the exit status
and streams of the real command. Every case names its directories (or a private cache home) and
a private ``XDG_RUNTIME_DIR``, so neither the user's files nor a daemon someone else runs on
this machine can change the outcome.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from offloadd import cli
from offloadd.config import Config
from offloadd.io.engine_choice import open_host_engine
from offloadd.io.files import MEMORY_FS, filesystem_type
from offloadd.tools.doctor.checks import Check
from offloadd.tools.doctor.command import SECTIONS, diagnose, format_report, verdict_line
from offloadd.tools.doctor.paths import WARN_FACTOR, free_check
from tests._support.daemon_proc import DaemonProc
from tests._support.helpers import loop_ext4

ENGINE_PARAMS = ("default",)  # disk_dir once: the doctor probes engines itself

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """No OFFLOADD_* variable of the caller's; the default socket in a directory of the test."""
    for var in list(os.environ):
        if var.startswith("OFFLOADD"):
            monkeypatch.delenv(var)
    runtime = tmp_path / "xdg-run"
    runtime.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    return runtime


def doctor(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    rc = cli.main(["doctor", *args])
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def doctor_json(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, dict[str, Any]]:
    rc, out, err = doctor(capsys, "--json", *args)
    doc: dict[str, Any] = json.loads(out)
    assert err.strip().splitlines()[-1] == verdict_line(doc)
    return rc, doc


def checks(doc: dict[str, Any], section: str, ident: str | None = None) -> list[dict[str, Any]]:
    return [c for c in doc["sections"][section] if ident is None or c["id"] == ident]


def one(doc: dict[str, Any], section: str, ident: str) -> dict[str, Any]:
    (found,) = checks(doc, section, ident)
    return found


def test_ext4_dir_json_keys_and_choices(
    disk_dir: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A real disk directory from --config, an OFFLOADD_* override: every section and key is
    there, the directory passes, and the engine named is the one the runtime opens."""
    cfg_file = tmp_path / "offload.toml"
    cfg_file.write_text(f'ssd_dirs = ["{disk_dir}"]\ndirect_io = "on"\n')
    monkeypatch.setenv("OFFLOADD_IO_URING", "off")
    rc, doc = doctor_json(capsys, "--config", str(cfg_file))
    assert rc == 0 and doc["exit_status"] == 0, doc["reason"]
    assert set(doc) == {"offloadd", "status", "reason", "exit_status", "min_free_bytes", "sections"}
    assert list(doc["sections"]) == list(SECTIONS)
    for section in doc["sections"].values():
        for c in section:
            assert set(c) == {"id", "subject", "status", "message", "facts"}
            assert c["status"] in ("ok", "info", "warn", "fail")
    config = one(doc, "config", "config")["facts"]
    assert config["file"] == str(cfg_file) and config["variables"] == ["OFFLOADD_IO_URING"]
    assert config["ssd_dirs"] == [str(disk_dir)] and config["io_uring"] == "off"
    assert doc["min_free_bytes"] == Config().staging_bytes  # the default threshold
    dirs = checks(doc, "directories")
    assert {c["id"] for c in dirs} == {"dir.access", "dir.fs", "dir.free", "dir.direct_io"}
    assert all(c["status"] == "ok" and c["facts"]["path"] == str(disk_dir) for c in dirs), dirs
    fs = one(doc, "directories", "dir.fs")["facts"]["fs_type"]
    assert fs == filesystem_type(disk_dir) and fs not in MEMORY_FS
    direct = one(doc, "directories", "dir.direct_io")["facts"]
    assert direct["o_direct"] is True and direct["direct_io"] == "on"
    assert one(doc, "directories", "dir.free")["facts"]["free_bytes"] > 0
    import torch

    torch_facts = one(doc, "versions", "torch")["facts"]
    assert torch_facts["version"] == torch.__version__
    assert one(doc, "versions", "cuda")["facts"]["available"] == torch.cuda.is_available()
    # the configured engine (io_uring off) and what auto would pick: as the runtime opens them
    for ident, cfg in (("engine", Config(io_uring="off")), ("engine_auto", Config())):
        engine, choice = open_host_engine(cfg)
        engine.close()
        assert one(doc, "choices", ident)["facts"]["name"] == choice.name
    assert list(disk_dir.iterdir()) == []  # the probe file had no name


def test_tmpfs_dir_warns(capsys: pytest.CaptureFixture[str]) -> None:
    if filesystem_type("/dev/shm") not in MEMORY_FS:
        pytest.skip(f"/dev/shm is {filesystem_type('/dev/shm') or 'missing'}, not tmpfs")
    d = tempfile.mkdtemp(prefix="offloadd-doctor-", dir="/dev/shm")
    try:
        rc, doc = doctor_json(capsys, "--ssd-dir", d)
    finally:
        os.rmdir(d)
    fs = one(doc, "directories", "dir.fs")
    assert fs["status"] == "warn" and "O_DIRECT alignment" in fs["message"]
    assert rc == 0 and doc["status"] == "warn"  # works, worse than it could
    assert verdict_line(doc).startswith("offloadd doctor: OK, with ")


@pytest.fixture
def full_fs(tmp_path: Path) -> Iterator[Path]:
    """A real full file system: an 8 MiB ext4 image (no blocks reserved for root), loop-mounted
    and filled with a file until write() reports ENOSPC. Needs root and loop devices."""
    with loop_ext4(tmp_path, 8, reserved=False) as mnt:
        fd = os.open(mnt / "filler", os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            for size in (1 << 20, 4096):
                while True:
                    try:
                        os.write(fd, b"\0" * size)
                    except OSError as e:
                        assert e.errno == errno.ENOSPC, e
                        break
            os.fsync(fd)
        finally:
            os.close(fd)
        yield mnt


def test_full_file_system_fails(full_fs: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _err = doctor(capsys, "--ssd-dir", str(full_fs))
    assert rc == 1
    last = out.strip().splitlines()[-1]
    assert last.startswith(f"offloadd doctor: FAIL: {full_fs} is full ("), out
    assert "[FAIL]" in out


def test_free_space_below_threshold(disk_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """ "Full" simulated on a real disk: the directory's real free space (statvfs) against a
    --min-free threshold set above it (FAIL), then just under ten times it (WARN). The real
    full file system is test_full_file_system_fails (root only)."""
    st = os.statvfs(disk_dir)
    free = st.f_bavail * st.f_frsize
    rc, doc = doctor_json(capsys, "--ssd-dir", str(disk_dir), "--min-free", str(free + (1 << 40)))
    c = one(doc, "directories", "dir.free")
    assert rc == 1 and c["status"] == "fail" and doc["reason"] == c["message"]
    assert c["message"].startswith(f"{disk_dir} is full (")
    # other writers share the disk: leave room either way of the measured figure
    rc, doc = doctor_json(capsys, "--ssd-dir", str(disk_dir), "--min-free", str(free // 5))
    assert rc == 0 and one(doc, "directories", "dir.free")["status"] == "warn"


def test_free_check_and_report_format() -> None:
    c = free_check("/mnt/x", 12 << 10, 8 << 20, 128 << 20)
    assert (c.status, c.message) == (
        "fail",
        "/mnt/x is full (12.0 KiB free of 8.0 MiB, below the 128.0 MiB needed)",
    )
    assert free_check("/mnt/x", 256 << 20, None, 128 << 20).status == "warn"
    ok = free_check("/mnt/x", WARN_FACTOR * (128 << 20), None, 128 << 20)
    assert (ok.status, ok.message) == ("ok", "1.2 GiB free")
    doc = {
        "offloadd": "0",
        "status": "fail",
        "reason": c.message,
        "sections": {
            "directories": [
                Check("dir.free", "fail", c.message, subject="ssd_dirs /mnt/x").as_dict()
            ],
            "memory": [Check("memlock", "ok", "fine").as_dict()],
        },
    }
    text = format_report(doc)
    assert "  ssd_dirs /mnt/x\n    [FAIL] /mnt/x is full (12.0 KiB" in text
    assert "\nMemory\n  [ OK ] fine\n" in text
    assert text.splitlines()[-1] == f"offloadd doctor: FAIL: {c.message}"


def test_unreachable_sockets(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A path where nothing is, and a stale socket file (bound, never listened on): a FAIL when
    configured, a note when it is only the default path."""
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    missing = run / "none.sock"
    rc, doc = doctor_json(capsys, "--ssd-dir", str(tmp_path), "--socket", str(missing))
    c = one(doc, "daemon", "daemon.socket")
    assert rc == 1 and c["status"] == "fail" and "no daemon" in c["message"]
    assert doc["reason"] == c["message"]
    stale = run / "stale.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.bind(str(stale))
    rc, doc = doctor_json(capsys, "--ssd-dir", str(tmp_path), "--socket", str(stale))
    c = one(doc, "daemon", "daemon.socket")
    assert rc == 1 and "stale socket file" in c["message"] and c["facts"]["configured"]
    rc, doc = doctor_json(capsys, "--ssd-dir", str(tmp_path))  # the default path: unused
    c = one(doc, "daemon", "daemon.socket")
    assert rc == 0 and c["status"] == "info" and not c["facts"]["configured"]


def test_socket_directory_others_may_write(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "open"
    run.mkdir()
    run.chmod(0o777)
    rc, doc = doctor_json(capsys, "--ssd-dir", str(tmp_path), "--socket", str(run / "d.sock"))
    c = one(doc, "daemon", "daemon.socket")
    assert rc == 1 and "would not connect" in c["message"] and "0777" in c["message"]


_LISTEN = "import socket, sys, time; s = socket.socket(fileno=int(sys.argv[1])); s.listen(); print('listening', flush=True); time.sleep(60)"


def test_listener_of_another_uid_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The socket bound here, listened on by a process of uid 65534: SO_PEERCRED names that
    uid, which the client does not trust; nothing is sent to it."""
    if os.geteuid() != 0:
        pytest.skip("a listener of another uid needs root")
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    path = run / "daemon.sock"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(path))
    fd = s.fileno()
    # an interpreter that user may run (the venv's may sit under a directory closed to it)
    python = next(p for p in ("/usr/bin/python3", sys.executable) if os.path.exists(p))
    try:
        child = subprocess.Popen(
            [python, "-c", _LISTEN, str(fd)], pass_fds=(fd,), user=65534, stdout=subprocess.PIPE
        )
    except OSError as e:
        s.close()
        pytest.skip(f"cannot start a process of uid 65534: {e}")
    s.close()
    try:
        assert child.stdout is not None
        if child.stdout.readline() != b"listening\n":
            pytest.skip("the listener of uid 65534 did not start")
        rc, doc = doctor_json(capsys, "--ssd-dir", str(tmp_path), "--socket", str(path))
    finally:
        child.kill()
        child.wait()
    c = one(doc, "daemon", "daemon.socket")
    assert rc == 1 and c["facts"]["peer_uid"] == 65534 and c["facts"]["trusted"] is False
    assert f"pid {child.pid} listens as uid 65534" in c["message"] and "refuse" in c["message"]


def test_reachable_daemon(
    daemon: DaemonProc, disk_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rc, doc = doctor_json(capsys, "--ssd-dir", str(disk_dir), "--socket", daemon.socket)
    assert rc == 0, doc["reason"]
    c = one(doc, "daemon", "daemon.socket")
    assert c["status"] == "ok" and c["facts"]["used"]
    assert c["facts"]["peer_pid"] == daemon.pid and c["facts"]["peer_uid"] == os.geteuid()
    assert c["facts"]["trusted"] is True and c["facts"]["engine"]
    dirs = checks(doc, "daemon", "daemon.dir")
    assert [d["facts"]["path"] for d in dirs] == [str(p) for p in daemon.dirs]
    # the embedded engine's choice does not apply: the daemon does the I/O
    assert one(doc, "choices", "engine")["status"] == "info"


def test_default_directory_is_examined_not_made(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """No ssd_dirs: the default directory the runtime would make is examined where it would
    be, and neither it nor the host cache is created by the doctor."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache))
    rc, doc = doctor_json(capsys)
    access = one(doc, "directories", "dir.access")
    assert access["subject"].startswith(str(cache / "offloadd"))
    assert access["status"] == "info" and "does not exist yet" in access["message"]
    assert one(doc, "memory", "host_cache")["facts"]["state"] in ("built", "unavailable")
    assert not cache.exists()
    assert rc == doc["exit_status"]


def test_bad_config_and_bad_option(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OFFLOADD_TIER", "bogus")
    rc, doc = doctor_json(capsys, "--ssd-dir", str(tmp_path))
    c = one(doc, "config", "config")
    assert rc == 1 and c["status"] == "fail" and "OFFLOADD_TIER" in c["message"]
    assert doc["reason"] == c["message"]
    rc, _out, err = doctor(capsys, "--min-free", "lots")
    assert rc == 2 and "--min-free" in err and "'lots'" in err


def test_command_exit_status_and_streams(tmp_path: Path) -> None:
    """The real command: JSON alone on stdout, the verdict last on stderr, exit status 1."""
    missing = tmp_path / "not-there"
    env = {k: v for k, v in os.environ.items() if not k.startswith("OFFLOADD")}
    done = subprocess.run(
        [sys.executable, "-m", "offloadd", "doctor", "--json", "--ssd-dir", str(missing)],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1, done.stderr
    doc = json.loads(done.stdout)
    assert doc["status"] == "fail" and doc["exit_status"] == 1
    assert done.stderr.strip().splitlines()[-1] == (
        f"offloadd doctor: FAIL: ssd_dirs: {str(missing)!r} does not exist "
        "(configured directories are never created)"
    )


def test_diagnose_is_callable_without_the_command() -> None:
    doc = diagnose(Config(tier="keep", ssd_dirs=("/nonexistent-offloadd",)), 1 << 20)
    access = one(doc, "directories", "dir.access")
    assert access["status"] == "warn" and "not used now: tier keep" in access["message"]


def test_host_cache_not_built(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The host cache's extension module not built: ``auto`` keeps torch's allocator with a WARN
    (on CPU, where it wants the host cache), ``caching`` FAILs; both name the module."""
    import torch

    from offloadd.runtime import host_allocator

    monkeypatch.setitem(sys.modules, host_allocator.EXTENSION, None)  # an import of it fails
    monkeypatch.setattr(host_allocator, "_cache", None)  # not loaded yet
    rc, doc = doctor_json(capsys, "--ssd-dir", str(tmp_path))
    cache = one(doc, "memory", "host_cache")
    assert cache["status"] == "warn" and cache["facts"]["state"] == "unavailable"
    assert host_allocator.EXTENSION in cache["message"] and rc == 0
    if not torch.cuda.is_available():
        pick = one(doc, "choices", "host_allocator")
        assert pick["status"] == "warn" and "-> system" in pick["message"]
    monkeypatch.setenv("OFFLOADD_HOST_ALLOCATOR", "caching")
    rc, doc = doctor_json(capsys, "--ssd-dir", str(tmp_path))
    pick = one(doc, "choices", "host_allocator")
    assert rc == 1 and pick["status"] == "fail" and host_allocator.EXTENSION in pick["message"]
    assert doc["reason"] == pick["message"]
