"""``offloadd doctor``'s checks of places: the offload directories and the daemon's socket.

Note: [doctor's free-space threshold]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A directory FAILs below ``min_free`` free bytes (``--min-free``; default: the configuration's
``staging_bytes``, 128 MiB by default) and WARNs below ten times that. ``staging_bytes`` is what
forward writes before it first waits for the disk: with less room than one pool of writes the
first step already runs out of space, and every chunk that cannot be written stays in memory
(Note [never fail the step]), which is the memory offloading was meant to free. How much a run
really needs is the most activation bytes it holds at once, which only a run shows (``offloadd
plan``, the stats' ``bytes_written``); so past ten pools the doctor says OK and names the figure.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import stat
from dataclasses import dataclass
from typing import Any

import torch

from offloadd.backend.cmd_status import refusal
from offloadd.backend.daemon_link import DaemonError, query
from offloadd.config import Config
from offloadd.io.buffers import ALIGN, AlignedBuffer, address_view
from offloadd.io.files import MEMORY_FS, SlotFile, default_offload_dir, filesystem_type
from offloadd.tools.doctor.checks import Check, Status
from offloadd.units import format_bytes
from offloadd.wire.address import socket_path
from offloadd.wire.trust import own_uid, peer_credentials, socket_dir_problem

__all__ = ["WARN_FACTOR", "Target", "daemon_checks", "dir_checks", "free_check", "targets"]

WARN_FACTOR = 10
"""A directory with less than this many times ``min_free`` free WARNs (see the Note above)."""

_NETWORK_FS = frozenset(
    {"nfs", "nfs4", "cifs", "smb3", "smbfs", "ceph", "lustre", "glusterfs", "9p", "afs", "gpfs"}
)
_OVERLAY_FS = frozenset({"overlay", "overlayfs", "aufs"})


@dataclass(frozen=True, slots=True)
class Target:
    """A directory to examine: its path, the key that names it, the ``direct_io`` that applies
    to it, and whether the configured setup writes there (why not, if not)."""

    path: str
    role: str  # "ssd_dirs", "default" (ssd_dirs empty) or "daemon.dirs"
    direct_io: str
    unused: str = ""


def targets(cfg: Config, daemon_does_io: bool) -> tuple[list[Target], list[Check]]:
    """The configuration's directories (or the default one), and the daemon section's."""
    unused = "tier keep" if cfg.tier == "keep" else ""
    if daemon_does_io:
        unused = "the daemon at daemon.socket does the I/O"
    out: list[Target] = []
    problems: list[Check] = []
    if cfg.ssd_dirs:
        out += [Target(d, "ssd_dirs", cfg.direct_io, unused) for d in cfg.ssd_dirs]
    else:
        try:
            out.append(Target(default_offload_dir(create=False), "default", cfg.direct_io, unused))
        except ValueError as e:
            problems.append(Check("dir.default", "warn" if unused else "fail", str(e)))
    out += [Target(d, "daemon.dirs", cfg.daemon.direct_io) for d in cfg.daemon.dirs]
    return out, problems


def _nearest(path: str) -> str:
    while not os.path.lexists(path) and path != os.path.dirname(path):
        path = os.path.dirname(path)
    return path


def dir_checks(t: Target, min_free: int) -> list[Check]:
    """Access and mode, file system, free space, an O_DIRECT write and read: for ``t``."""
    where = f"{t.role} {t.path}" if t.role != "default" else f"{t.path} (default: ssd_dirs empty)"
    facts: dict[str, Any] = {"path": t.path, "role": t.role}
    at = t.path
    if not os.path.lexists(t.path) and t.role == "default":
        at = _nearest(t.path)
        text = f"does not exist yet: made (mode 0700) at first use; examined at {at}"
        out = [Check("dir.access", "info", text, facts)]
    elif not os.path.isdir(t.path):
        what = "is not a directory"
        if not os.path.lexists(t.path):
            what = "does not exist (configured directories are never created)"
        out = [Check("dir.access", "fail", f"{t.role}: {t.path!r} {what}", facts)]
        return _finish(out, t, where)
    else:
        out = [_access(t, facts)]
        if out[0].status == "fail":
            return _finish(out, t, where)
    fs = filesystem_type(at)
    out.append(_fs_check(fs, facts))
    st = os.statvfs(at)
    out.append(free_check(t.path, st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize, min_free))
    out.append(_direct_check(at, t.direct_io, facts))
    return _finish(out, t, where)


def _finish(checks: list[Check], t: Target, where: str) -> list[Check]:
    for c in checks:
        c.subject = where
        c.facts.setdefault("path", t.path)
        if t.unused and c.status == "fail":  # not written by this setup: a warning only
            c.status = "warn"
            c.message += f"; not used now: {t.unused}"
    return checks


def _access(t: Target, facts: dict[str, Any]) -> Check:
    st = os.stat(t.path)
    mode = stat.S_IMODE(st.st_mode)
    facts = {**facts, "mode": f"{mode:04o}", "owner_uid": st.st_uid}
    if not os.access(t.path, os.W_OK | os.X_OK):
        return Check(
            "dir.access", "fail", f"{t.role}: {t.path!r} is not writable by uid {own_uid()}", facts
        )
    if mode & 0o022 and not mode & stat.S_ISVTX:
        return Check(
            "dir.access",
            "warn",
            f"writable, but group or others may write there too (mode {mode:04o}, no sticky "
            "bit): they can remove or replace its entries; use a directory of your own (0700)",
            facts,
        )
    return Check("dir.access", "ok", f"writable, mode {mode:04o}, owner uid {st.st_uid}", facts)


def _fs_check(fs: str, facts: dict[str, Any]) -> Check:
    facts = {**facts, "fs_type": fs}
    if fs in MEMORY_FS:
        return Check(
            "dir.fs",
            "warn",
            f"file system {fs}: memory, so offloading there saves no RAM; and it does not "
            "enforce O_DIRECT alignment, so it hides what a disk would refuse",
            facts,
        )
    if fs in _NETWORK_FS or fs.startswith("fuse"):
        return Check(
            "dir.fs",
            "warn",
            f"file system {fs}: over the network (or FUSE), slower than a local drive, with "
            "its own O_DIRECT rules",
            facts,
        )
    if fs in _OVERLAY_FS:
        return Check(
            "dir.fs",
            "warn",
            f"file system {fs}: a container's layered file system, which may refuse O_DIRECT; "
            "mount a volume from a local drive",
            facts,
        )
    return Check("dir.fs", "ok", f"file system {fs or 'unknown'}", facts)


def _write_read(directory: str, direct_io: str) -> tuple[int | None, str] | None:
    """Create an offload file as the runtime does (:class:`SlotFile`), write one aligned block
    and read it back: None, or (errno, what failed)."""
    try:
        f = SlotFile(directory, ALIGN, direct_io)
    except ValueError as e:
        cause = e.__cause__
        return (cause.errno, str(cause)) if isinstance(cause, OSError) else (None, str(e))
    out, back = AlignedBuffer(ALIGN), AlignedBuffer(ALIGN)
    try:
        out.tensor.fill_(0xA5)
        os.pwrite(f.fd, address_view(out.address, ALIGN), 0)
        n = os.preadv(f.fd, [address_view(back.address, ALIGN)], 0)
        if n != ALIGN or not torch.equal(out.tensor, back.tensor):
            return errno.EIO, f"read back {n} bytes, not the {ALIGN} written"
        return None
    except OSError as e:
        return e.errno, str(e)
    finally:
        f.close()
        out.close()
        back.close()


def _direct_check(at: str, setting: str, facts: dict[str, Any]) -> Check:
    direct = _write_read(at, "on")
    buffered = direct if direct is None else _write_read(at, "off")
    err = None if direct is None else direct[0]
    facts = {
        **facts,
        "direct_io": setting,
        "o_direct": direct is None,
        "errno": None if err is None else errno.errorcode.get(err, str(err)),
        "error": None if direct is None else direct[1],
    }
    if buffered is not None:
        return Check("dir.direct_io", "fail", f"cannot write an offload file: {buffered[1]}", facts)
    if direct is None:
        note = "" if setting != "off" else " (unused: direct_io = off)"
        return Check("dir.direct_io", "ok", f"O_DIRECT: 4 KiB written and read back{note}", facts)
    refused = f"O_DIRECT refused: {direct[1]}"
    if setting == "on":
        return Check("dir.direct_io", "fail", f"{refused}, and direct_io = on", facts)
    if setting == "auto":
        return Check(
            "dir.direct_io", "warn", f"{refused}; direct_io = auto uses the page cache", facts
        )
    return Check("dir.direct_io", "info", f"{refused} (direct_io = off)", facts)


def free_check(path: str, free: int, total: int | None, min_free: int) -> Check:
    """FAIL below ``min_free`` bytes free, WARN below ``WARN_FACTOR`` times it."""
    facts = {"path": path, "free_bytes": free, "total_bytes": total, "min_free_bytes": min_free}
    of = "" if total is None else f" of {format_bytes(total)}"
    if free < min_free:
        text = f"{path} is full ({format_bytes(free)} free{of}, below the "
        return Check("dir.free", "fail", text + f"{format_bytes(min_free)} needed)", facts)
    if free < WARN_FACTOR * min_free:
        text = f"{path} is nearly full ({format_bytes(free)} free{of}, less than {WARN_FACTOR} x "
        return Check("dir.free", "warn", text + f"the {format_bytes(min_free)} needed)", facts)
    return Check("dir.free", "ok", f"{format_bytes(free)} free{of}", facts)


# -- the daemon's socket ---------------------------------------------------------------------


def daemon_checks(cfg: Config, min_free: int) -> list[Check]:
    """Where the daemon listens: its directory, the process there and whether the client would
    trust it (offloadd/wire/trust.py [who trusts whom]), and what it says of itself."""
    d = cfg.daemon
    path = socket_path(d.socket)
    configured = bool(d.socket)
    used = configured and cfg.tier == "ssd"
    who = f"daemon.socket {path}" if configured else f"the default socket {path}"
    # absent or untrusted: fatal where the training side would use it, else worth a word
    absent: Status = "fail" if used else ("warn" if configured else "info")
    untrusted: Status = "fail" if used else "warn"
    trusted = {own_uid(), 0, *d.trusted_uids}
    expected = (
        f"uid {own_uid()}, root or daemon.trusted_uids "
        f"({', '.join(map(str, d.trusted_uids)) or 'none set'})"
    )
    facts: dict[str, Any] = {"socket": path, "configured": configured, "used": used}
    note = "" if used else " (daemon.socket is not set: training uses the embedded engine)"
    if configured and not used:
        note = f" (tier {cfg.tier}: the daemon is not used)"

    def check(key: str, status: Status, text: str) -> Check:
        return Check(key, status, text, dict(facts), "daemon")

    directory = os.path.dirname(path) or "."
    try:
        dst = os.lstat(directory)
    except OSError as e:
        return [
            check("daemon.socket", absent, f"{who}: no daemon: {directory}: {e.strerror}{note}")
        ]
    facts.update(dir_owner_uid=dst.st_uid, dir_mode=f"{stat.S_IMODE(dst.st_mode):04o}")
    problem = socket_dir_problem(directory, trusted, expected, dst)
    if problem is not None:
        text = f"{who}: the client would not connect: the socket's {problem}"
        return [check("daemon.socket", untrusted, text)]
    try:
        sst = os.lstat(path)
    except OSError as e:
        return [check("daemon.socket", absent, f"{who}: no daemon: {e.strerror}{note}")]
    facts["socket_owner_uid"] = sst.st_uid
    if not stat.S_ISSOCK(sst.st_mode):
        return [check("daemon.socket", absent, f"{who} is not a socket{note}")]
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(2.0)
        try:  # nothing is sent: only who listens (SO_PEERCRED)
            s.connect(path)
            pid, uid, _gid = peer_credentials(s)
        except OSError as e:
            stale = e.errno == errno.ECONNREFUSED
            why = "a stale socket file: nothing listens there" if stale else e.strerror or str(e)
            return [check("daemon.socket", absent, f"{who}: no daemon: {why}{note}")]
    facts.update(peer_pid=pid, peer_uid=uid, trusted=uid in trusted)
    if uid not in trusted:
        text = f"{who}: pid {pid} listens as uid {uid}; the client trusts {expected}: it would refuse it"
        return [check("daemon.socket", untrusted, text)]
    try:
        reply = query(path, trusted_uids=d.trusted_uids)
        doc: dict[str, Any] = json.loads(reply.tail) if not reply.status else {}
    except (DaemonError, ValueError) as e:
        return [check("daemon.socket", absent, f"{who}: pid {pid} (uid {uid}) did not answer: {e}")]
    if reply.status:
        text = f"{who}: the daemon (pid {pid}, uid {uid}) refused: {refusal(reply)}"
        return [check("daemon.socket", absent, text)]
    facts.update(engine=doc.get("engine"), sessions=len(doc.get("sessions", [])))
    out = [
        check(
            "daemon.socket",
            "ok" if used else "info",
            f"{who}: daemon pid {pid} (uid {uid}, trusted) answers: engine {doc.get('engine')}, "
            f"{facts['sessions']} session(s){note}",
        )
    ]
    for entry in doc.get("dirs", []):
        if "free_bytes" in entry:
            c = free_check(entry["path"], entry["free_bytes"], None, min_free)
            if c.status == "ok":
                c.message = f"the daemon's dir {entry['path']}: {c.message}"
        else:
            c = Check("dir.free", "warn", f"the daemon's dir {entry['path']}: {entry.get('error')}")
        c.id, c.subject = "daemon.dir", "daemon"
        if not used and c.status == "fail":
            c.status = "warn"
        out.append(c)
    return out
