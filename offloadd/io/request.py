"""What an I/O engine is: the :class:`Request` it takes and the :class:`Engine` protocol.

An engine takes :class:`Request` objects (address, length, file descriptor, offset) and calls
each request's ``callback`` once it is done, failed or was cancelled, from one of its own threads.
Reads are served before writes: reads are on backward's critical path, writes are not.

:class:`~offloadd.io.python_engine.PythonEngine` is the reference implementation; the native
and kvikio engines, and any other, plug in by implementing :class:`Engine`.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from enum import IntEnum
from typing import Any, Protocol

__all__ = [
    "Engine",
    "Op",
    "Request",
    "RequestState",
    "complete",
    "mark_engine_thread",
    "on_engine_thread",
]

log = logging.getLogger("offloadd")

PAGE = 4096  # the size of a head or tail page (the O_DIRECT alignment)

_thread_role = threading.local()


def mark_engine_thread() -> None:
    """Called first by every thread of an engine that runs request callbacks.

    The finalizer of the engine's owner may run on such a thread (a garbage collection there);
    it must then not close the engine from it, since closing joins this very thread (see
    [shutdown] in ``offloadd/runtime/shutdown.py``)."""
    _thread_role.engine = True


def on_engine_thread() -> bool:
    """True on a thread that called :func:`mark_engine_thread`."""
    return getattr(_thread_role, "engine", False)


class Op(IntEnum):
    READ = 0  # sorts first: reads are served before writes
    WRITE = 1


class RequestState(IntEnum):
    PENDING = 0
    RUNNING = 1
    DONE = 2
    CANCELLED = 3


class Request:
    """One contiguous transfer. ``address`` must stay valid until ``callback`` has run.

    A write may take its first and last page from elsewhere: ``head`` (``tail``), if not 0, is
    the address of 4096 bytes written at ``offset`` (at ``offset + nbytes - 4096``) instead of
    those at ``address``. The zero-copy write path writes a tensor's page-aligned interior in
    place and its unaligned ends from bounce pages (see [zero-copy] in runtime/writer.py)."""

    __slots__ = (
        "address",
        "before",
        "callback",
        "context",
        "error",
        "fd",
        "head",
        "keepalive",
        "nbytes",
        "offset",
        "op",
        "path",
        "state",
        "tail",
        "token",
    )

    def __init__(
        self,
        op: Op,
        fd: int,
        path: str,
        offset: int,
        address: int,
        nbytes: int,
        callback: Callable[[Request], None],
        *,
        before: Callable[[], None] | None = None,
        keepalive: Any = None,
        context: Any = None,
        head: int = 0,
        tail: int = 0,
    ) -> None:
        if (head or tail) and (op is not Op.WRITE or nbytes < PAGE * (1 + (tail != 0))):
            raise ValueError(
                "head/tail pages are for writes of at least one page (two with a tail)"
            )
        self.op = op
        self.fd = fd
        self.path = path
        self.offset = offset
        self.address = address
        self.nbytes = nbytes
        self.callback = callback
        self.before = before  # run by the I/O thread first (e.g. wait for a device copy)
        self.state = RequestState.PENDING
        self.error: BaseException | None = None
        self.keepalive = keepalive  # what owns the memory at ``address``
        self.context = context  # the submitter's bookkeeping
        self.token: int | None = None  # the engine's own handle, set when it is queued
        self.head = head
        self.tail = tail

    def segments(self) -> list[tuple[int, int, int]]:
        """``(file offset, address, nbytes)`` of each contiguous piece, in file order."""
        start, end = 0, self.nbytes
        out = []
        if self.head:
            out.append((self.offset, self.head, PAGE))
            start = PAGE
        if self.tail:
            end -= PAGE
        if end > start:
            out.append((self.offset + start, self.address + start, end - start))
        if self.tail:
            out.append((self.offset + end, self.tail, PAGE))
        return out


class Engine(Protocol):
    """``name``; an engine that honours :attr:`Request.head` and :attr:`Request.tail` also has a
    true ``writes_pages`` attribute (the zero-copy write path is used only with such engines)."""

    name: str

    def submit(self, request: Request) -> None: ...

    def cancel(self, request: Request) -> bool:
        """Cancel a request that has not started; True if it will never run (no callback)."""
        ...

    def close(self) -> None:
        """Finish every submitted request, then stop."""
        ...


def complete(request: Request, error: BaseException | None) -> None:
    """Finish ``request``: record the error (an OSError names the request's path) and call back.

    A callback that raises is logged: it must never take an engine's thread down with it."""
    if isinstance(error, OSError) and error.filename is None:
        error = OSError(error.errno, error.strerror, request.path)
    request.error = error
    request.state = RequestState.DONE
    try:
        request.callback(request)
    except BaseException:
        log.exception("offloadd: I/O completion callback failed for %s", request.path)
