"""The daemon client's link to ``offloadd serve``: the handshake, the session's shared memory,
and the records of one connection (a *generation*: replaced after each reconnect).

``offloadd status`` and ``offloadd stop`` use :func:`connect_control` and :func:`recv_frame`
too.
"""

from __future__ import annotations

import array
import errno
import json
import os
import queue
import socket
import sys
import threading
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any

import psutil

from offloadd.backend.daemon_slots import DaemonProcess
from offloadd.io.buffers import AlignedBuffer, SlotPool
from offloadd.io.request import Request
from offloadd.wire import protocol as proto
from offloadd.wire.address import no_daemon
from offloadd.wire.trust import own_uid, peer_credentials, socket_dir_problem

__all__ = [
    "DaemonError",
    "Generation",
    "Placed",
    "StagingPool",
    "connect_control",
    "identity",
    "open_session",
    "peer_state",
    "query",
    "recv_frame",
]

# What connecting says where no daemon is: no such path, a directory missing, a socket file
# nothing listens on (a killed daemon's), something else at the path.
_ABSENT = frozenset({errno.ENOENT, errno.ENOTDIR, errno.ECONNREFUSED, errno.ENOTSOCK})

_CONNECT_TIMEOUT_S = 5.0
_MAX_FDS = 16


class DaemonError(ConnectionError):
    """The daemon could not be reached or refused the session."""


