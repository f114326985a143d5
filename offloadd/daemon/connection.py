"""One client connection of the daemon: a non-blocking socket read and written from the loop.

See offloadd/daemon/core.py [never blocked by a client]: a send never blocks; what the socket
does not take is kept, up to ``MAX_OUTBUF`` bytes, and sent when it becomes writable.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import os
import socket
from collections import deque
from collections.abc import Callable

from offloadd.daemon.session import Session
from offloadd.wire import protocol as proto

__all__ = ["MAX_FDS", "MAX_OUTBUF", "Connection", "close_all", "fds_of"]

MAX_OUTBUF = 4 << 20  # replies buffered for a client that does not read, before dropping it
MAX_FDS = 16  # descriptors accepted with one message (only OPEN may carry one)


class Connection:
    """One client connection: a non-blocking socket read and written from the loop."""

    def __init__(
        self,
        sock: socket.socket,
        uid: int,
        pid: int,
        *,
        loop: asyncio.AbstractEventLoop,
        drop: Callable[[Connection, str], None],
    ) -> None:
        """``loop``: the daemon's event loop (it writes when the socket is writable); ``drop``:
        how the daemon closes a connection and ends its session, with the reason."""
        self.sock = sock
        self.loop = loop
        self.drop = drop
        self.uid = uid
        self.pid = pid
        self.identity = ""
        self.inbuf = bytearray()
        # (bytes, descriptors to pass with them, those of them to close once sent)
        self.out: deque[tuple[bytes, list[int], list[int]]] = deque()
        self.out_bytes = 0
        self.writing = False
        self.hello = False
        self.session: Session | None = None
        self.closed = False

    def send(
        self, data: bytes, fds: list[int] | None = None, *, then_close: list[int] | None = None
    ) -> None:
        """Send ``data`` with ``fds`` (SCM_RIGHTS). ``then_close``: those of ``fds`` opened for
        this message alone, closed once sent, or when the connection is dropped."""
        if self.closed:
            close_all(list(then_close or []))
            return
        self.out.append((data, fds or [], list(then_close or [])))
        self.out_bytes += len(data)
        if self.out_bytes > MAX_OUTBUF:
            self.drop(self, f"{self.out_bytes} bytes of replies not read; dropping")
            return
        self.flush()

    def reply(self, r: proto.Reply) -> None:
        self.send(proto.encode_reply(r))

    def flush(self) -> None:
        while self.out and not self.closed:
            data, fds, then_close = self.out[0]
            try:
                if fds:
                    anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))]
                    n = self.sock.sendmsg([data], anc)
                else:
                    n = self.sock.send(data)
            except (BlockingIOError, InterruptedError):
                n = 0
            except OSError as e:
                self.drop(self, f"send failed: {e}")
                return
            if n == 0:
                break
            self.out_bytes -= n
            close_all(then_close)  # went with the first byte: the receiver has its copies
            if n < len(data):
                self.out[0] = (data[n:], [], [])  # descriptors went with the first byte
                break
            self.out.popleft()
        want = bool(self.out) and not self.closed
        if want != self.writing:
            loop = self.loop
            if want:
                loop.add_writer(self.sock.fileno(), self.flush)
            else:
                loop.remove_writer(self.sock.fileno())
            self.writing = want

    def discard(self) -> None:
        """The connection is dropped: forget what was not sent, closing descriptors of ours."""
        for _data, _fds, then_close in self.out:
            close_all(then_close)
        self.out.clear()
        self.out_bytes = 0


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
