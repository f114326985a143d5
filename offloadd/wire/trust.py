"""Who the daemon and its clients trust: uids, as the kernel reports them.

Shared by both sides: the daemon's ``listen()`` (offloadd/daemon/core.py) and the client's
``connect_control`` (offloadd/backend/daemon_link.py, used by the Offloader's daemon backend,
``offloadd status`` and ``offloadd stop``).

Note: [who trusts whom] Whoever listens at the socket path receives every activation a client
offloads and answers its reads with bytes of its own choosing; and the per-user default path,
``/tmp/offloadd-run-$UID/daemon.sock`` where ``XDG_RUNTIME_DIR`` is not set (ssh, Slurm,
containers; offloadd/wire/address.py [the default socket]), lies in a directory any local user
can create first. So, before it sends a byte, a
client requires:

- the process listening at the socket (SO_PEERCRED: the uid that called ``listen()``) to run as
  the client's own uid, as root, or as a uid of the client's ``daemon.trusted_uids``;
- the socket's directory to be a directory, not a symbolic link to one (whoever made the link
  may point it anywhere), to belong to one of those uids and not to be writable by group or
  others: whoever may write there can put a socket of their own in its place
  (:func:`socket_dir_problem`).

Otherwise it refuses with a ``DaemonError`` naming the path, the uid found and the ones expected.
Root is always trusted: it can read any process's memory anyway. Root as a client trusts no
other uid by default either. A daemon run by a service user for several users (``allowed_uids``)
is a deliberate setup, so its clients opt in explicitly, ``daemon.trusted_uids =
[<the service uid>]`` (``OFFLOADD_DAEMON_TRUSTED_UIDS``): nothing about a path proves who made it.

The daemon applies the same directory rule to its own socket's directory, with its own uid as the
only one trusted, before it binds (so it refuses ``/tmp`` itself, and a link another user made
at ``/tmp/offloadd-run-$UID`` to a directory of the daemon's uid, ``/etc`` for a root daemon). It
opens the directory without following a link (:func:`open_socket_dir`) and does the rest through
that descriptor, so what it checked is what it uses. It sets the mode only of a directory it
created (see offloadd/daemon/core.py [socket modes]): one that exists (a home directory) is used
as it is. Whom it accepts is checked at each connection: its own uid and ``allowed_uids``
(SO_PEERCRED again). Of those, only its own uid and root administer it (:func:`administers`):
STOP from any other is refused with EPERM, and STATS shows any other only its own sessions,
without the recent errors (they name other clients' pids and identities; its own errors come
back to it in the replies). The metrics port (``--metrics-port``, on 127.0.0.1) answers every
local user, so it shows no identity, pid or uid: daemon-wide figures, and each session's bytes
under its number alone (offloadd/daemon/metrics.py [what the metrics show]).
"""

from __future__ import annotations

import os
import socket
import stat
import struct
from collections.abc import Collection

__all__ = [
    "administers",
    "open_socket_dir",
    "own_uid",
    "peer_credentials",
    "socket_dir_problem",
]

_UCRED = struct.Struct("3i")


def own_uid() -> int:
    """This process's uid, as a peer sees it (SO_PEERCRED reports the effective uid)."""
    return os.geteuid()


def administers(uid: int) -> bool:
    """Whether a client of ``uid`` may stop the daemon and see every session: the daemon's own
    uid and root (see [who trusts whom])."""
    return uid in (own_uid(), 0)


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end of a Unix socket (for a client: of the
    one that called ``listen()``)."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    pid, uid, gid = _UCRED.unpack(raw)
    return pid, uid, gid


def socket_dir_problem(
    directory: str,
    trusted: Collection[int],
    expected: str,
    st: os.stat_result | None = None,
) -> str | None:
    """Why ``directory`` may not hold a trusted socket, or None (see [who trusts whom]): it must
    be a directory, not a symbolic link, belong to a uid of ``trusted`` (``expected`` says which,
    in words) and not be writable by group or others. ``st``: its status as the caller already
    took it (``fstat`` of a descriptor opened without following a link); else the path itself is
    examined (``lstat``). Raises OSError if it cannot be examined."""
    if st is None:
        st = os.lstat(directory)
    mode = stat.S_IMODE(st.st_mode)
    if stat.S_ISLNK(st.st_mode):
        try:
            target = f" (to {os.readlink(directory)!r})"
        except OSError:
            target = ""
        return (
            f"directory {directory!r} is a symbolic link{target}: whoever made it may point it "
            "anywhere; name the directory itself"
        )
    if not stat.S_ISDIR(st.st_mode):
        return f"{directory!r} is not a directory"
    if st.st_uid not in trusted:
        return f"directory {directory!r} belongs to uid {st.st_uid}, expected {expected}"
    if mode & 0o022:
        return (
            f"directory {directory!r} may be written by group or others (mode {mode:04o}): "
            "whoever can write there can put their own socket in its place; use a directory of "
            "its own"
        )
    return None


def open_socket_dir(
    directory: str, trusted: Collection[int], expected: str
) -> tuple[int, os.stat_result]:
    """A descriptor of ``directory`` opened without following a symbolic link, and its status,
    if it passes :func:`socket_dir_problem`; ValueError saying why not (see [who trusts
    whom])."""
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        try:  # a link, or no directory: say which
            problem = socket_dir_problem(directory, trusted, expected)
        except OSError:
            problem = None
        raise ValueError(problem or f"cannot open directory {directory!r}: {e.strerror}") from None
    try:
        st = os.fstat(fd)
        problem = socket_dir_problem(directory, trusted, expected, st)
    except BaseException:
        os.close(fd)
        raise
    if problem is not None:
        os.close(fd)
        raise ValueError(problem)
    return fd, st