def identity() -> str:
    rank = os.environ.get("RANK")
    prog = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "python"
    ident = f"{prog} pid {os.getpid()}" + (f" rank {rank}" if rank is not None else "")
    return "".join(c for c in ident if c.isprintable())[: proto.MAX_IDENTITY // 4]


def recv_frame(sock: socket.socket, buf: bytearray, fds: list[int] | None = None) -> bytes:
    """Block until one complete reply frame is in ``buf``; collect passed descriptors."""
    while True:
        frames = proto.split_frames(buf, proto.MAX_REPLY) if buf else []
        if frames:
            if len(frames) > 1:  # never happens in the handshake: one request, one reply
                raise proto.ProtocolError("unexpected extra reply in the handshake")
            return frames[0]
        data, anc, _flags, _ = sock.recvmsg(
            65536, socket.CMSG_SPACE(_MAX_FDS * array.array("i").itemsize)
        )
        for level, kind, raw in anc:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                a = array.array("i")
                a.frombytes(raw[: len(raw) - len(raw) % a.itemsize])
                if fds is None:
                    for fd in a:
                        os.close(fd)
                else:
                    fds.extend(a)
        if not data:
            raise DaemonError("the daemon closed the connection")
        buf += data


def peer_state(sock: socket.socket) -> str:
    """``pid N, <state>`` of the process at the other end of a Unix socket (its credentials,
    SO_PEERCRED; the state as psutil reads it: running, sleeping, stopped...), or why not."""
    try:
        pid = peer_credentials(sock)[0]
        return f"pid {pid}, {psutil.Process(pid).status()}"
    except (OSError, AttributeError, psutil.Error) as e:  # no SO_PEERCRED off Linux; gone
        return f"its process not known: {e}"


def connect_control(
    path: str,
    timeout: float = _CONNECT_TIMEOUT_S,
    *,
    trusted_uids: Collection[int] | None = None,
) -> socket.socket:
    """A connection past the handshake (for ``offloadd status`` / ``stop`` and tests), to a
    daemon this process trusts, checked before a byte is sent (see offloadd/wire/trust.py
    [who trusts whom]). ``trusted_uids``: ``daemon.trusted_uids``; None: as the environment
    sets it (``OFFLOADD_DAEMON_TRUSTED_UIDS``)."""
    extra = _environment_trusted_uids() if trusted_uids is None else tuple(trusted_uids)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        try:
            _check_socket_dir(path, extra)
            sock.connect(path)
        except OSError as e:  # one line, and the daemon named as absent only where it is
            why = e.strerror or str(e)
            if e.filename is not None and e.filename != path:
                why += f": {e.filename!r}"
            if e.errno not in _ABSENT:  # denied, a full backlog, a timeout: one listens there
                raise DaemonError(f"daemon.socket: cannot connect to {path!r} ({why})") from None
            raise DaemonError(f"daemon.socket: {no_daemon(path, why)}") from None
        _check_peer(sock, path, extra)
        sock.sendall(proto.encode_hello(os.getpid(), identity()))
        r = proto.decode_reply(recv_frame(sock, bytearray()))
    except DaemonError:
        sock.close()
        raise
    except (OSError, proto.ProtocolError) as e:
        sock.close()
        raise DaemonError(f"daemon at {path!r} did not answer the handshake: {e}") from e
    if r.status:
        sock.close()
        raise DaemonError(
            f"daemon at {path!r} refused the handshake: {r.tail.decode(errors='replace')}"
        )
    return sock


def _environment_trusted_uids() -> tuple[int, ...]:
    from offloadd.config import load_daemon

    try:
        return load_daemon().trusted_uids
    except ValueError as e:
        raise DaemonError(str(e)) from None


def _expected(extra: tuple[int, ...]) -> str:
    """The uids a client trusts, in words (see [who trusts whom])."""
    listed = ", ".join(str(u) for u in extra) or "none set"
    return f"uid {own_uid()} (this process's), root, or one of daemon.trusted_uids ({listed})"


def _check_socket_dir(path: str, extra: tuple[int, ...]) -> None:
    """The socket's directory must be a trusted uid's and writable by it alone; OSError if it
    cannot be examined (no such directory: no daemon there)."""
    directory = os.path.dirname(path) or "."
    problem = socket_dir_problem(directory, {own_uid(), 0, *extra}, _expected(extra))
    if problem is not None:
        raise DaemonError(f"daemon.socket {path!r}: not connecting: the socket's {problem}")


def _check_peer(sock: socket.socket, path: str, extra: tuple[int, ...]) -> None:
    """The process listening at the socket must run as a trusted uid (SO_PEERCRED)."""
    pid, uid, _gid = peer_credentials(sock)
    if uid not in (own_uid(), 0, *extra):
        raise DaemonError(
            f"daemon.socket {path!r}: refusing the process listening there (pid {pid}): it "
            f"runs as uid {uid}, expected {_expected(extra)}; nothing was sent to it"
        )


def query(
    path: str, kind: proto.Msg = proto.Msg.STATS, *, trusted_uids: Collection[int] | None = None
) -> proto.Reply:
    """Send one STATS or STOP request to the daemon at ``path``; return its reply.
    ``trusted_uids``: as :func:`connect_control` takes them."""
    sock = connect_control(path, trusted_uids=trusted_uids)
    try:
        sock.sendall(proto.encode_request(proto.Command(kind, 1)))
        return proto.decode_reply(recv_frame(sock, bytearray()))
    except (OSError, proto.ProtocolError) as e:
        raise DaemonError(f"daemon at {path!r} did not answer: {e}") from e
    finally:
        sock.close()


class StagingPool(SlotPool):
    """The staging slots: the first ``nbytes`` of the shared memory."""

    def __init__(self, buffer: AlignedBuffer, nbytes: int, slot_bytes: int) -> None:
        self.slot_bytes = slot_bytes
        self.num_slots = nbytes // slot_bytes
        self.buffer = buffer
        self.mapped_bytes = buffer.nbytes  # the whole shared memory: read slots too
        self._free = list(range(self.num_slots - 1, -1, -1))

    def close(self) -> None:
        self.buffer.close()


@dataclass(slots=True, eq=False)
class Generation:
    """One connection to a daemon (one session); replaced after a reconnect."""

    sock: socket.socket
    session: int
    file_fds: list[int]
    file_dirs: list[str]
    checksum: Callable[[memoryview], int] | None
    sendq: queue.SimpleQueue[Any] = field(default_factory=queue.SimpleQueue)
    pending: dict[int, tuple[Request, int]] = field(default_factory=dict)  # id -> (req, slot)
    live: int = 0  # blocks written and not freed
    dead: bool = False
    closed_event: threading.Event = field(default_factory=threading.Event)
    threads: list[threading.Thread] = field(default_factory=list)
    # This backend's count of its connections. Not the session id, which a restarted daemon
    # hands out again from 1: a warning keyed on it would be swallowed as already given.
    number: int = 0
    daemon: DaemonProcess | None = None  # its process (see [read slots after a loss])
    retired: bool = False  # lost, and its socket closed (see [daemon loss])


@dataclass(slots=True)
class Placed:
    """Where the daemon put one chunk."""

    gen: Generation
    block: int
    file: int
    offset: int
    checksum: int


def open_session(
    path: str,
    chunk_bytes: int,
    staging_bytes: int,
    read_bytes: int,
    buffer: AlignedBuffer | None,
    trusted_uids: Collection[int],
) -> tuple[socket.socket, dict[str, Any], list[int], AlignedBuffer]:
    """Open a session: (socket, the daemon's session info, its files' descriptors, the shared
    memory). ``buffer``: the shared memory of an earlier session, offered again after a
    reconnect (None: the daemon creates it). ``trusted_uids``: the configuration's
    ``daemon.trusted_uids`` (see [who trusts whom] in offloadd/wire/trust.py)."""
    sock = connect_control(path, trusted_uids=trusted_uids)
    fds: list[int] = []
    try:
        attach = buffer is not None
        msg = proto.encode_open(0, chunk_bytes, staging_bytes, read_bytes, attach)
        if buffer is not None:
            anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [buffer.fd]))]
            sock.sendmsg([msg], anc)
        else:
            sock.sendall(msg)
        r = proto.decode_reply(recv_frame(sock, bytearray(), fds))
        if r.status:
            raise DaemonError(
                f"daemon at {path!r} refused the session: "
                f"{os.strerror(r.status)}: {r.tail.decode(errors='replace')}"
            )
        info = json.loads(r.tail)
        nfiles = len(info["files"])
        if len(fds) != 1 + nfiles or info["shm_bytes"] != staging_bytes + read_bytes:
            raise DaemonError("daemon sent a session that does not match the request")
        shm_fd = fds.pop(0)
        if buffer is not None:
            os.close(shm_fd)  # the daemon's copy of our own memfd
        else:
            buffer = AlignedBuffer(info["shm_bytes"], fd=shm_fd)
    except BaseException as e:
        for fd in fds:
            os.close(fd)
        sock.close()
        if isinstance(e, OSError | proto.ProtocolError | ValueError | KeyError):
            raise DaemonError(f"daemon.socket {path!r}: {e}") from e
        raise
    return sock, info, fds, buffer
