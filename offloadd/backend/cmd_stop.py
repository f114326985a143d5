"""``offloadd stop``: ask a running daemon to shut down cleanly (as SIGTERM does)."""

from __future__ import annotations

import argparse
import sys

from offloadd.backend.cmd_status import query, refusal
from offloadd.backend.daemon_link import DaemonError
from offloadd.config import load_daemon
from offloadd.wire import protocol as proto
from offloadd.wire.address import socket_path

__all__ = ["add_arguments", "main"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--socket",
        default=None,
        help="daemon socket (default: $OFFLOADD_DAEMON_SOCKET, else the per-user default path)",
    )


def main(ns: argparse.Namespace) -> int:
    try:
        cfg = load_daemon()
    except ValueError as e:
        print(f"offloadd stop: {e}", file=sys.stderr)
        return 2
    path = socket_path(ns.socket or cfg.socket)  # see [the default socket]
    try:
        r = query(path, proto.Msg.STOP, trusted_uids=cfg.trusted_uids)
    except DaemonError as e:
        print(f"offloadd stop: {e}", file=sys.stderr)
        return 1
    if r.status:  # EPERM: not the daemon's uid nor root (see trust [who trusts whom])
        print(f"offloadd stop: the daemon at {path} refused: {refusal(r)}", file=sys.stderr)
        return 1
    print(f"offloadd: daemon at {path} is stopping")
    return 0
