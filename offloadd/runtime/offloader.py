"""The training-side client: saved-tensor hooks that move activations out and back in time.

:class:`Offloader` is the hooks (pack, unpack) and the public API. The parts it composes, one
module each: ``handles`` (what pack returns), ``dedup`` (parameter storages, storages already
saved), ``blocks`` (blocks, chunks, the block map), ``capture`` (when a saved tensor's bytes are
taken), ``writer`` (slots, copies, writes), ``reader`` (loads, forwarding, prefetch),
``ordering`` (device streams and events; ``simulated`` for CI), ``ledger`` (the lock and the
counters), and a :class:`~offloadd.backend.base.Backend` (the embedded engine or the daemon).

Note: [never a silently wrong gradient] With saved-tensor hooks installed, autograd no longer
checks version counters at unpack. Kept tensors are checked by us and raise PyTorch's own error.
An offloaded tensor is captured once the op that saved it has returned (see [capture after the
op] in capture.py), after checking that its version is still the one recorded at pack; until
then unpack uses the tensor itself, checked like a kept one. After capture, a version handle
(see [the version handle] in capture.py) is checked at unpack, so any in-place change between
save and backward raises, as it does without hooks. Host tensors are copied into slots at
capture; tensors of an asynchronous device are copied on a side stream, and their version is
also checked once the copy completed (see [device ordering] in ordering.py).
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections import deque
from typing import Any

import torch

from offloadd.backend import Backend, open_backend
from offloadd.config import Config
from offloadd.io.buffers import SlotPool
from offloadd.io.request import Engine, on_engine_thread
from offloadd.runtime.blocks import CAPTURED, CAPTURING, HELD, PENDING, Block, BlockMap
from offloadd.runtime.capture import CaptureQueue
from offloadd.runtime.dedup import StorageIndex
from offloadd.runtime.handles import (
    Kept,
    Ref,
    describe,
    inplace_error,
    movable_storage,
    nbytes_of,
    unlinked,
    version_handle,
)
from offloadd.runtime.ledger import Ledger
from offloadd.runtime.ordering import CudaOrdering, Ordering
from offloadd.runtime.reader import Reader
from offloadd.runtime.stats import Stats
from offloadd.runtime.writer import Writer

__all__ = ["Offloader"]

_DRAIN_AT = 4096  # events queued by the lock-free hot path before pack applies them itself


class Offloader:
    """Saved-tensor hooks that offload activations; use as a context manager around forward.

    ``Offloader(tier="ssd", ssd_dirs=[...])``, ``Offloader(Config(...))``, or both (keyword
    arguments override the config's fields). ``io_engine`` plugs in another engine (embedded
    backend); ``ordering`` another device ordering (tests: ``SimulatedOrdering``).
    """

    def __init__(
        self,
        config: Config | None = None,
        *,
        io_engine: Engine | None = None,
        ordering: Ordering | None = None,
        **overrides: Any,
    ) -> None:
        cfg = config if config is not None else Config()
        if overrides:
            cfg = cfg.replace(**overrides)
        self.config = cfg
        self._min_bytes = cfg.min_bytes
        self._ledger = ledger = Ledger(cfg.trim_host_bytes)
        self._lock = ledger.lock
        self._cond = ledger.cond
        self._stats = ledger.stats
        self._released: deque[Any] = deque()
        self._closed = False
        self._blocks = BlockMap()
        self._index = StorageIndex(cfg.dedup)
        self._captures = CaptureQueue()  # packed, not yet captured (see capture.py)
        self._tls = threading.local()
        self._active_scopes = 0
        self._module_hook: Any = None
        self._ordering: Ordering = ordering if ordering is not None else CudaOrdering()
        self._backend: Backend | None = open_backend(cfg, io_engine, ledger.warn_once)
        backend = self._backend
        if backend is not None:
            self._stats.buffered_io = backend.buffered
            self._stats.engine = backend.name
        self._writer = Writer(cfg, ledger, self._blocks, backend, self._ordering)
        self._reader = Reader(self._writer)
        # Runs at close(), when the Offloader is collected, or at interpreter exit.
        self._finalizer = weakref.finalize(
            self, Offloader._shutdown, backend, self._writer.pools, self._ordering
        )

    # -- public API ------------------------------------------------------------------------

    def __enter__(self) -> Offloader:
        if self._closed:
            raise RuntimeError("offloadd: this Offloader is closed")
        stack = getattr(self._tls, "stack", None)
        if stack is None:
            stack = self._tls.stack = []
        if self._backend is not None:
            self._backend.begin_step()  # the daemon client reconnects after a loss
        hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        hooks.__enter__()
        stack.append(hooks)
        with self._lock:
            self._active_scopes += 1
            if self._module_hook is None:
                self._module_hook = torch.nn.modules.module.register_module_forward_pre_hook(
                    self._note_module
                )
        return self

    def __exit__(self, *exc: object) -> None:
        self._tls.stack.pop().__exit__(*exc)
        self._capture_all()  # between ops: everything this thread packed has returned
        with self._lock:
            self._active_scopes -= 1
            if self._active_scopes == 0 and self._module_hook is not None:
                self._module_hook.remove()
                self._module_hook = None
                self._index.clear_parameters()
            self._drain()
            self._writer.poll_copies()
        self._ledger.flush_warnings()

    def note_module(self, module: torch.nn.Module) -> None:
        """Treat ``module``'s parameters and buffers as parameters (never moved) from now on.

        Every module called inside the scope is noted by a forward pre-hook; integrations call
        this for modules that run outside it (see ``offloadd.integrations.autoload``)."""
        with self._lock:
            self._index.note_module(module)

    def _note_module(self, module: torch.nn.Module, args: Any) -> None:
        self.note_module(module)

    def stats(self) -> Stats:
        """A snapshot of the counters (see :class:`~offloadd.Stats`)."""
        with self._lock:
            self._drain()
            self._writer.poll_copies()
            if self._backend is not None:
                self._stats.disk_bytes = self._backend.used_bytes
                self._stats.engine = self._backend.name
            snapshot = Stats(**self._stats.as_dict())
        self._ledger.flush_warnings()
        return snapshot

    def synchronize(self) -> None:
        """Wait until no write or read is in flight (e.g. before reading stats in a benchmark).

        Called between ops, it first captures what this thread packed and has not captured."""
        self._capture_all()
        with self._lock:
            copies = list(self._writer.pending_copies)
        for copy in copies:  # async devices: copies, waited for without the lock
            copy.done(wait=True)
        with self._lock:
            while self._writer.in_flight or self._blocks.any_loading():
                self._cond.wait()
            self._writer.poll_copies()
            self._drain()

    def close(self) -> None:
        """Finish in-flight I/O, release files and memory. Idempotent; also runs at exit."""
        if self._closed:
            return
        self._closed = True
        self._ordering.synchronize_all()  # no copy may still target the slot pools
        if self._backend is not None:
            self._backend.close()
        with self._lock:
            self._drain()
        self._finalizer()

    def detach(self) -> None:
        """Never close this Offloader, not even at exit: for a forked child, in which the
        parent's I/O threads do not exist (closing would wait for them)."""
        self._finalizer.detach()

    @staticmethod
    def _shutdown(backend: Backend | None, pools: list[SlotPool], ordering: Ordering) -> None:
        """Release the backend and the pools (close(), collection, or interpreter exit).

        Note: [shutdown] Requests hold the write and read paths, never the Offloader, so an
        unclosed one is collected once its graphs are gone, writes in flight or not; closing
        the backend waits for those writes, and the pools are freed only after them and after
        every copy stream has drained (see [device ordering] in ordering.py). A collection can
        still run on an I/O thread (a garbage-collector pass there); closing the backend from it
        would join the very thread doing it, so the shutdown then moves to a fresh thread."""
        if on_engine_thread():
            args = (backend, pools, ordering)
            with contextlib.suppress(RuntimeError):  # no new thread at interpreter exit
                threading.Thread(
                    target=Offloader._shutdown, args=args, name="offloadd-shutdown", daemon=False
                ).start()
            return
        ordering.synchronize_all()
        if backend is not None:
            backend.close()
            backend.release()
        for pool in pools:
            pool.close()

    # -- pack ------------------------------------------------------------------------------

    def _pack(self, t: torch.Tensor) -> Any:
        if self._captures.num_pending:
            self._capture_due()
        storage = None
        if type(t) is torch.Tensor and t.layout is torch.strided:
            nbytes = t.nbytes
            if nbytes >= self._min_bytes and nbytes:
                host_to_host = self.config.tier == "cpu" and not self._ordering.is_async(t.device)
                storage = movable_storage(t, host_to_host)
        else:  # subclasses (fake, DTensor…), sparse, nested: passed through untouched
            nbytes = nbytes_of(t)
        if storage is None:
            # The hot path (most saved tensors are small): no lock. The save is queued as an
            # event, in order with the releases, and counted at the next drain (see _drain).
            q = self._released
            q.append(~nbytes)
            if len(q) > _DRAIN_AT:
                with self._lock:
                    self._drain()
            return Kept(t, nbytes, q)
        st = self._stats
        keep = self.config.tier == "keep"
        with self._lock:
            st.saved_tensors += 1
            st.saved_bytes += nbytes
            self._drain()
            self._writer.poll_copies()
            index = self._index
            if index.backs_parameter(t, storage):
                # Held by the model anyway: kept, but not activation memory of ours.
                st.kept_bytes += nbytes
                return Kept(t, 0, self._released)
            key = index.key(t, storage)
            root = t._base if t._base is not None else t
            block = index.lookup(key, root)  # see [dedup identity] in dedup.py
            if block is not None:
                block.refs += 1
                st.deduplicated_bytes += nbytes
                return Ref(block, t, self._released, keep=keep)
            block = self._blocks.new(storage.nbytes(), t.device, self.config.chunk_bytes)
            index.remember(key, storage, root, block)
            if keep:
                block.resident_bytes = block.nbytes
                self._ledger.add_resident(block.nbytes)
                st.kept_bytes += nbytes
                return Ref(block, t, self._released, keep=True)
            # Pending until the op that saved it has returned (see capture.py).
            block.state = PENDING
            block.source = unlinked(t)
            block.handle = version_handle(t)
            block.source_ptr = storage.data_ptr()
            block.version = t._version
            if self._ordering.is_async(t.device):
                block.stream = self._ordering.producer(t.device)
            self._ledger.add_resident(block.nbytes)
        self._captures.add(block)
        return Ref(block, t, self._released, keep=False)

    def _capture_due(self) -> None:
        """Capture what this thread packed in ops that have returned since."""
        for block in self._captures.due():
            self._capture(block)

    def _capture_all(self) -> None:
        """Capture everything this thread packed (the caller is between two ops)."""
        for block in self._captures.take_all():
            self._capture(block)

    def _capture(self, block: Block) -> None:
        """Copy a pending block out (see [capture after the op] in capture.py)."""
        with self._lock:
            self._drain()  # a block whose graph is gone is dropped, never written
            if block.state != PENDING:  # freed, held, or captured already
                return
            t = block.source
            assert t is not None
            storage = t.untyped_storage()
            if t._version != block.version:
                # Changed in place after it was saved: unpack raises, as autograd would.
                block.modified = True
                self._release_source(block, CAPTURED)
                self._cond.notify_all()
                return
            if (
                self._closed
                or storage.nbytes() != block.nbytes
                or storage.data_ptr() != block.source_ptr
            ):
                # Closed, or the storage was resized or reallocated since pack (as FSDP does
                # to unsharded parameters): keep the tensor itself, as autograd does.
                block.state = HELD
                self._cond.notify_all()
                return
            block.state = CAPTURING
        try:
            self._writer.write_out(block, t)
        except BaseException as e:
            # Never fail the forward because of offloading: keep the tensor. An interrupt
            # (KeyboardInterrupt while waiting for a slot) goes on up, the block still settled.
            if isinstance(e, Exception):
                self._ledger.warn_once(
                    "pack", f"offloadd: offloading failed, keeping the tensor: {e!r}"
                )
            if block.copy_done is not None:
                block.copy_done.abort()
            with self._lock:
                self._writer.release_chunks(block)
                self._stats.fallbacks += isinstance(e, Exception)
                block.state = HELD
                block.copy_done = None
                if block.freed:
                    self._free_block(block)
                self._cond.notify_all()
            if not isinstance(e, Exception):
                raise
            return
        with self._lock:
            self._stats.offloaded_bytes += block.nbytes
            self._release_source(block, CAPTURED)
            if block.freed:  # every ref was released while it was being copied
                self._free_block(block)
            self._cond.notify_all()
        if t.device.type == "cpu":
            self._ledger.note_moved(block.nbytes)
        if self._ledger.warnings_due:
            self._ledger.flush_warnings()

    def _release_source(self, block: Block, state: int) -> None:
        """Drop the saved tensor a pending or held block kept (lock held)."""
        if block.source is not None:
            block.source = None
            self._ledger.sub_resident(block.nbytes)
        block.stream = None
        block.state = state

    # -- unpack ----------------------------------------------------------------------------

    def _unpack(self, packed: Any) -> torch.Tensor:
        if type(packed) is Kept:
            t = packed.tensor
            if t._version != packed.version:
                raise inplace_error(describe(t), packed.version, t._version)
            return t
        ref: Ref = packed
        if ref.tensor is not None:  # tier keep
            t = ref.tensor
            if t._version != ref.version:
                raise inplace_error(ref.desc, ref.version, t._version)
            return t
        with self._lock:
            self._drain()
        return self._reader.unpack(ref, self._closed)

    # -- freeing ---------------------------------------------------------------------------

    def _drain(self) -> None:
        """Apply the events queued without the lock (lock held), in the order they happened:
        ``~nbytes`` for a small tensor saved and kept (pack's hot path), ``nbytes`` for its
        release (``Kept.__del__``), a ``Ref`` for the release of a ref to a block (see
        [freeing] in handles.py). The paths that add resident bytes in bulk (a block packed or
        captured, a read) drain first, so no queued save is counted after a later add and the
        peak sees it."""
        q = self._released
        st = self._stats
        ledger = self._ledger
        while q:
            item = q.popleft()
            if type(item) is int:
                if item < 0:
                    n = ~item
                    st.saved_tensors += 1
                    st.saved_bytes += n
                    st.kept_bytes += n
                    ledger.add_resident(n)
                else:
                    ledger.sub_resident(item)
                continue
            ref: Ref = item
            block = ref.block
            block.refs -= 1
            if ref.tensor is not None:  # tier keep: the block is only accounting
                if block.refs == 0:
                    ledger.sub_resident(block.resident_bytes)
                    self._forget(block)
                continue
            if block.resident is not None and ref.gen != block.gen:
                block.unconsumed -= 1
                if block.unconsumed <= 0 and not block.pinned_resident and block.refs:
                    self._reader.drop_resident(block)
            if block.refs == 0:
                self._free_block(block)

    def _free_block(self, block: Block) -> None:
        block.freed = True
        block.pinned_resident = False
        if block.state == CAPTURING:
            self._forget(block)  # no new save may join it
            return  # the capturing thread frees the rest once done (see _capture)
        self._release_source(block, CAPTURED)
        # Even while reads are in flight: each request keeps its buffer alive, and the read
        # callback frees the place of a freed block.
        self._reader.drop_resident(block, loading_ok=True)
        self._writer.release_chunks(block)
        self._forget(block)

    def _forget(self, block: Block) -> None:
        self._blocks.forget(block)
        self._index.forget(block)
