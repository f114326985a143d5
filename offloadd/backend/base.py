"""The one interface the runtime talks to about where chunks go: :class:`Backend`.

Two implementations: :class:`~offloadd.backend.embedded.EmbeddedBackend` (offload files and an
I/O engine inside the training process, the default) and
:class:`~offloadd.backend.daemon.DaemonBackend` (the node's ``offloadd serve``, over a Unix
socket). The runtime (slots, chunks, prefetch, forwarding, fallbacks) is the same for both.

A chunk's place is a ``(file, offset)`` pair that the backend hands out and takes back; the
runtime moves a chunk's bytes between a slot of the backend's :meth:`~Backend.staging` pool (or
its own host pool) and that place with :meth:`~Backend.submit`, whose callback runs on one of the
backend's threads.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from offloadd.io.buffers import SlotPool
from offloadd.io.request import Op, Request

__all__ = ["Backend"]


class Backend(Protocol):
    """Where chunks are written to and read back from."""

    @property
    def name(self) -> str:
        """What does the I/O, for the stats (``native/uring``, ``python``, ``daemon``, ...)."""
        ...

    @property
    def buffered(self) -> bool:
        """Whether some offload file refused O_DIRECT (buffered I/O: the page cache holds it)."""
        ...

    @property
    def used_bytes(self) -> int:
        """Bytes of offload space held by chunks now."""
        ...

    def staging(self) -> SlotPool:
        """The staging pool that writes of host copies go through (created on first call)."""
        ...

    def place(self, hint: int) -> tuple[int, int]:
        """A free place ``(file, offset)`` for one chunk; ``hint`` spreads chunks over files."""
        ...

    def free(self, file: int, offset: int) -> None:
        """Give back a place (runtime lock held; never blocks)."""
        ...

    def submit(
        self,
        op: Op,
        file: int,
        offset: int,
        address: int,
        nbytes: int,
        callback: Callable[[Request], None],
        *,
        before: Callable[[], None] | None = None,
        keepalive: Any = None,
        context: Any = None,
        direct: bool = False,
    ) -> Request:
        """Start moving ``nbytes`` at ``address`` to (WRITE) or from (READ) a place.

        ``before`` runs on the I/O thread first (e.g. waits for the copy that fills the slot);
        ``direct``: ``address`` is device memory, moved with GPUDirect Storage."""
        ...

    def cancel(self, request: Request) -> bool:
        """Cancel a request that has not started; False if it is running or done."""
        ...

    def open_direct(self) -> bool:
        """Whether device memory can be written and read directly (GDS), probed once."""
        ...

    def begin_step(self) -> None:
        """Called at each ``with offloader:`` (the daemon client reconnects after a loss)."""
        ...

    def close(self) -> None:
        """Finish the requests in flight and stop the threads (idempotent, bounded)."""
        ...

    def release(self) -> None:
        """Release files and memory, after :meth:`close` (idempotent)."""
        ...
