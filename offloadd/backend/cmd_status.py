"""``offloadd status``: what a running daemon holds and does (``--json`` for the raw document)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from offloadd.backend.daemon_link import DaemonError, query
from offloadd.config import load_daemon
from offloadd.units import format_bytes
from offloadd.wire import protocol as proto
from offloadd.wire.address import socket_path

__all__ = ["add_arguments", "main", "query", "refusal"]

_STALE_S = 5.0  # the daemon probes its directories every second: older figures are flagged


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--socket",
        default=None,
        help="daemon socket (default: $OFFLOADD_DAEMON_SOCKET, else the per-user default path)",
    )
    p.add_argument("--json", action="store_true", help="print the status document as JSON")


def refusal(r: proto.Reply) -> str:
    """A refused reply's errno and the daemon's reason, in words."""
    return f"{os.strerror(r.status)}: {r.tail.decode(errors='replace')}"


def _table(doc: dict[str, Any]) -> str:
    lines = [
        f"offloadd daemon pid {doc['pid']} on {doc['socket']}, up {doc['uptime_s']:.0f}s, "
        f"engine {doc['engine']}, checksum {doc['checksum']}",
        f"held {format_bytes(doc['bytes_held'])}; written {format_bytes(doc['bytes_written'])} "
        f"({format_bytes(doc['write_bytes_per_s'])}/s), read {format_bytes(doc['bytes_read'])} "
        f"({format_bytes(doc['read_bytes_per_s'])}/s)",
        f"queue: {doc['queue']['in_engine']} in engine, {doc['queue']['reads']} reads and "
        f"{doc['queue']['writes']} writes waiting; errors {doc['io_errors']}, refused "
        f"{doc['refused_requests']}, dropped connections {doc['dropped_connections']}",
    ]
    for d in doc["dirs"]:
        free = format_bytes(d["free_bytes"]) if "free_bytes" in d else d.get("error", "?")
        age = d.get("age_s", 0.0)  # an older daemon probed at every query
        stale = f" (measured {age:.0f} s ago)" if age >= _STALE_S else ""
        lines.append(f"dir {d['path']}: {free} free{stale}")
    probing = doc.get("dirs_probe_running_s")
    if probing is not None and probing >= _STALE_S:
        lines.append(
            f"the free-space probe has been running for {probing:.0f} s: a directory's file "
            "system is slow or hung (sessions are not held up by it)"
        )
    only = doc.get("only_uid")  # a client that does not administer the daemon sees its own
    mine = "" if only is None else f" of uid {only} (the only ones shown to this user)"
    lines.append(f"{len(doc['sessions'])} session(s){mine}")
    for s in doc["sessions"]:
        lines.append(
            f"  #{s['id']} {s['identity']} (uid {s['uid']}): holds {format_bytes(s['bytes_held'])}"
            f" in {s['blocks']} blocks, wrote {format_bytes(s['bytes_written'])}, read "
            f"{format_bytes(s['bytes_read'])}, queued {s['queued_reads']}r/{s['queued_writes']}w,"
            f" errors {s['errors']}"
        )
    lines.extend(f"error: {e}" for e in doc["recent_errors"])
    return "\n".join(lines)


def main(ns: argparse.Namespace) -> int:
    try:
        cfg = load_daemon()
    except ValueError as e:
        print(f"offloadd status: {e}", file=sys.stderr)
        return 2
    path = socket_path(ns.socket or cfg.socket)  # see [the default socket]
    try:
        r = query(path, trusted_uids=cfg.trusted_uids)
    except DaemonError as e:
        print(f"offloadd status: {e}", file=sys.stderr)
        return 1
    if r.status:
        print(f"offloadd status: the daemon at {path} refused: {refusal(r)}", file=sys.stderr)
        return 1
    doc = json.loads(r.tail)
    print(json.dumps(doc, indent=2) if ns.json else _table(doc))
    return 0
