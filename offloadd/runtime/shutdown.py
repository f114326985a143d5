"""An Offloader's last act: its backend and pools released, once nothing can still use them."""

from __future__ import annotations

import contextlib
import threading

from offloadd.backend import Backend
from offloadd.io.pools import Pool
from offloadd.io.request import on_engine_thread
from offloadd.runtime import host_allocator
from offloadd.runtime.ordering import Ordering

__all__ = ["shutdown"]


def shutdown(
    backend: Backend | None, pools: list[Pool], ordering: Ordering, host_cache: bool
) -> None:
    """Release the backend and the pools (close(), collection, or interpreter exit).

    Note: [shutdown] Requests hold the write and read paths, never the Offloader, so an
    unclosed one is collected once its graphs are gone, writes in flight or not; closing
    the backend waits for those writes, and the pools are freed only after them and after
    every copy stream has drained (see [device ordering] in ordering.py). A collection can
    still run on an I/O thread (a garbage-collector pass there); closing the backend from it
    would join the very thread doing it, so the shutdown then moves to a fresh thread."""
    if on_engine_thread():
        args = (backend, pools, ordering, host_cache)
        with contextlib.suppress(RuntimeError):  # no new thread at interpreter exit
            threading.Thread(
                target=shutdown, args=args, name="offloadd-shutdown", daemon=False
            ).start()
        return
    ordering.synchronize_all()
    if backend is not None:
        backend.close()
        backend.release()
    for pool in pools:
        pool.close()
    if host_cache:
        host_allocator.release()
