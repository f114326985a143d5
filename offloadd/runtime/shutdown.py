"""An Offloader's last act: its backend and pools released, once nothing can still use them."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable

from offloadd.backend import Backend
from offloadd.io.pools import Pool
from offloadd.io.request import on_engine_thread
from offloadd.runtime import host_allocator
from offloadd.runtime.ordering import Ordering

__all__ = ["moved_off_engine_thread", "shutdown"]


def moved_off_engine_thread(fn: Callable[..., object], *args: object, name: str) -> bool:
    """On an I/O engine's thread (a collection there), start ``fn(*args)`` on a fresh thread
    and return True: closing an engine from its own thread would join that very thread. False
    elsewhere (the caller goes on)."""
    if not on_engine_thread():
        return False
    with contextlib.suppress(RuntimeError):  # no new thread at interpreter exit
        threading.Thread(target=fn, args=args, name=name, daemon=False).start()
    return True


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
    args = (backend, pools, ordering, host_cache)
    if moved_off_engine_thread(shutdown, *args, name="offloadd-shutdown"):
        return
    ordering.synchronize_all()
    if backend is not None:
        backend.close()
        backend.release()
    for pool in pools:
        pool.close()
    if host_cache:
        host_allocator.release()
