"""I/O engines: they move bytes between aligned host memory and offload files.

An engine takes :class:`Request` objects (address, length, file descriptor, offset) and calls
each request's ``callback`` once it is done, failed or was cancelled, from one of its own threads.
Reads are served before writes: reads are on backward's critical path, writes are not.

:class:`PythonEngine` is the reference implementation: a pool of threads doing ``os.pwrite`` /
``os.preadv``, which release the GIL during the system call. Other engines (native, kvikio) plug in
by implementing :class:`Engine`.
"""

from __future__ import annotations

import errno
import itertools
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from enum import IntEnum
from typing import Any, Protocol

from offloadd.staging import address_view

__all__ = [
    "Engine",
    "Op",
    "PythonEngine",
    "Request",
    "RequestState",
    "complete",
    "mark_engine_thread",
    "on_engine_thread",
    "transfer",
]

log = logging.getLogger("offloadd")

_thread_role = threading.local()


def mark_engine_thread() -> None:
    """Called first by every thread of an engine that runs request callbacks.

    Such a thread may drop the last reference to the owner of its engine (a callback holds the
    Offloader); the owner's finalizer must then not close the engine from there, since closing
    joins this very thread (see ``Offloader._shutdown``)."""
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
    """One contiguous transfer. ``address`` must stay valid until ``callback`` has run."""

    __slots__ = (
        "address",
        "before",
        "callback",
        "context",
        "error",
        "fd",
        "keepalive",
        "nbytes",
        "offset",
        "op",
        "path",
        "state",
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
    ) -> None:
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


class Engine(Protocol):
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


def transfer(request: Request) -> None:
    """Do ``request`` with positional system calls, looping over short transfers."""
    view = address_view(request.address, request.nbytes)
    done = 0
    while done < request.nbytes:
        part = view[done:]
        if request.op is Op.WRITE:
            n = os.pwrite(request.fd, part, request.offset + done)
        else:
            n = os.preadv(request.fd, [part], request.offset + done)
        if n <= 0:
            what = "write" if request.op is Op.WRITE else "read"
            raise OSError(
                errno.EIO,
                f"short {what}: {done} of {request.nbytes} bytes at offset {request.offset}",
                request.path,
            )
        done += n


class PythonEngine:
    """Thread pool doing pread/pwrite; the reference engine and the fallback of every other."""

    name = "python"

    def __init__(self, num_threads: int = 4) -> None:
        self._queue: queue.PriorityQueue[tuple[int, int, Request | None]] = queue.PriorityQueue()
        self._seq = itertools.count()
        self._lock = threading.Lock()
        self._closed = False
        self._threads = [
            threading.Thread(target=self._work, name=f"offloadd-io-{i}", daemon=True)
            for i in range(num_threads)
        ]
        for t in self._threads:
            t.start()

    def submit(self, request: Request) -> None:
        if self._closed:
            raise RuntimeError("offloadd: I/O engine is closed")
        self._queue.put((int(request.op), next(self._seq), request))

    def cancel(self, request: Request) -> bool:
        with self._lock:
            if request.state is RequestState.PENDING:
                request.state = RequestState.CANCELLED
                return True
            return False

    def close(self) -> None:
        self.close_within(None)

    def close_within(self, timeout: float | None) -> bool:
        """``close()``, waiting ``timeout`` seconds at most (None: for ever). False if a thread
        is still in a transfer (stuck on its disk) when the time ran out."""
        if not self._closed:
            self._closed = True
            for _ in self._threads:
                self._queue.put((99, next(self._seq), None))
        until = None if timeout is None else time.monotonic() + timeout
        for t in self._threads:
            t.join(None if until is None else max(0.0, until - time.monotonic()))
        return not any(t.is_alive() for t in self._threads)

    def transfer(self, request: Request) -> None:
        """Move the bytes of one request (subclasses replace this, e.g. with GDS)."""
        transfer(request)

    def _work(self) -> None:
        mark_engine_thread()
        while True:
            _, _, request = self._queue.get()
            if request is None:
                return
            with self._lock:
                if request.state is not RequestState.PENDING:
                    del request  # cancelled: not kept alive while this thread waits
                    continue
                request.state = RequestState.RUNNING
            error: BaseException | None = None
            try:
                if request.before is not None:
                    request.before()
                self.transfer(request)
            except BaseException as e:  # delivered to the submitter, never lost
                error = e
            complete(request, error)
            # The idle thread must not keep the last request (and, through its callback, its
            # submitter) alive: an unclosed Offloader is then collected and its files closed.
            del request, error
