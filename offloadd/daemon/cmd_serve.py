"""``offloadd serve``: run the daemon in the foreground (logs to stderr; SIGTERM/SIGINT stop it).

Its settings are the ``daemon`` section of the one config, read by the one loader
(:func:`offloadd.config.load_daemon`): the ``[daemon]`` table of ``--config FILE``, then the
``OFFLOADD_DAEMON_*`` variables, then the command-line options. The training side's variables
(``OFFLOADD_CONFIG`` and the other ``OFFLOADD_*``) are not the daemon's business and are not read.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from offloadd.cli_dirs import ready_dir, ready_parent
from offloadd.config import DaemonConfig, load_daemon, parse_size
from offloadd.wire.address import socket_path

__all__ = ["add_arguments", "main"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--config", help="TOML file whose [daemon] table is read (see configs/daemon.toml)"
    )
    p.add_argument(
        "--socket",
        help="Unix socket path, its directory created (mode 0700, 0711 with allowed_uids) if "
        "missing, else used as it is (default: $OFFLOADD_DAEMON_SOCKET, else the per-user "
        "default path, $XDG_RUNTIME_DIR/offloadd/daemon.sock or "
        "/tmp/offloadd-run-$UID/daemon.sock)",
    )
    p.add_argument(
        "--dir",
        action="append",
        dest="dirs",
        metavar="DIR",
        help="offload directory (repeatable), created (mode 0700) if missing",
    )
    p.add_argument(
        "--quota-bytes",
        help="disk bytes the sessions of one user may hold together (e.g. 8GiB; 0: none)",
    )
    p.add_argument("--checksum", choices=["xxh3", "crc32", "none"], help="per-chunk checksum")
    p.add_argument("--io-threads", type=int, help="requests in flight at once")
    p.add_argument("--metrics-port", type=int, help="serve Prometheus metrics on 127.0.0.1:PORT")


def config_from_args(ns: argparse.Namespace) -> DaemonConfig:
    cfg = load_daemon(ns.config)
    changes: dict[str, object] = {}
    if ns.socket:
        changes["socket"] = ns.socket
    if ns.dirs:
        changes["dirs"] = tuple(ns.dirs)
    if ns.quota_bytes is not None:
        changes["quota_bytes"] = parse_size("--quota-bytes", ns.quota_bytes)
    if ns.checksum:
        changes["checksum"] = ns.checksum
    if ns.io_threads is not None:
        changes["io_threads"] = ns.io_threads
    if ns.metrics_port is not None:
        changes["metrics_port"] = ns.metrics_port
    return cfg.replace(**changes) if changes else cfg


def main(ns: argparse.Namespace) -> int:
    logging.getLogger("offloadd").setLevel(logging.DEBUG if ns.verbose else logging.INFO)
    try:
        cfg = config_from_args(ns)
        # The options' directories, before the daemon starts (Note [directories of the command
        # line] in cli_dirs.py); the settings file's dirs are checked by the daemon, not made.
        for d in ns.dirs or ():
            ready_dir("--dir", d)
        made = None  # the socket's directory, if made here: the daemon sets its mode
        if ns.socket:
            sock = socket_path(ns.socket)  # "default": see [the default socket]
            parent = Path(sock).expanduser().parent
            made = None if os.path.lexists(parent) else str(parent)
            if not parent.is_symlink():  # the daemon refuses one, untouched: no probe in it
                ready_parent("--socket", sock)
        from offloadd.daemon.core import serve

        return serve(cfg, made_socket_dir=made)
    except ValueError as e:
        print(f"offloadd serve: {e}", file=sys.stderr)
        return 2
