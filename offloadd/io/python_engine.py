"""The reference I/O engine: a pool of threads doing ``os.pwrite`` / ``os.preadv``.

The system calls release the GIL. Every other engine (native, kvikio) falls back to this one.
"""

from __future__ import annotations

import errno
import itertools
import os
import queue
import threading
import time

from offloadd.io.buffers import address_view
from offloadd.io.request import Op, Request, RequestState, complete, mark_engine_thread

__all__ = ["PythonEngine", "transfer"]


def transfer(request: Request) -> None:
    """Do ``request`` with positional system calls, looping over short transfers."""
    if request.head or request.tail:
        for offset, address, nbytes in request.segments():
            _transfer(request, offset, address, nbytes)
    else:
        _transfer(request, request.offset, request.address, request.nbytes)


def _transfer(request: Request, offset: int, address: int, nbytes: int) -> None:
    view = address_view(address, nbytes)
    done = 0
    while done < nbytes:
        part = view[done:]
        if request.op is Op.WRITE:
            n = os.pwrite(request.fd, part, offset + done)
        else:
            n = os.preadv(request.fd, [part], offset + done)
        if n <= 0:
            what = "write" if request.op is Op.WRITE else "read"
            raise OSError(
                errno.EIO,
                f"short {what}: {done} of {nbytes} bytes at offset {offset}",
                request.path,
            )
        done += n


class PythonEngine:
    """Thread pool doing pread/pwrite; the reference engine and the fallback of every other."""

    name = "python"
    writes_pages = True  # honours Request.head / Request.tail

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
