"""The one interface the runtime talks to about where chunks go: :class:`Backend`.

Two implementations: :class:`~offloadd.backend.embedded.EmbeddedBackend` (offload files and an
I/O engine inside the training process, the default) and
:class:`~offloadd.backend.daemon.DaemonBackend` (the node's ``offloadd serve``, over a Unix
socket). The runtime (slots, chunks, prefetch, forwarding, fallbacks) is the same for both.

A chunk's place is a ``(file, offset)`` pair that the backend hands out and takes back; the
runtime moves a chunk's bytes between a slot of the backend's :meth:`~Backend.staging` pool (or
its own host pool) and that place with a :class:`~offloadd.io.request.Request` naming the file's
:meth:`~Backend.target`, given to :meth:`~Backend.submit`.
"""

from __future__ import annotations

from typing import Protocol

from offloadd.io.buffers import SlotPool
from offloadd.io.request import Request

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

    @property
    def writes_pages(self) -> bool:
        """Whether host writes may name head and tail pages (:class:`~offloadd.io.request.Request`):
        then CPU tensors are written in place, without staging (zero-copy)."""
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

    def target(self, file: int) -> tuple[int, str]:
        """The descriptor and the path (for messages) that requests on ``file`` name."""
        ...

    def submit(self, request: Request, *, direct: bool = False) -> None:
        """Start ``request`` (its callback runs on one of the backend's threads).

        ``request.before`` runs on the I/O thread first (e.g. waits for the copy that fills the
        slot); ``direct``: its address is device memory, moved with GPUDirect Storage."""
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

    def stall_hint(self) -> str:
        """Who does the I/O and what state it is in, for the warning about a long wait (a
        stopped daemon, a hung disk: see ``StallWatch`` in runtime/stall_watch.py)."""
        ...

    def close(self) -> None:
        """Finish the requests in flight and stop the threads (idempotent, bounded)."""
        ...

    def release(self) -> None:
        """Release files and memory, after :meth:`close` (idempotent)."""
        ...
