"""``offloadd run --daemon``: a node daemon started for one command and stopped after it."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator

__all__ = ["DaemonStartError", "session_for_run"]

_START_TIMEOUT_S = 60.0


class DaemonStartError(RuntimeError):
    """The daemon did not come up; the message says why (its log tail included)."""


@contextlib.contextmanager
def session_for_run(env: dict[str, str]) -> Iterator[str]:
    """Start ``offloadd serve`` on a private socket, point ``env`` at it, stop it afterwards.

    The daemon offloads to the configuration's ``ssd_dirs`` (``OFFLOADD_CONFIG`` and
    ``OFFLOADD_*`` in ``env``; else its own default directory), and runs without ``OFFLOADD*``
    variables in its environment, so it never offloads its own tensors; the other keys of the
    ``daemon`` section keep their defaults. Its log goes to a file next to the socket and is
    shown if it fails to start."""
    from offloadd.backend.cmd_status import query
    from offloadd.backend.daemon import DaemonError
    from offloadd.config import Config

    cfg = Config.from_env(env)

    run_dir = tempfile.mkdtemp(prefix="offloadd-run-")  # 0700
    sock = os.path.join(run_dir, "daemon.sock")
    log_path = os.path.join(run_dir, "daemon.log")
    # -P: the installed offloadd, never a source tree that happens to be the cwd
    cmd = [sys.executable, "-P", "-m", "offloadd", "serve", "--socket", sock]
    for d in cfg.ssd_dirs:
        cmd += ["--dir", d]
    daemon_env = {k: v for k, v in env.items() if not k.startswith("OFFLOADD")}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, env=daemon_env, stdout=log, stderr=log)
    try:
        deadline = time.monotonic() + _START_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                raise DaemonStartError(
                    f"the daemon exited with status {proc.returncode}: {_tail(log_path)}"
                )
            try:
                query(sock)
                break
            except DaemonError:
                if time.monotonic() > deadline:
                    raise DaemonStartError(
                        f"the daemon did not answer on {sock} within {_START_TIMEOUT_S:.0f} s: "
                        f"{_tail(log_path)}"
                    ) from None
                time.sleep(0.05)
        env["OFFLOADD_DAEMON_SOCKET"] = sock
        yield sock
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        shutil.rmtree(run_dir, ignore_errors=True)


def _tail(path: str, nbytes: int = 2000) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - nbytes))
            return f.read().decode(errors="replace").strip() or "(no output)"
    except OSError as e:
        return f"(no log: {e})"
