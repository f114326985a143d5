"""A simulated asynchronous device, so that CI checks the device ordering without a GPU.

:class:`SimulatedOrdering` implements :class:`~offloadd.runtime.ordering.Ordering` for CPU
tensors, treated as if they lived on an asynchronous device: a copy "into staging" is only
enqueued on a stream, and a worker thread does it later, after a random delay; events complete
when the worker reaches them. Streams keep CUDA's guarantee (work on one stream runs in order)
and nothing more. The compute stream is the training thread itself: a CPU op's output is ready
once the op returned, so an event recorded on it is complete at once.

So every rule of [device ordering] in ordering.py is exercised by ordinary CPU training: a write
that does not wait for its chunk's event writes a slot the copy has not filled yet; a slot handed
out before its copy completed is overwritten late; a version check done before the copy ran
misses an in-place change. Each shows up as wrong bytes, hence a gradient that differs from the
run without offloading, on a machine without a GPU.

``Offloader(..., ordering=SimulatedOrdering(seed=...))`` uses it; it is meant for tests.
"""

from __future__ import annotations

import queue
import random
import threading
import time
from collections.abc import Callable

import torch

from offloadd.io.buffers import SlotPool
from offloadd.runtime.ordering import Event

__all__ = ["SimulatedOrdering", "SimulatedStream"]


class _Done:
    """An event recorded on the compute stream: complete at once."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


_COMPUTE = object()  # the compute stream: the training thread itself


class SimulatedStream:
    """An ordered queue of work run by one worker thread, each item after a random delay."""

    def __init__(self, rng: random.Random, rng_lock: threading.Lock, max_delay_s: float) -> None:
        self._rng = rng
        self._rng_lock = rng_lock
        self._max_delay_s = max_delay_s
        self._queue: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="offloadd-sim-stream", daemon=True)
        self._thread.start()

    def put(self, work: Callable[[], None]) -> None:
        self._queue.put(work)

    def record(self) -> threading.Event:
        ev = threading.Event()
        self._queue.put(ev.set)
        return ev

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()

    def _run(self) -> None:
        while True:
            work = self._queue.get()
            if work is None:
                return
            with self._rng_lock:
                delay = self._rng.uniform(0.0, self._max_delay_s)
            time.sleep(delay)
            work()
            del work


class _ThreadingEvent:
    __slots__ = ("_ev",)

    def __init__(self, ev: threading.Event) -> None:
        self._ev = ev

    def query(self) -> bool:
        return self._ev.is_set()

    def synchronize(self) -> None:
        self._ev.wait()


class SimulatedOrdering:
    """:class:`~offloadd.runtime.ordering.Ordering` for CPU tensors with late, random copies."""

    def __init__(self, seed: int = 0, max_delay_s: float = 0.002) -> None:
        self._rng = random.Random(seed)
        self._rng_lock = threading.Lock()
        self._max_delay_s = max_delay_s
        self._stream: SimulatedStream | None = None
        self._upload: SimulatedStream | None = None
        self._lock = threading.Lock()
        self.copies = 0  # chunk copies enqueued (tests check the simulation was used)
        self.uploads = 0  # of which back to the "device", on the upload stream

    def is_async(self, device: torch.device) -> bool:
        return device.type == "cpu"

    def producer(self, device: torch.device) -> object:
        return _COMPUTE

    def copy_stream(self, device: torch.device) -> SimulatedStream:
        with self._lock:
            if self._stream is None:
                self._stream = SimulatedStream(self._rng, self._rng_lock, self._max_delay_s)
            return self._stream

    def upload_stream(self, device: torch.device) -> SimulatedStream:
        with self._lock:
            if self._upload is None:
                self._upload = SimulatedStream(self._rng, self._rng_lock, self._max_delay_s)
            return self._upload

    def hold(self, tensor: torch.Tensor, stream: object) -> None:
        pass  # no allocator reuses memory here: the queued copy holds its tensors

    def record(self, stream: object) -> Event:
        if stream is _COMPUTE:
            return _Done()
        assert isinstance(stream, SimulatedStream)
        return _ThreadingEvent(stream.record())

    def wait(self, stream: object, event: Event) -> None:
        if stream is _COMPUTE:
            event.synchronize()
        else:
            assert isinstance(stream, SimulatedStream)
            stream.put(event.synchronize)

    def copy(self, stream: object, dst: torch.Tensor, src: torch.Tensor) -> None:
        assert isinstance(stream, SimulatedStream)
        self.copies += 1
        self.uploads += stream is self._upload

        def run() -> None:
            dst.copy_(src)

        stream.put(run)

    def synchronize(self, stream: object) -> None:
        self.record(stream).synchronize()

    def synchronize_all(self) -> None:
        with self._lock:
            streams = [s for s in (self._stream, self._upload) if s is not None]
        for stream in streams:
            self.synchronize(stream)

    def prepare_pool(self, pool: SlotPool) -> None:
        pass  # host memory already

    def upload(self, host: torch.Tensor, device: torch.device) -> torch.Tensor:
        # On the compute stream, like CUDA's H2D copy: ordered before every later use.
        out = torch.empty(host.numel(), dtype=torch.uint8, device=device)
        out.copy_(host)
        return out

    def close(self) -> None:
        """Stop the worker (tests; an unclosed one is a daemon thread)."""
        with self._lock:
            streams = [s for s in (self._stream, self._upload) if s is not None]
            self._stream = self._upload = None
        for stream in streams:
            stream.close()
