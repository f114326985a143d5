"""One client connection of the daemon: a non-blocking socket read and written from the loop.

See offloadd/daemon/core.py [never blocked by a client]: a send never blocks; what the socket
does not take is kept, up to ``MAX_OUTBUF`` bytes, and sent when it becomes writable.
"""

from __future__ import annotations

import array
import contextlib
import os
import socket
from collections import deque
from typing import TYPE_CHECKING

from offloadd.daemon import protocol as proto
from offloadd.daemon.session import Session

if TYPE_CHECKING:
    from offloadd.daemon.core import Server

__all__ = ["MAX_FDS", "MAX_OUTBUF", "Connection", "close_all", "fds_of"]

MAX_OUTBUF = 4 << 20  # replies buffered for a client that does not read, before dropping it
MAX_FDS = 16  # descriptors accepted with one message (only OPEN may carry one)


class Connection:
    """One client connection: a non-blocking socket read and written from the loop."""

    def __init__(self, server: Server, sock: socket.socket, uid: int, pid: int) -> None:
        self.server = server
        self.sock = sock
        self.uid = uid
        self.pid = pid
        self.identity = ""
        self.inbuf = bytearray()
        self.out: deque[tuple[bytes, list[int]]] = deque()
        self.out_bytes = 0
        self.writing = False
        self.hello = False
        self.session: Session | None = None
        self.closed = False

    def send(self, data: bytes, fds: list[int] | None = None) -> None:
        if self.closed:
            return
        self.out.append((data, fds or []))
        self.out_bytes += len(data)
        if self.out_bytes > MAX_OUTBUF:
            self.server.drop(self, f"{self.out_bytes} bytes of replies not read; dropping")
            return
        self.flush()

    def reply(self, r: proto.Reply) -> None:
        self.send(proto.encode_reply(r))

    def flush(self) -> None:
        while self.out and not self.closed:
            data, fds = self.out[0]
            try:
                if fds:
                    anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))]
                    n = self.sock.sendmsg([data], anc)
                else:
                    n = self.sock.send(data)
            except (BlockingIOError, InterruptedError):
                n = 0
            except OSError as e:
                self.server.drop(self, f"send failed: {e}")
                return
            if n == 0:
                break
            self.out_bytes -= n
            if n < len(data):
                self.out[0] = (data[n:], [])  # descriptors went with the first byte
                break
            self.out.popleft()
        want = bool(self.out) and not self.closed
        if want != self.writing:
            loop = self.server.loop
            if want:
                loop.add_writer(self.sock.fileno(), self.flush)
            else:
                loop.remove_writer(self.sock.fileno())
            self.writing = want


def fds_of(anc: list[tuple[int, int, bytes]]) -> list[int]:
    fds: list[int] = []
    for level, kind, data in anc:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            a = array.array("i")
            a.frombytes(data[: len(data) - len(data) % a.itemsize])
            fds.extend(a)
    return fds


def close_all(fds: list[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)
    fds.clear()
