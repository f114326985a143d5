"""Device ordering: when bytes of an asynchronous device may be read, and when memory may be reused.

The write and read paths never touch CUDA directly. They talk to an :class:`Ordering`, whose
primitives are streams (ordered queues of work on a device), events recorded on them, and copies
enqueued on them, and device buffers from the caching allocator of the current stream.
:class:`CudaOrdering` is the real one. ``simulated.py`` has one for machines without a GPU,
with CUDA's guarantees and no more (every stream's work runs late, the compute stream's too; a
freed buffer is reused at once; ``hold`` is ``record_stream``): the same ordering code runs
against it in CI, so a missing rule reads or writes bytes at the wrong time and a test fails.

Note: [device ordering] For a tensor of an asynchronous device (CUDA):

* **Producer.** At pack the stream current on the tensor's device is remembered (the producer).
  At capture an event is recorded on it, i.e. after the kernels of the op that saved the tensor
  were queued, and the side copy stream (one per device) waits on that event before it copies.
* **Per-chunk events.** Each chunk's copy into a staging or host slot records its own event, and
  that chunk's write waits on it, a cpu-tier spill included (never on a later chunk's: a block
  larger than the pool must stream; nor on the block's copy as a whole, which is not complete
  until every chunk's copy is enqueued, :meth:`StagedCopy.seal`). A chunk is forwarded from its slot at unpack, or read back by the prefetcher,
  only once the block's copy completed (:meth:`StagedCopy.done`).
* **Source lifetime.** The source tensor is held until the block's last copy completed, then
  released, so its device memory goes back to the caching allocator only then; its version
  counter is compared at that moment (an in-place change before the copy ran marks the block
  modified, and unpack raises).
* **Slot reuse.** A slot whose copy may still be running is never handed out again: a block freed
  meanwhile waits in the write path's list of blocks awaiting their copy (``Writer.poll_copies``).
* **H2D.** A block whose chunks all lie in pinned slots (tier cpu; tier ssd before its writes
  ran) is copied to the device straight from them, on a second side stream (one per device),
  into a buffer allocated on the consumer's (current) stream: that stream first records an
  event the upload stream waits on (the caching allocator may hand out memory its queued kernels
  still read), the buffer is recorded on the upload stream (freed unconsumed, it is not reused
  before the copy ran), and unpack makes the consumer wait on the copy's event, never the host.
  The prefetcher starts these uploads ahead in reverse pack order. The slots are given back only
  once the copy completed (``Block.upload_pending``). A block read back from disk into host
  memory is copied to a fresh device buffer on the consumer's stream at unpack instead. A GDS
  read into device memory first waits for the work queued on that stream, since the read, on
  another thread, ignores stream order.
* **Shutdown.** Every copy stream is synchronized before the pools are freed: a copy still
  queued would write into memory given back to the system.

Each rule is checked by deleting it: docs/how-it-works.md ("Device ordering, checked without a
GPU") names the test that fails without it, against the simulated device of simulated.py.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, Protocol

import torch

from offloadd.io.buffers import SlotPool

__all__ = ["CudaOrdering", "Event", "Ordering", "StagedCopy"]


class Event(Protocol):
    def query(self) -> bool: ...

    def synchronize(self) -> None: ...


class Ordering(Protocol):
    """The device primitives the runtime orders its copies with (see [device ordering])."""

    def is_async(self, device: torch.device) -> bool:
        """Whether tensors of ``device`` go through asynchronous copies (CUDA: cuda tensors)."""
        ...

    def producer(self, device: torch.device) -> Any:
        """The stream current on ``device`` (the one a saved tensor is being produced on)."""
        ...

    def copy_stream(self, device: torch.device) -> Any:
        """The side stream that copies ``device``'s tensors into host slots."""
        ...

    def upload_stream(self, device: torch.device) -> Any:
        """The side stream that copies slots back to ``device`` (see [device ordering])."""
        ...

    def empty(self, nbytes: int, device: torch.device) -> torch.Tensor:
        """A new uint8 buffer on ``device``, from the caching allocator of the current stream."""
        ...

    def hold(self, tensor: torch.Tensor, stream: Any) -> None:
        """Keep ``tensor``'s memory from reuse until the work queued on ``stream`` so far ran."""
        ...

    def record(self, stream: Any) -> Event:
        """An event that completes once the work queued on ``stream`` so far has."""
        ...

    def wait(self, stream: Any, event: Event) -> None:
        """Make later work on ``stream`` wait for ``event``."""
        ...

    def copy(self, stream: Any, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Enqueue ``dst.copy_(src)`` on ``stream`` (asynchronous)."""
        ...

    def synchronize(self, stream: Any) -> None:
        """Wait until the work queued on ``stream`` completed."""
        ...

    def synchronize_all(self) -> None:
        """Wait for every copy stream (before pools are freed)."""
        ...

    def prepare_pool(self, pool: SlotPool) -> None:
        """Make ``pool``'s memory a target for asynchronous copies (CUDA: pin it)."""
        ...

    def upload(self, host: torch.Tensor, device: torch.device) -> torch.Tensor:
        """A new buffer on ``device`` with ``host``'s bytes, usable by the current stream."""
        ...


class StagedCopy:
    """The copies of one block's chunks into slots; the source lives until all completed.

    I/O threads, the training thread and autograd's device threads all call :meth:`done`,
    hence the lock. See [device ordering]."""

    __slots__ = ("block", "events", "lock", "ordering", "sealed", "source", "stream", "version")

    def __init__(self, ordering: Ordering, block: Any, source: torch.Tensor, producer: Any) -> None:
        self.ordering = ordering
        self.stream = ordering.copy_stream(source.device)
        ordering.wait(self.stream, ordering.record(producer))
        self.block = block
        self.source: torch.Tensor | None = source
        self.version = source._version
        self.events: list[Event] = []  # one per chunk copied
        self.sealed = False  # every chunk's copy is enqueued
        self.lock = threading.Lock()

    def chunk(self, dst: torch.Tensor, src: torch.Tensor) -> Callable[[], None]:
        """Enqueue one chunk's copy and record its event; returns what its write waits on."""
        self.ordering.copy(self.stream, dst, src)
        ev = self.ordering.record(self.stream)
        self.events.append(ev)
        return ev.synchronize

    def seal(self) -> None:
        """Every chunk's copy is enqueued: from now on the last event is the whole copy's."""
        with self.lock:
            self.sealed = True

    def done(self, *, wait: bool) -> bool:
        """Finish the copy (waiting if ``wait``); True once the source is released.

        Never True before :meth:`seal`: until then the last event is only the last chunk's so
        far, and a later chunk's copy may still read the source."""
        with self.lock:
            src = self.source
            if src is None:
                return True
            if not self.sealed:
                assert not wait, "waiting for a copy whose chunks are still being enqueued"
                return False
            last = self.events[-1] if self.events else None
            if last is not None and not wait and not last.query():
                return False
            if last is not None:
                last.synchronize()
            else:
                self.ordering.synchronize(self.stream)
            if src._version != self.version:
                self.block.modified = True  # changed in place before the copy ran
            self.source = None
            return True

    def abort(self) -> None:
        """Wait for whatever was enqueued, and seal (the capture failed half-way)."""
        self.ordering.synchronize(self.stream)
        self.seal()


class CudaOrdering:
    """:class:`Ordering` on CUDA streams and events."""

    def __init__(self) -> None:
        self._streams: dict[int, Any] = {}  # device index -> D2H side stream
        self._uploads: dict[int, Any] = {}  # device index -> H2D side stream
        self._lock = threading.Lock()

    def is_async(self, device: torch.device) -> bool:
        return device.type == "cuda"

    def producer(self, device: torch.device) -> Any:
        return torch.cuda.current_stream(device)

    def copy_stream(self, device: torch.device) -> Any:
        return self._stream(self._streams, device)

    def upload_stream(self, device: torch.device) -> Any:
        return self._stream(self._uploads, device)

    def _stream(self, streams: dict[int, Any], device: torch.device) -> Any:
        index = device.index if device.index is not None else torch.cuda.current_device()
        with self._lock:
            stream = streams.get(index)
            if stream is None:
                stream = streams[index] = torch.cuda.Stream(device=index)
        return stream

    def empty(self, nbytes: int, device: torch.device) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=device)

    def hold(self, tensor: torch.Tensor, stream: Any) -> None:
        tensor.record_stream(stream)

    def record(self, stream: Any) -> Event:
        ev = torch.cuda.Event()
        ev.record(stream)
        return ev

    def wait(self, stream: Any, event: Event) -> None:
        stream.wait_event(event)

    def copy(self, stream: Any, dst: torch.Tensor, src: torch.Tensor) -> None:
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)

    def synchronize(self, stream: Any) -> None:
        stream.synchronize()

    def synchronize_all(self) -> None:
        with self._lock:
            streams = [*self._streams.values(), *self._uploads.values()]
        for stream in streams:
            stream.synchronize()

    def prepare_pool(self, pool: SlotPool) -> None:
        pool.buffer.pin()

    def upload(self, host: torch.Tensor, device: torch.device) -> torch.Tensor:
        dev = torch.empty(host.numel(), dtype=torch.uint8, device=device)
        dev.copy_(host)
        return dev
