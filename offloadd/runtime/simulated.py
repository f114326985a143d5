"""A simulated asynchronous device, so that CI checks the device ordering without a GPU.

:class:`SimulatedOrdering` implements :class:`~offloadd.runtime.ordering.Ordering` for CPU
tensors, treated as if they lived on an asynchronous device with CUDA's guarantees and no more:

* **Streams** (simulated_streams.py): a copy is only queued on a stream; a worker thread runs it
  later, after a random delay, in the stream's order. Compute streams too: an event recorded on
  one completes once its worker got there, and another stream that waits for it really runs
  after. Each thread has a current compute stream (the default one, or the one of
  :meth:`SimulatedOrdering.kernels`); its CPU ops run at once, so a wait of a compute stream
  also blocks the host thread, whose next ops must find the bytes there. With ``lag_s`` every
  item is held back that much longer unless someone waits for it: work runs as late as it may,
  so a missing wait finds it not done, every time.
* **Memory** (simulated_memory.py): device buffers (``Ordering.empty``, ``upload``) come from a
  caching allocator that gives a freed buffer to the next allocation of its stream at once, and
  honours ``hold`` as ``record_stream``. A queued copy holds no buffer of the device: it writes
  the memory, whoever has it by then.
* **Kernels** (simulated_kernels.py): under :meth:`SimulatedOrdering.kernels` each CPU op also
  queues, on the current stream, the check of what its late kernel would read from device
  buffers, and keeps its outputs unwritten until the stream gets there.

Each breach of [device ordering] in ordering.py then shows as wrong bytes (a gradient that
differs from the run without offloading), or as a fault the simulation records where the
kernel's late read or the copy ran: a kernel that would have read a buffer overwritten under
it, a copy into a buffer already handed out again, a copy that read a kernel's output before the
kernel ran, or memory whose owner let go of it before a copy ran. :meth:`SimulatedOrdering.close`
raises if any fault was recorded. tests/runtime/test_ordering*.py delete the rules one by one.

``Offloader(..., ordering=SimulatedOrdering(seed=...))`` uses it; it is meant for tests.
"""

from __future__ import annotations

import contextlib
import random
import threading
from collections.abc import Callable, Iterator

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from offloadd.io.buffers import SlotPool
from offloadd.runtime.ordering import Event
from offloadd.runtime.simulated_kernels import KernelMode
from offloadd.runtime.simulated_memory import SimulatedMemory
from offloadd.runtime.simulated_streams import SimulatedEvent, SimulatedStream

__all__ = ["SimulatedOrdering", "SimulatedStream"]


