"""``offloadd run [--config F] [--report P] [--daemon] -- CMD ...``: run a command with offloading on.

The wrapper for users who prefer one to an environment variable. It validates the configuration
first (so a bad file fails here, not in every rank), then runs ``CMD`` with ``OFFLOADD=1``
(and ``OFFLOADD_CONFIG``/``OFFLOADD_REPORT`` when given) and with offloadd's bootstrap directory
first on ``PYTHONPATH``, so activation does not depend on ``offloadd.pth`` being installed in
the interpreter that ``CMD`` starts. Launchers started by ``CMD`` (torchrun, deepspeed) pass the
environment on to their ranks. The exit status is ``CMD``'s.

``--daemon`` starts a node daemon (``offloadd serve`` on a private socket) for the command's
lifetime and points every process of ``CMD`` at it (``OFFLOADD_DAEMON_SOCKET``); the daemon is
stopped when ``CMD`` ends.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path

from offloadd.cli_dirs import ready_parent

__all__ = ["HELP", "add_arguments", "bootstrap_dir", "build_env", "main"]

HELP = "run a command (a training script, torchrun, deepspeed) with offloading switched on"


class LaunchError(Exception):
    """A problem with the command line or configuration, reported without a traceback."""


def bootstrap_dir() -> str:
    """The directory holding offloadd's bootstrap ``sitecustomize``."""
    return str(Path(__file__).resolve().parent / "_bootstrap")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", metavar="FILE", help="TOML config (sets OFFLOADD_CONFIG)")
    p.add_argument(
        "--report",
        metavar="PATH",
        help="write the stats as JSON at exit (sets OFFLOADD_REPORT; {rank} is substituted); "
        "its directory is created (mode 0700) if missing",
    )
    p.add_argument(
        "--daemon",
        action="store_true",
        help="start a node daemon for the command and offload through it",
    )
    p.add_argument("cmd", nargs=argparse.REMAINDER, help="-- COMMAND [ARGS ...]")


def build_env(base: Mapping[str, str], *, config: str | None, report: str | None) -> dict[str, str]:
    """The command's environment; raises LaunchError naming what is wrong with it."""
    from offloadd.integrations.settings import EnvSettings

    env = dict(base)
    env["OFFLOADD"] = "1"
    if config is not None:
        path = Path(config).expanduser().resolve()
        env["OFFLOADD_CONFIG"] = str(path)
    if report is not None:
        env["OFFLOADD_REPORT"] = str(Path(report).expanduser().resolve())
        # Note [directories of the command line] in cli_dirs.py; a directory that names the
        # rank is each rank's, checked at its activation.
        if "{rank}" not in str(Path(report).parent):
            try:
                ready_parent("--report", report)
            except ValueError as e:
                raise LaunchError(str(e)) from None
    try:
        EnvSettings.from_env(env)
    except ValueError as e:
        raise LaunchError(str(e)) from None
    boot = bootstrap_dir()
    rest = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != boot]
    # The directory that holds offloadd_boot and the offloadd package, for source checkouts.
    root = str(Path(boot).parent.parent)
    if root not in rest:
        rest.append(root)
    env["PYTHONPATH"] = os.pathsep.join([boot, *rest])
    return env


@contextlib.contextmanager
def _daemon_session(env: dict[str, str]) -> Iterator[None]:
    """Start the node daemon for the command's lifetime; it sets the socket in ``env``."""
    from offloadd.integrations.run_daemon import DaemonStartError, session_for_run

    try:
        with session_for_run(env):
            yield
    except DaemonStartError as e:
        raise LaunchError(f"--daemon: {e}") from None


def main(ns: argparse.Namespace) -> int:
    cmd = list(ns.cmd)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    try:
        if not cmd:
            raise LaunchError("no command given: offloadd run [OPTIONS] -- COMMAND [ARGS ...]")
        env = build_env(os.environ, config=ns.config, report=ns.report)
        if not ns.daemon:
            # Nothing to clean up afterwards: become the command, so that signals, the exit
            # status and the process tree are exactly the command's.
            sys.stdout.flush()
            sys.stderr.flush()
            try:
                os.execvpe(cmd[0], cmd, env)
            except OSError as e:
                raise LaunchError(f"cannot run {cmd[0]!r}: {e.strerror}") from None
        with _daemon_session(env):
            try:
                proc = subprocess.Popen(cmd, env=env)
            except OSError as e:
                raise LaunchError(f"cannot run {cmd[0]!r}: {e.strerror}") from None
            return _wait(proc)
    except LaunchError as e:
        print(f"offloadd run: {e}", file=sys.stderr)
        return 2


def _wait(proc: subprocess.Popen[bytes]) -> int:
    """Wait for the command, passing SIGTERM on; Ctrl-C reaches it through the terminal."""
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: proc.send_signal(signum))
    try:
        while True:
            try:
                code = proc.wait()
            except KeyboardInterrupt:
                continue  # the command got the same SIGINT; wait for it to finish
            return code if code >= 0 else 128 - code
    finally:
        signal.signal(signal.SIGTERM, previous)
