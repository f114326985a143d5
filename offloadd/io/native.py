"""The native I/O engine (csrc/io_native/) behind the :class:`~offloadd.io.request.Engine` protocol.

The C side moves the bytes: a pthread pool doing ``pread``/``pwrite``, or one thread driving an
io_uring ring, splitting each request into chunks that run concurrently, never touching the GIL.
It reports finished requests through an eventfd. This wrapper adds what needs Python:

* a *dispatcher* thread that waits on that eventfd with the GIL released and runs the requests'
  callbacks (one GIL acquisition per finished request, not one per system call as in
  :class:`~offloadd.io.request.PythonEngine`);
* a *gate* thread for requests with a ``before`` hook (e.g. wait for a CUDA copy's event), which
  runs the hook and then hands the request to the C side;
* native errno values turned into ``OSError(errno, strerror, path)``.

Faults never end the process. A failed allocation fails the request that needed it
(``OSError(ENOMEM)``), or ``NativeEngine()`` itself with ``MemoryError``; if handing completions
to Python fails, they wait for the next try. If the io_uring ring fails (``io_uring_enter``
returns an error other than a transient one), the engine moves to its thread backend for good:
queued requests go to the thread pool, those in the ring still finish, :attr:`backend` reads
``"threads"``, :attr:`fallback` says why, and the dispatcher logs it once at WARNING.

The extension is optional: :func:`available` says whether it was built and imports, and why not.
"""

from __future__ import annotations

import itertools
import logging
import os
import queue
import threading
import time
from typing import Any

from offloadd.io.request import Request, RequestState, complete, mark_engine_thread

__all__ = ["NativeEngine", "available", "uring_available"]

log = logging.getLogger("offloadd")

_SENTINEL = 0  # token of the empty request that wakes the dispatcher at close()


def _load() -> tuple[Any, str]:
    try:
        from offloadd.io import _native
    except ImportError as e:
        return None, (
            f"the native extension offloadd.io._native is not built or does not load ({e}); "
            "build it by reinstalling offloadd (docs/native.md)"
        )
    return _native, "ok"


def available() -> tuple[bool, str]:
    """(True, "ok") if the native extension imports, else (False, why)."""
    mod, why = _load()
    return mod is not None, why


def uring_available() -> tuple[bool, str]:
    """(True, why) if io_uring was compiled in and ``io_uring_setup`` works in this process."""
    mod, why = _load()
    if mod is None:
        return False, why
    ok, reason = mod.probe_uring()
    return bool(ok), str(reason)