class SimulatedOrdering:
    """:class:`~offloadd.runtime.ordering.Ordering` for CPU tensors, as a device whose work runs
    late (see the module's docstring)."""

    def __init__(self, seed: int = 0, max_delay_s: float = 0.002, *, lag_s: float = 0.0) -> None:
        self._rng = random.Random(seed)
        self._rng_lock = threading.Lock()
        self._max_delay_s = max_delay_s
        self._lag_s = lag_s
        self._lock = threading.Lock()
        self._tls = threading.local()
        self._closed = False
        self.faults: list[str] = []
        self.memory = SimulatedMemory()
        self._compute: list[SimulatedStream] = []
        self._stream: SimulatedStream | None = None
        self._upload: SimulatedStream | None = None
        # Outputs of kernels not run yet: storage -> (a weak ref keeping the key unique, stream).
        self._unwritten: dict[int, tuple[StorageWeakRef, SimulatedStream, object]] = {}
        self.default_stream = self.new_stream("compute")
        self.copies = 0  # copies enqueued (tests check the simulation was used)
        self.uploads = 0  # of which back to the "device", on the upload stream

    # -- streams -----------------------------------------------------------------------------

    def _delay(self) -> float:
        with self._rng_lock:
            return self._rng.uniform(0.0, self._max_delay_s)

    def _new(self, name: str, *, host_runs: bool) -> SimulatedStream:
        return SimulatedStream(name, self._delay, self._lag_s, self._fault, host_runs=host_runs)

    def new_stream(self, name: str = "compute") -> SimulatedStream:
        """Another compute stream, for :meth:`kernels` (as ``torch.cuda.Stream()``)."""
        stream = self._new(name, host_runs=True)
        with self._lock:
            self._compute.append(stream)
        return stream

    def current_stream(self) -> SimulatedStream:
        stream: SimulatedStream | None = getattr(self._tls, "stream", None)
        return stream if stream is not None else self.default_stream

    @contextlib.contextmanager
    def kernels(self, stream: SimulatedStream | None = None) -> Iterator[None]:
        """On this thread, make ``stream`` current (as ``torch.cuda.stream``) and tell the
        simulation about each op, as a kernel queued on it (see simulated_kernels.py)."""
        before = getattr(self._tls, "stream", None)
        self._tls.stream = stream if stream is not None else self.current_stream()
        try:
            with KernelMode(self._kernel):
                yield
        finally:
            self._tls.stream = before

    def _fault(self, what: str) -> None:
        self.faults.append(what)

    # -- the Ordering protocol -----------------------------------------------------------------

    def is_async(self, device: torch.device) -> bool:
        return device.type == "cpu"

    def producer(self, device: torch.device) -> SimulatedStream:
        return self.current_stream()

    def copy_stream(self, device: torch.device) -> SimulatedStream:
        with self._lock:
            if self._stream is None:
                self._stream = self._new("copy", host_runs=False)
            return self._stream

    def upload_stream(self, device: torch.device) -> SimulatedStream:
        with self._lock:
            if self._upload is None:
                self._upload = self._new("upload", host_runs=False)
            return self._upload

    def empty(self, nbytes: int, device: torch.device) -> torch.Tensor:
        return self.memory.allocate(nbytes, self.current_stream())

    def hold(self, tensor: torch.Tensor, stream: object) -> None:
        self.memory.hold(tensor, stream)

    def record(self, stream: object) -> Event:
        assert isinstance(stream, SimulatedStream)
        return stream.record()

    def wait(self, stream: object, event: Event) -> None:
        assert isinstance(stream, SimulatedStream) and isinstance(event, SimulatedEvent)
        stream.put(event.synchronize)
        if stream.host_runs:  # the host runs this stream's next kernels itself
            event.synchronize()

    def copy(self, stream: object, dst: torch.Tensor, src: torch.Tensor) -> None:
        assert isinstance(stream, SimulatedStream)
        with self._lock:
            self.copies += 1
            self.uploads += stream is self._upload
        stream.put(self._copy_work(stream, dst, src))

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
        # On the current stream, like CUDA's copy: ordered before every later use there.
        stream = self.current_stream()
        out = self.memory.allocate(host.numel(), stream)
        stream.put(self._copy_work(stream, out, host))
        self.synchronize(stream)  # the host's next ops read it
        return out

    def close(self) -> None:
        """Run what is queued and stop the workers (tests; an unclosed one has daemon threads).
        Raises ``AssertionError`` if the simulation recorded a fault."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            side = [s for s in (self._stream, self._upload) if s is not None]
            compute = list(self._compute)
        for stream in [*side, *compute]:  # compute last: its checks see every late copy
            stream.close()
        if self.faults:
            raise AssertionError("the simulated device saw: " + "; ".join(self.faults))

    # -- what queued work does -------------------------------------------------------------------

    def _copy_work(
        self, stream: SimulatedStream, dst: torch.Tensor, src: torch.Tensor
    ) -> Callable[[], None]:
        """``dst.copy_(src)`` as the device would run it: into and from raw device memory
        (holding no buffer of its allocator), checked for memory its owner let go of."""
        mem = self.memory
        dst_seg, src_seg = mem.segment_of(dst), mem.segment_of(src)
        n = dst.numel() * dst.element_size()
        assert dst.is_contiguous() and src.is_contiguous() and n == src.numel() * src.element_size()
        into: torch.Tensor = dst
        if dst_seg is not None:
            into = dst_seg.bytes(dst.data_ptr() - dst_seg.address, n)
        dst_gen = dst_seg.generation if dst_seg is not None else 0
        dst_key = dst.untyped_storage()._cdata if dst_seg is None else 0
        src_key = src.untyped_storage()._cdata if src_seg is None else 0
        frm: torch.Tensor = src
        if src_seg is not None:
            frm = src_seg.bytes(src.data_ptr() - src_seg.address, n)
        src_gen = src_seg.generation if src_seg is not None else 0

        def run() -> None:
            if dst_seg is not None and dst_seg.generation != dst_gen:
                self._fault(f"a copy on {stream} wrote a device buffer handed out again")
            if src_seg is not None and src_seg.generation != src_gen:
                self._fault(f"a copy on {stream} read a device buffer handed out again")
            if src_seg is None:
                unwritten = self._unwritten.get(src_key)
                if unwritten is not None and not unwritten[0].expired():
                    self._fault(
                        f"a copy on {stream} read bytes that a kernel queued on "
                        f"{unwritten[1]} had not written yet"
                    )
                if torch._C._storage_Use_Count(src_key) <= 1:  # only this copy holds it
                    self._fault(f"a copy on {stream} read memory its owner released")
            if dst_seg is None and torch._C._storage_Use_Count(dst_key) <= 1:
                self._fault(f"a copy on {stream} wrote memory its owner released")
            into.copy_(frm.view(into.dtype) if frm.dtype != into.dtype else frm)

        return run

    def _kernel(self, inputs: list[torch.Tensor], outputs: list[torch.Tensor]) -> None:
        """An op just ran on this thread (see simulated_kernels.py): queue its late effects."""
        stream = self.current_stream()
        reads = []
        for t in inputs:
            seg = self.memory.segment_of(t)
            if seg is not None:
                reads.append((seg, seg.nbytes, seg.checksum(seg.nbytes)))
        writes = []
        for t in outputs:
            if self.memory.segment_of(t) is not None:
                continue
            try:
                storage = t.untyped_storage()
            except Exception:  # no storage of its own
                continue
            if storage.nbytes():
                writes.append(StorageWeakRef(storage))
        if not reads and not writes:
            return
        token = object()
        with self._lock:
            for ref in writes:
                self._unwritten[ref.cdata] = (ref, stream, token)

        def run() -> None:
            for seg, nbytes, checksum in reads:
                if seg.checksum(nbytes) != checksum:
                    self._fault(
                        f"a kernel queued on {stream} read a device buffer that changed "
                        "before it ran"
                    )
            with self._lock:
                for ref in writes:
                    entry = self._unwritten.get(ref.cdata)
                    if entry is not None and entry[2] is token:
                        del self._unwritten[ref.cdata]

        stream.put(run)