class NativeEngine:
    """Engine backed by offloadd.io._native. ``backend`` is "threads", "uring" or "auto"."""

    name = "native"
    writes_pages = True  # honours Request.head / Request.tail

    def __init__(
        self,
        num_threads: int = 4,
        *,
        chunk_bytes: int = 1 << 20,
        backend: str = "auto",
        depth: int = 32,
    ) -> None:
        mod, why = _load()
        if mod is None:
            raise ImportError(why)
        if backend not in ("auto", "threads", "uring"):
            raise ValueError(f"backend must be 'auto', 'threads' or 'uring', got {backend!r}")
        if backend == "auto":
            ok, reason = mod.probe_uring()
            backend = "uring" if ok else "threads"
            if not ok:
                log.info("offloadd: io_uring unavailable (%s); native engine uses threads", reason)
        self._native = mod.Engine(
            threads=num_threads, chunk_bytes=chunk_bytes, backend=backend, depth=depth
        )
        self._watch_fallback = self._native.backend == "uring"  # not yet logged
        self._lock = threading.Lock()
        self._tokens = itertools.count(_SENTINEL + 1)
        self._pending: dict[int, Request] = {}  # token -> request handed to the C side
        self._closing = False  # no new submissions
        self._drained = False  # and the gate is empty: the dispatcher may leave when idle
        self._closed = False
        self._gate: queue.SimpleQueue[tuple[Request, BaseException | None] | None] = (
            queue.SimpleQueue()
        )
        self._gate_thread: threading.Thread | None = None
        self._dispatcher = threading.Thread(
            target=self._dispatch, name="offloadd-native-completions", daemon=True
        )
        self._dispatcher.start()

    @property
    def backend(self) -> str:
        """'uring' or 'threads'; 'threads' for good once the io_uring ring has failed."""
        return str(self._native.backend)

    @property
    def fallback(self) -> str | None:
        """None, or why the io_uring backend moved to threads (io_uring_enter's error)."""
        why = self._native.fallback
        return None if why is None else str(why)

    # -- Engine protocol -------------------------------------------------------------------

    def submit(self, request: Request) -> None:
        if self._closing:
            raise RuntimeError("offloadd: I/O engine is closed")
        if request.before is not None:
            self._gate_put(request, None)
            return
        self._hand_over(request)

    def cancel(self, request: Request) -> bool:
        with self._lock:
            if request.state is not RequestState.PENDING:
                return False
            token = request.token
            if token is None:  # still at the gate: the gate thread will skip it
                request.state = RequestState.CANCELLED
                return True
            if self._native.cancel(token):
                del self._pending[token]
                request.state = RequestState.CANCELLED
                return True
            return False

    def close(self) -> None:
        if self._closed:
            return
        self._closing = True
        if self._gate_thread is not None:
            self._gate.put(None)
            self._gate_thread.join()
        with self._lock:
            self._drained = True
        # Wake the dispatcher with an empty request; it leaves once nothing is pending.
        self._native.submit(_SENTINEL, 0, self._native.fileno(), 0, 0, 0)
        self._dispatcher.join()
        self._native.close()
        self._closed = True

    # -- internals -------------------------------------------------------------------------

    def _hand_over(self, request: Request, *, from_gate: bool = False) -> None:
        token = next(self._tokens)
        with self._lock:
            if request.state is RequestState.CANCELLED:
                return
            self._pending[token] = request
            request.token = token
        try:
            self._native.submit(
                token,
                int(request.op),
                request.fd,
                request.offset,
                request.address,
                request.nbytes,
                request.head,
                request.tail,
            )
        except BaseException as e:  # refused before any I/O: deliver it like any other failure
            with self._lock:
                self._pending.pop(token, None)
            if isinstance(e, RuntimeError) and not from_gate:
                raise  # the engine is closed: the caller's mistake, not an I/O failure
            if from_gate:  # already on the gate thread, which may be draining for close()
                complete(request, e)
            else:
                self._gate_put(request, e)

    def _gate_put(self, request: Request, error: BaseException | None) -> None:
        with self._lock:
            if self._gate_thread is None:
                self._gate_thread = threading.Thread(
                    target=self._run_gate, name="offloadd-native-gate", daemon=True
                )
                self._gate_thread.start()
        self._gate.put((request, error))

    def _run_gate(self) -> None:
        mark_engine_thread()
        while True:
            item = self._gate.get()
            if item is None:
                return
            self._pass_gate(*item)
            # Not kept while waiting for the next one (see PythonEngine._work).
            del item

    def _pass_gate(self, request: Request, error: BaseException | None) -> None:
        """Run a request's ``before`` hook, then hand it to the C side (or fail it)."""
        if error is None:
            with self._lock:  # from here on cancel() says no, as for a started request
                if request.state is not RequestState.PENDING:
                    return
                request.state = RequestState.RUNNING
            try:
                assert request.before is not None
                request.before()
            except BaseException as e:
                error = e
            else:
                request.before = None
                self._hand_over(request, from_gate=True)
                return
        complete(request, error)

    def _dispatch(self) -> None:
        mark_engine_thread()
        while True:
            try:
                finished = self._native.reap()
            except (OSError, MemoryError):
                # Never lose the dispatcher: every later callback would be lost. On MemoryError
                # the completions stay with the C side, for the next reap().
                log.exception("offloadd: waiting for native completions failed; retrying")
                time.sleep(0.01)
                continue
            for token, err, _done in finished:
                if token == _SENTINEL:
                    continue
                with self._lock:
                    request = self._pending.pop(token)
                error = OSError(err, os.strerror(err), request.path) if err else None
                complete(request, error)
                del request, error  # not kept alive while waiting (see PythonEngine._work)
            del finished
            if self._watch_fallback and self._native.fallback is not None:
                self._watch_fallback = False
                log.warning(
                    "offloadd: the native engine's io_uring ring failed (%s); it now uses its "
                    "'threads' backend for good (requests in flight still complete)",
                    self._native.fallback,
                )
            with self._lock:
                if self._drained and not self._pending:
                    return
