"""The training-side client: saved-tensor hooks that move activations out and back in time.

Vocabulary. A *block* is one storage being offloaded; it is cut into *chunks* of ``chunk_bytes``,
the unit of staging slots, disk slots and I/O requests. A saved tensor becomes a *ref* to a block
(plus its dtype, size, stride and storage offset) or, when it is not worth moving, a *kept* handle
that holds the tensor itself. Both remember the tensor's version counter at pack time.

Note: [never a silently wrong gradient] With saved-tensor hooks installed, autograd no longer
checks version counters at unpack. Kept tensors are checked by us and raise PyTorch's own error.
An offloaded tensor is captured once the op that saved it has returned (see [capture after the
op] in capture.py), after checking that its version is still the one recorded at pack; until
then unpack uses the tensor itself, checked like a kept one. After capture, a version handle
(see [the version handle] in capture.py) is checked at unpack, so any in-place change between
save and backward raises, as it does without hooks. CPU tensors are copied into staging at
capture. CUDA tensors are copied on a side stream; their version is also checked once the
copy's event completed.

Note: [freeing] Autograd drops a packed object when the graph frees that saved tensor (after the
node ran, or when the graph is released). Our objects' ``__del__`` only appends to a deque; the
bookkeeping runs under the lock at the next pack, unpack, stats() or close(), never inside a
garbage-collector callback that might interrupt our own critical section.

Note: [forwarding] A chunk still in staging when backward needs it is copied from the staging
slot and its write is cancelled if it has not started: the last tensors of a forward are often
never written at all.
"""

from __future__ import annotations

import bisect
import contextlib
import ctypes
import logging
import platform
import threading
import time
import warnings
import weakref
from collections import deque
from collections.abc import Callable
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.nn.parameter import is_lazy

from offloadd.config import Config
from offloadd.io.buffers import SlotPool, aligned_empty, round_up
from offloadd.io.files import DiskStore, default_offload_dir
from offloadd.io.request import Engine, Op, Request, on_engine_thread
from offloadd.io.select import open_host_engine
from offloadd.runtime.capture import CaptureQueue
from offloadd.runtime.stats import Stats

__all__ = ["Offloader"]

log = logging.getLogger("offloadd")

_INPLACE_HINT = (
    "Hint: the backtrace further above shows the operation that failed to compute its gradient. "
    "The variable in question was changed in there or anywhere later. Good luck!"
)


def _inplace_error(t_desc: str, saved: int, now: int) -> RuntimeError:
    return RuntimeError(
        "one of the variables needed for gradient computation has been modified by an inplace "
        f"operation: [{t_desc}] is at version {now}; expected version {saved} instead. "
        + _INPLACE_HINT
    )


def _describe(t: torch.Tensor) -> str:
    return f"{t.type()} {list(t.shape)}"


def _unlinked(t: torch.Tensor) -> torch.Tensor:
    """``t`` without its link into the graph, to be held by a packed object.

    Note: [no cycle through the graph] An op that saves its own output (exp, sigmoid, softmax)
    hands pack that output, whose ``grad_fn`` is the very node that will own the packed object.
    Holding it would make a cycle node -> packed object -> tensor -> node through autograd's
    C++ graph, which no garbage collector can see: a graph dropped without backward would never
    be freed. A detached alias shares the storage and the version counter, which is all that
    offloadd needs; autograd restores the graph links itself at unpack. (Decided on
    ``requires_grad``: reading ``grad_fn`` of a stale view creates a node, which would move the
    node number that capture.py relies on.)"""
    return t.detach() if t.requires_grad else t


def _version_handle(t: torch.Tensor) -> torch.Tensor | None:
    """A tensor without storage that shares ``t``'s version counter (None if this torch cannot
    make one without bumping the counter). See [the version handle] in capture.py."""
    if _BELOW_INPLACE_OR_VIEW is None:
        return None
    h = t.detach()
    with _BELOW_INPLACE_OR_VIEW():  # below the kernel that bumps versions: set_ leaves it alone
        h.set_(torch.empty(0, dtype=t.dtype, device=t.device).untyped_storage())
    return h


_BELOW_INPLACE_OR_VIEW = getattr(torch._C, "_AutoDispatchBelowADInplaceOrView", None)

_DRAIN_AT = 4096  # events queued by the lock-free hot path before pack applies them itself


class _Kept:
    """A saved tensor kept as it is (small, parameter, unsupported, or tier keep)."""

    __slots__ = ("nbytes", "released", "tensor", "version")

    def __init__(self, tensor: torch.Tensor, nbytes: int, released: deque[Any]) -> None:
        # _unlinked(), inlined: this is the hot path of every small saved tensor
        self.tensor = tensor.detach() if tensor.requires_grad else tensor
        self.version = tensor._version
        self.nbytes = nbytes
        self.released = released

    def __del__(self) -> None:
        self.released.append(self.nbytes)


class _Chunk:
    __slots__ = ("file", "index", "mem", "nbytes", "offset", "on_disk", "request", "slot")

    def __init__(self, index: int, nbytes: int) -> None:
        self.index = index
        self.nbytes = nbytes  # padded to 4096
        self.file = -1  # index in DiskStore.files
        self.offset = -1  # byte offset in that file
        self.slot: int | None = None  # staging/host slot holding the data
        self.request: Request | None = None  # write or read in flight
        self.on_disk = False
        self.mem: torch.Tensor | None = None  # fallback copy after a failed write


# A block's capture (see [capture after the op] in capture.py):
_PENDING = 0  # ``source`` holds the data; the op that saved it may still be running
_CAPTURING = 1  # one thread is copying it out; unpack waits
_CAPTURED = 2  # the data is in chunks (staging, host pool, disk) or was never needed
_HELD = 3  # capture failed or made no sense: ``source`` holds the data for good


class _Block:
    """One storage's bytes, on their way out, out, or back in."""

    __slots__ = (
        "chunks",
        "copy_done",
        "device",
        "direct",
        "direct_pending",
        "direct_source",
        "error",
        "finishing",
        "freed",
        "gen",
        "handle",
        "key",
        "loading",
        "modified",
        "nbytes",
        "padded",
        "pinned_resident",
        "prefetched",
        "refs",
        "resident",
        "resident_bytes",
        "seq",
        "source",
        "source_ptr",
        "state",
        "stream",
        "unconsumed",
        "version",
    )

    def __init__(self, seq: int, nbytes: int, device: torch.device, chunk_bytes: int) -> None:
        self.seq = seq
        self.nbytes = nbytes
        self.padded = round_up(nbytes)
        self.device = device
        self.chunks = [
            _Chunk(k, min(chunk_bytes, self.padded - start))
            for k, start in enumerate(range(0, self.padded, chunk_bytes))
        ]
        self.refs = 0
        self.key: tuple[Any, ...] | None = None
        self.resident: torch.Tensor | None = None  # uint8, padded bytes, on host or device
        self.resident_bytes = 0
        self.loading = 0  # reads in flight into ``resident``
        self.gen = 0  # bumped on each load; refs remember which load they consumed
        self.unconsumed = 0
        self.prefetched = False
        self.pinned_resident = False  # the only copy is ``resident`` (a write was cancelled)
        self.error: BaseException | None = None
        self.modified = False
        self.freed = False
        self.copy_done: _CudaCopy | None = None  # CUDA: the D2H copy into staging
        self.direct = False  # CUDA with GDS: written from and read into device memory
        self.direct_pending = 0  # GDS writes in flight
        self.direct_source: tuple[torch.Tensor, int] | None = None  # (tensor, version at pack)
        self.state = _CAPTURED
        self.source: torch.Tensor | None = None  # the saved tensor until captured (or held)
        self.source_ptr = 0  # its storage's address at pack
        self.version = 0  # its version counter at pack
        self.stream: Any = None  # CUDA: the stream it was produced on (current at pack)
        self.finishing = False  # a thread copies the read-back bytes to the device (no lock)
        self.handle: torch.Tensor | None = None  # shares the saved tensor's version counter


class _CudaCopy:
    """The D2H copies of a block's chunks into staging; the source lives until all completed.

    Note: [CUDA ordering] The copy stream (one per device) waits on an event recorded, at
    capture, on the stream that was current at pack (the producer's), i.e. after the kernels of
    the op that saved the tensor were queued. Each chunk's copy records its own event, and that
    chunk's write waits on it (never on a later chunk's: a block larger than the staging pool
    must stream).
    The source tensor is held until the last event completed, then released, so the device
    memory goes back to the caching allocator; the version counter is compared at that moment
    (see [never a silently wrong gradient]). I/O threads, the training thread and autograd's
    device threads all call ``done``, hence the lock."""

    __slots__ = ("block", "events", "lock", "source", "stream", "version")

    def __init__(self, block: _Block, source: torch.Tensor, stream: Any, producer: Any) -> None:
        ready = torch.cuda.Event()
        ready.record(producer)
        stream.wait_event(ready)
        self.block = block
        self.stream = stream
        self.source: torch.Tensor | None = source
        self.version = source._version
        self.events: list[Any] = []  # one per chunk copied; complete once the block is packed
        self.lock = threading.Lock()

    def chunk_copied(self) -> Callable[[], None]:
        """Record the event after one chunk's copy; returns what its write must wait on."""
        ev = torch.cuda.Event()
        ev.record(self.stream)
        self.events.append(ev)
        return ev.synchronize

    def done(self, *, wait: bool) -> bool:
        """Finish the copy (waiting if ``wait``); True once the source is released.

        Only called once every chunk's copy is enqueued (the block is registered)."""
        with self.lock:
            src = self.source
            if src is None:
                return True
            last = self.events[-1] if self.events else None
            if last is not None and not wait and not last.query():
                return False
            if last is not None:
                last.synchronize()
            else:
                self.stream.synchronize()
            if src._version != self.version:
                self.block.modified = True  # changed in place before the copy ran
            self.source = None
            return True


class _Ref:
    """A saved tensor whose storage is a block (offloaded) or is held as is (tier keep)."""

    __slots__ = (
        "block",
        "desc",
        "dtype",
        "gen",
        "offset",
        "released",
        "size",
        "stride",
        "tensor",
        "version",
    )

    def __init__(self, block: _Block, t: torch.Tensor, released: deque[Any], keep: bool) -> None:
        self.block = block
        self.tensor = _unlinked(t) if keep else None
        self.dtype = t.dtype
        self.size = t.size()
        self.stride = t.stride()
        self.offset = t.storage_offset()
        self.version = t._version
        self.desc = _describe(t)
        self.gen = -1
        self.released = released

    def __del__(self) -> None:
        self.released.append(self)


class Offloader:
    """Saved-tensor hooks that offload activations; use as a context manager around forward.

    ``Offloader(tier="ssd", ssd_dirs=[...])``, ``Offloader(Config(...))``, or both
    (keyword arguments override the config's fields). ``io_engine`` plugs in another engine.
    """

    def __init__(
        self,
        config: Config | None = None,
        *,
        io_engine: Engine | None = None,
        **overrides: Any,
    ) -> None:
        cfg = config if config is not None else Config()
        if overrides:
            cfg = cfg.replace(**overrides)
        self.config = cfg
        self._min_bytes = cfg.min_bytes
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._released: deque[Any] = deque()
        self._stats = Stats()
        self._closed = False
        self._seq = 0
        self._blocks: dict[int, _Block] = {}  # live blocks by seq (pack order)
        self._order: list[int] = []  # their seqs, sorted
        self._dedup: dict[tuple[Any, ...], tuple[StorageWeakRef, Any, _Block]] = {}
        self._param_storages: dict[tuple[Any, ...], StorageWeakRef] = {}
        self._prefetch_live = 0  # bytes held by prefetched blocks not yet consumed
        self._pf_low = 0  # prefetch sweep: blocks with seq in [_pf_low, _pf_high) were scanned
        self._pf_high = 0
        self._writes_in_flight = 0
        self._pending_copies: deque[_CudaCopy] = deque()  # D2H copies whose source is held
        self._awaiting_copy: list[_Block] = []  # freed blocks whose slots a D2H copy still fills
        self._captures = CaptureQueue()  # packed, not yet captured (see capture.py)
        self._tls = threading.local()
        self._active_scopes = 0
        self._module_hook: Any = None
        self._warned: set[str] = set()
        self._warn_lock = threading.Lock()  # _warn_once runs on I/O threads too, lock or not
        self._warnings: deque[str] = deque()  # issued by _flush_warnings, outside the lock
        self._copy_streams: dict[int, Any] = {}  # CUDA device index -> D2H side stream
        self._host_pool: SlotPool | None = None  # cpu tier (pinned)
        self._staging: SlotPool | None = None  # ssd tier
        self._disk: DiskStore | None = None
        self._engine: Engine | None = None
        self._engines: list[Engine] = []  # every engine opened, closed at shutdown
        self._gds: Engine | None = None  # CUDA tensors with GPUDirect Storage (kvikio)
        self._gds_checked = (
            cfg.engine not in ("auto", "kvikio") or cfg.tier != "ssd" or bool(cfg.daemon.socket)
        )
        # Daemon mode (offloadd/backend/daemon.py): staging memory, disk and engine of a daemon.
        self._daemon: Any = None
        if cfg.tier == "ssd" and cfg.daemon.socket:
            if io_engine is not None:
                raise ValueError("io_engine cannot be combined with daemon.socket")
            from offloadd.backend.daemon import DaemonBackend

            self._daemon = DaemonBackend(cfg, warn=self._warn_once)
            self._disk, self._engine = self._daemon.disk, self._daemon.engine
            self._stats.buffered_io = self._daemon.disk.buffered
            self._stats.engine = "daemon"
            self._engines.append(self._daemon.engine)
        elif cfg.tier != "keep":
            dirs = list(cfg.ssd_dirs) or [default_offload_dir()]
            self._disk = DiskStore(dirs, cfg.chunk_bytes, cfg.direct_io)
            self._stats.buffered_io = self._disk.buffered
            if io_engine is not None:
                self._engine = io_engine
                self._stats.engine = getattr(io_engine, "name", type(io_engine).__name__)
            else:
                self._engine, choice = open_host_engine(cfg)
                self._stats.engine = choice.name
            self._engines.append(self._engine)
            if cfg.engine == "kvikio" and cfg.tier == "ssd":
                self._open_gds()  # named explicitly: fail now, not at the first CUDA tensor
        self._pools: list[SlotPool] = []
        self._trim = _malloc_trim() if cfg.trim_host_bytes else None
        self._moved_since_trim = 0  # CPU bytes moved out or in since the last trim
        # Runs at close(), when the Offloader is collected, or at interpreter exit.
        self._finalizer = weakref.finalize(
            self, Offloader._shutdown, self._engines, self._disk, self._pools, self._copy_streams
        )

    # -- public API ------------------------------------------------------------------------

    def __enter__(self) -> Offloader:
        if self._closed:
            raise RuntimeError("offloadd: this Offloader is closed")
        stack = getattr(self._tls, "stack", None)
        if stack is None:
            stack = self._tls.stack = []
        if self._daemon is not None:
            self._daemon.begin_step()  # reconnects after a daemon loss
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
                self._param_storages.clear()
            self._drain()
            self._poll_copies()
        self._flush_warnings()

    def stats(self) -> Stats:
        """A snapshot of the counters (see :class:`~offloadd.Stats`)."""
        with self._lock:
            self._drain()
            self._poll_copies()
            if self._disk is not None:
                self._stats.disk_bytes = self._disk.used_bytes
            if self._stats.engine == "native/uring" and self._daemon is None:
                # the native engine moves to its threads for good if its ring fails
                self._stats.engine = f"native/{getattr(self._engine, 'backend', 'uring')}"
            snapshot = Stats(**self._stats.as_dict())
        self._flush_warnings()
        return snapshot

    def synchronize(self) -> None:
        """Wait until no write or read is in flight (e.g. before reading stats in a benchmark).

        Called between ops, it first captures what this thread packed and has not captured."""
        self._capture_all()
        with self._lock:
            copies = list(self._pending_copies)
        for copy in copies:  # CUDA: D2H copies, waited for without the lock
            copy.done(wait=True)
        with self._lock:
            while self._writes_in_flight or any(b.loading for b in self._blocks.values()):
                self._cond.wait()
            self._poll_copies()
            self._drain()

    def close(self) -> None:
        """Finish in-flight I/O, release files and memory. Idempotent; also runs at exit."""
        if self._closed:
            return
        self._closed = True
        for stream in self._copy_streams.values():
            stream.synchronize()  # no copy may still target the pinned pools
        for engine in self._engines:
            engine.close()
        with self._lock:
            self._drain()
        self._finalizer()

    @staticmethod
    def _shutdown(
        engines: list[Engine],
        disk: DiskStore | None,
        pools: list[SlotPool],
        copy_streams: dict[int, Any],
    ) -> None:
        """Release engines, files and pools (close(), collection, or interpreter exit).

        Note: [shutdown] Collection can happen on an engine's own thread: a request's callback
        holds the Offloader, and the thread drops it after the callback ran. Closing the engine
        there would join (or wait on) the very thread doing it, so the shutdown then moves to a
        fresh thread. Pools are freed only after every D2H copy stream has drained: a copy
        still queued would write into memory given back to the system."""
        if on_engine_thread():
            args = (engines, disk, pools, copy_streams)
            with contextlib.suppress(RuntimeError):  # no new thread at interpreter exit
                threading.Thread(
                    target=Offloader._shutdown, args=args, name="offloadd-shutdown", daemon=False
                ).start()
            return
        for stream in copy_streams.values():
            stream.synchronize()
        for engine in engines:
            engine.close()
        if disk is not None:
            disk.close()
        for pool in pools:
            pool.close()

    # -- pack ------------------------------------------------------------------------------

    def _note_module(self, module: torch.nn.Module, args: Any) -> None:
        """Global forward pre-hook: remember storages that back parameters and buffers.

        Lazy modules' uninitialized parameters and buffers, meta tensors and tensors without a
        storage of their own (functorch wrappers) are skipped, never touched."""
        with self._lock:
            for tensors in (module._parameters, module._buffers):
                for p in tensors.values():
                    s = _storage_of(p) if p is not None else None
                    if p is not None and s is not None:
                        self._param_storages[(p.device, s._cdata)] = StorageWeakRef(s)

    def _backs_parameter(self, t: torch.Tensor, storage: torch.UntypedStorage) -> bool:
        """Whether ``t`` is a parameter, a view of one, or shares the storage of a parameter or
        buffer of a module called in the scope (a transposed weight, an FSDP flat parameter).

        A leaf that requires grad is not a parameter by itself: the detached inputs of
        reentrant checkpointing are such leaves, and they are activations."""
        if isinstance(t, torch.nn.Parameter) or isinstance(t._base, torch.nn.Parameter):
            return True
        ref = self._param_storages.get((t.device, storage._cdata))
        return ref is not None and not ref.expired()

    def _pack(self, t: torch.Tensor) -> Any:
        if self._captures.num_pending:
            self._capture_due()
        storage = None
        if type(t) is torch.Tensor and t.layout is torch.strided:
            nbytes = t.nbytes
            if nbytes >= self._min_bytes and nbytes:
                storage = _movable_storage(t, self.config.tier)
        else:  # subclasses (fake, DTensor…), sparse, nested: passed through untouched
            nbytes = _nbytes(t)
        if storage is None:
            # The hot path (most saved tensors are small): no lock. The save is queued as an
            # event, in order with the releases, and counted at the next drain (see _drain).
            q = self._released
            q.append(~nbytes)
            if len(q) > _DRAIN_AT:
                with self._lock:
                    self._drain()
            return _Kept(t, nbytes, q)
        st = self._stats
        keep = self.config.tier == "keep"
        with self._lock:
            st.saved_tensors += 1
            st.saved_bytes += nbytes
            self._drain()
            self._poll_copies()
            if self._backs_parameter(t, storage):
                # Held by the model anyway: kept, but not activation memory of ours.
                st.kept_bytes += nbytes
                return _Kept(t, 0, self._released)
            # The dtype is in the key: a pending block's refs are views of its source.
            key = (t.device, storage._cdata, t._version, t.dtype)
            root = t._base if t._base is not None else t
            hit = self._dedup.get(key) if self.config.dedup else None
            # The weak reference pins the StorageImpl's address while the entry lives, so an
            # equal ``_cdata`` means the same storage, never a new one at a reused address. The
            # root check keeps apart aliases that do not share a version counter (``.data``,
            # ``set_``): one of them may have been changed in place since the first save.
            if hit is not None and not hit[0].expired() and hit[1]() is root and not hit[2].freed:
                block = hit[2]
                block.refs += 1
                st.deduplicated_bytes += nbytes
                return _Ref(block, t, self._released, keep=keep)
            self._seq += 1
            block = _Block(self._seq, storage.nbytes(), t.device, self.config.chunk_bytes)
            block.refs = 1
            self._register(block, key, storage, root)
            if keep:
                block.resident_bytes = block.nbytes
                self._add_resident(block.nbytes)
                st.kept_bytes += nbytes
                return _Ref(block, t, self._released, keep=True)
            # Pending until the op that saved it has returned (see capture.py).
            block.state = _PENDING
            block.source = _unlinked(t)
            block.handle = _version_handle(t)
            block.source_ptr = storage.data_ptr()
            block.version = t._version
            if t.device.type == "cuda":
                block.stream = torch.cuda.current_stream(t.device)
            self._add_resident(block.nbytes)
        self._captures.add(block)
        return _Ref(block, t, self._released, keep=False)

    def _capture_due(self) -> None:
        """Capture what this thread packed in ops that have returned since."""
        for block in self._captures.due():
            self._capture(block)

    def _capture_all(self) -> None:
        """Capture everything this thread packed (the caller is between two ops)."""
        for block in self._captures.take_all():
            self._capture(block)

    def _capture(self, block: _Block) -> None:
        """Copy a pending block out (see [capture after the op] in capture.py)."""
        with self._lock:
            self._drain()  # a block whose graph is gone is dropped, never written
            if block.state != _PENDING:  # freed, held, or captured already
                return
            t = block.source
            assert t is not None
            storage = t.untyped_storage()
            if t._version != block.version:
                # Changed in place after it was saved: unpack raises, as autograd would.
                block.modified = True
                self._release_source(block, _CAPTURED)
                self._cond.notify_all()
                return
            if (
                self._closed
                or storage.nbytes() != block.nbytes
                or storage.data_ptr() != block.source_ptr
            ):
                # Closed, or the storage was resized or reallocated since pack (as FSDP does
                # to unsharded parameters): keep the tensor itself, as autograd does.
                block.state = _HELD
                self._cond.notify_all()
                return
            block.state = _CAPTURING
        try:
            self._write_out(block, t)
        except BaseException as e:
            # Never fail the forward because of offloading: keep the tensor. An interrupt
            # (KeyboardInterrupt while waiting for a slot) goes on up, the block still settled.
            if isinstance(e, Exception):
                self._warn_once("pack", f"offloadd: offloading failed, keeping the tensor: {e!r}")
            if block.copy_done is not None:
                block.copy_done.stream.synchronize()
            with self._lock:
                self._release_chunks(block)
                self._stats.fallbacks += isinstance(e, Exception)
                block.state = _HELD
                block.copy_done = None
                if block.freed:
                    self._free_block(block)
                self._cond.notify_all()
            if not isinstance(e, Exception):
                raise
            return
        with self._lock:
            self._stats.offloaded_bytes += block.nbytes
            self._release_source(block, _CAPTURED)
            if block.freed:  # every ref was released while it was being copied
                self._free_block(block)
            self._cond.notify_all()
        if t.device.type == "cpu":
            self._note_moved(block.nbytes)
        if self._warnings:
            self._flush_warnings()

    def _release_source(self, block: _Block, state: int) -> None:
        """Drop the saved tensor a pending or held block kept (lock held)."""
        if block.source is not None:
            block.source = None
            self._sub_resident(block.nbytes)
        block.stream = None
        block.state = state

    def _register(
        self,
        block: _Block,
        key: tuple[Any, ...],
        storage: torch.UntypedStorage,
        root: torch.Tensor,
    ) -> None:
        self._blocks[block.seq] = block
        # Usually the largest seq, but threads packing at once can register out of order.
        bisect.insort(self._order, block.seq)
        if self.config.dedup:
            block.key = key
            self._dedup[key] = (StorageWeakRef(storage), weakref.ref(root), block)

    def _poll_copies(self) -> None:
        """Release the sources of finished device-to-host copies, and the slots of blocks freed
        while their copy ran (lock held)."""
        q = self._pending_copies
        while q and q[0].done(wait=False):
            q.popleft()
        if self._awaiting_copy:
            waiting, self._awaiting_copy = self._awaiting_copy, []
            for block in waiting:
                self._release_chunks(block)  # puts it back if its copy is still running

    def _write_out(self, block: _Block, t: torch.Tensor) -> None:
        """Copy the storage into staging (or host) slots, chunk by chunk, and start the writes."""
        src = _storage_bytes(t)
        cuda = t.device.type == "cuda"
        host_tier = self.config.tier == "cpu"
        if cuda and not host_tier:
            gds = self._gds if self._gds_checked else self._open_gds()
            if gds is not None:
                self._write_out_direct(block, t, src, gds)
                return
        with self._lock:
            pool = self._pool(cuda, host_tier)
            if cuda:
                block.copy_done = _CudaCopy(block, t, self._copy_stream(t.device), block.stream)
        pos = 0
        for chunk in block.chunks:
            n = min(chunk.nbytes, block.nbytes - pos)
            with self._lock:
                chunk.slot = self._acquire_slot(pool, host_tier)
                self._add_resident(chunk.nbytes)
            if chunk.slot is None:  # nothing can free a slot: keep this chunk in memory
                mem = torch.zeros(chunk.nbytes, dtype=torch.uint8)
                mem[:n].copy_(src[pos : pos + n])
                chunk.mem = mem
                pos += n
                continue
            dst = pool.tensor(chunk.slot, n)
            ready = None
            if block.copy_done is not None:
                with torch.cuda.stream(block.copy_done.stream):
                    dst.copy_(src[pos : pos + n], non_blocking=True)
                ready = block.copy_done.chunk_copied()
            else:
                dst.copy_(src[pos : pos + n])
            pos += n
            if not host_tier:
                with self._lock:
                    self._submit_write(block, chunk, pool, ready)
        if block.copy_done is not None:
            with self._lock:
                self._pending_copies.append(block.copy_done)

    def _open_gds(self) -> Engine | None:
        """The GDS engine for CUDA tensors, opened on first use; None where GDS is unavailable."""
        from offloadd.io import gds

        with self._lock:
            if self._gds_checked:
                return self._gds
            self._gds_checked = True  # whatever happens below: probe once
            ok, why = gds.probe()
            if ok:
                try:
                    self._gds = gds.KvikioEngine(self.config.io_threads)
                except Exception as e:
                    ok, why = False, f"kvikio engine failed to start ({e!r})"
            if not ok and self.config.engine == "kvikio":
                raise RuntimeError(f"offloadd: engine = kvikio, but {why}")
            if self._gds is not None:
                self._engines.append(self._gds)
                self._stats.engine += "+kvikio"
            log.info(
                "offloadd: CUDA tensors %s (%s)",
                "use GDS" if ok else "go through host staging",
                why,
            )
            return self._gds

    def _write_out_direct(
        self, block: _Block, t: torch.Tensor, src: torch.Tensor, gds: Engine
    ) -> None:
        """GDS: write each chunk straight from device memory, after the producer's event.

        The source is held until its last chunk is written; its version counter is compared
        then, as for the D2H copy (see [never a silently wrong gradient])."""
        ready = torch.cuda.Event()
        ready.record(block.stream)
        block.direct = True
        block.direct_source = (t, block.version)
        pos = 0
        for chunk in block.chunks:
            n = min(chunk.nbytes, block.nbytes - pos)
            piece = src[pos : pos + n]
            with self._lock:
                self._add_resident(chunk.nbytes)  # device memory held until written
                block.direct_pending += 1
                self._submit_write(block, chunk, None, ready.synchronize, piece=piece, engine=gds)
            pos += n

    def _pool(self, cuda: bool, host_tier: bool) -> SlotPool:
        """The slot pool for this tier, created on first use (lock held)."""
        cfg = self.config
        if host_tier:
            if self._host_pool is None:
                self._host_pool = SlotPool(cfg.host_budget_bytes, cfg.chunk_bytes)
                self._pools.append(self._host_pool)
            pool = self._host_pool
        else:
            if self._staging is None:
                self._staging = (
                    self._daemon.staging
                    if self._daemon is not None
                    else SlotPool(cfg.staging_bytes, cfg.chunk_bytes)
                )
                self._pools.append(self._staging)
            pool = self._staging
        if cuda:
            pool.buffer.pin()
        return pool

    def _copy_stream(self, device: torch.device) -> Any:
        """The side stream for D2H copies on ``device`` (lock held)."""
        index = device.index if device.index is not None else torch.cuda.current_device()
        stream = self._copy_streams.get(index)
        if stream is None:
            stream = self._copy_streams[index] = torch.cuda.Stream(device=index)
        return stream

    def _acquire_slot(self, pool: SlotPool, host_tier: bool) -> int | None:
        """A free slot, waiting for writes (spilling the oldest host chunks on the cpu tier)."""
        slot = pool.acquire()
        if slot is not None:
            return slot
        start = time.perf_counter()
        self._stats.backpressure_waits += 1
        while slot is None:
            busy = self._writes_in_flight > 0 or bool(self._awaiting_copy)
            if host_tier and not busy:
                busy = self._spill_oldest(pool)
            if not busy:
                break
            # Nothing signals a D2H copy's completion: poll for those, wait for writes.
            self._cond.wait(timeout=0.002 if self._awaiting_copy else 1.0)
            self._poll_copies()
            slot = pool.acquire()
        self._stats.io_wait_s += time.perf_counter() - start
        return slot

    def _spill_oldest(self, pool: SlotPool) -> bool:
        """cpu tier: start writing the oldest host-held chunks to disk; True if any was started."""
        started = 0
        for seq in self._order:
            block = self._blocks[seq]
            for chunk in block.chunks:
                if chunk.slot is not None and chunk.request is None and not chunk.on_disk:
                    self._submit_write(block, chunk, pool, _copy_waiter(block))
                    started += 1
            if started >= 4:
                break
        return started > 0

    def _submit_write(
        self,
        block: _Block,
        chunk: _Chunk,
        pool: SlotPool | None,
        ready: Callable[[], None] | None = None,
        *,
        piece: torch.Tensor | None = None,
        engine: Engine | None = None,
    ) -> None:
        """Write a chunk from its slot in ``pool``, or (GDS) from the device tensor ``piece``."""
        engine = engine or self._engine
        assert self._disk is not None and engine is not None
        chunk.file = (block.seq + chunk.index) % len(self._disk.files)
        f = self._disk.files[chunk.file]
        chunk.offset = f.alloc()
        self._note_disk()
        if piece is not None:
            address, nbytes = piece.data_ptr(), piece.numel()
        else:
            assert pool is not None and chunk.slot is not None
            address, nbytes = pool.address(chunk.slot), chunk.nbytes
        req = Request(
            Op.WRITE,
            f.fd,
            f.path,
            chunk.offset,
            address,
            nbytes,
            self._on_write_done,
            before=ready,
            keepalive=piece,
            context=(block, chunk, pool),
        )
        chunk.request = req
        self._writes_in_flight += 1
        engine.submit(req)

    def _on_write_done(self, req: Request) -> None:
        block, chunk, pool = req.context
        with self._lock:
            chunk.request = None
            self._writes_in_flight -= 1
            if req.error is None:
                chunk.on_disk = True
                self._stats.bytes_written += chunk.nbytes
            else:
                self._write_failed(block, chunk, pool, req.error, req.keepalive)
            if chunk.slot is not None:
                pool.release(chunk.slot)
                chunk.slot = None
                self._sub_resident(chunk.nbytes)
            if pool is None:  # GDS: the device memory was the source
                if chunk.mem is None:
                    self._sub_resident(chunk.nbytes)
                block.direct_pending -= 1
                if block.direct_pending == 0 and block.direct_source is not None:
                    t, version = block.direct_source
                    if t._version != version:
                        block.modified = True  # changed in place before it was written
                    # A failed chunk keeps a view of the source (chunk.mem): keep checking its
                    # version at unpack for as long as that view is the data.
                    if all(c.mem is None for c in block.chunks):
                        block.direct_source = None
            if block.freed:
                self._free_chunk_disk(chunk)
            self._cond.notify_all()

    def _write_failed(
        self,
        block: _Block,
        chunk: _Chunk,
        pool: SlotPool | None,
        err: BaseException,
        piece: torch.Tensor | None = None,
    ) -> None:
        """Keep the chunk's bytes in memory: the step goes on with the same result."""
        self._free_chunk_disk(chunk)
        self._warn_once(
            f"write:{getattr(err, 'errno', None)}",
            f"offloadd: write failed ({err}); keeping the affected tensors in memory",
        )
        if block.freed:
            return
        if pool is None:  # GDS: keep the device bytes (already counted as resident)
            chunk.mem = piece
        elif chunk.slot is not None:
            chunk.mem = pool.tensor(chunk.slot, chunk.nbytes).clone()
            self._add_resident(chunk.nbytes)
        else:
            return
        self._stats.fallbacks += 1

    # -- unpack ----------------------------------------------------------------------------

    def _unpack(self, packed: Any) -> torch.Tensor:
        if type(packed) is _Kept:
            t = packed.tensor
            if t._version != packed.version:
                raise _inplace_error(_describe(t), packed.version, t._version)
            return t
        ref: _Ref = packed
        if ref.tensor is not None:  # tier keep
            t = ref.tensor
            if t._version != ref.version:
                raise _inplace_error(ref.desc, ref.version, t._version)
            return t
        block = ref.block
        with self._lock:
            self._drain()
            while block.state == _CAPTURING:
                self._cond.wait()
            source = block.source
            if source is None:
                if self._closed and block.resident is None:
                    raise RuntimeError("offloadd: unpack after Offloader.close()")
                copy = block.copy_done
        handle = source if source is not None else block.handle
        if handle is not None and handle._version != block.version:
            # Changed in place since it was saved (see [the version handle] in capture.py).
            raise _inplace_error(ref.desc, block.version, handle._version)
        if source is not None:
            # Not captured (yet): a view of the saved tensor itself, which shares its version
            # counter, so that a graph built on it (double backward) still sees in-place changes.
            return source.as_strided(ref.size, ref.stride, ref.offset)
        if copy is not None:
            # CUDA: staging is complete, and the version checked, once the D2H copy completed.
            # Waited for without the lock: I/O callbacks and other threads need it meanwhile.
            copy.done(wait=True)
        with self._lock:
            direct = block.direct_source  # GDS: writes may still read the device source
            if direct is not None and direct[0]._version != direct[1]:
                block.modified = True
            if block.modified:
                raise _inplace_error(ref.desc, block.version, block.version + 1)
            if block.resident is None and block.loading == 0:
                self._load(block, prefetch=False)
            self._prefetch_below(block.seq)
            if block.loading or block.finishing:
                start = time.perf_counter()
                while block.loading or block.finishing:
                    self._cond.wait()
                self._stats.io_wait_s += time.perf_counter() - start
            if block.error is not None:
                err = block.error
                raise OSError(
                    getattr(err, "errno", None),
                    f"offloadd: reading back a saved activation failed: {err}",
                    getattr(err, "filename", None),
                ) from err
            buf = block.resident
            assert buf is not None
            to_device = block.device.type == "cuda" and buf.device.type == "cpu"
            if to_device:
                block.finishing = True  # other unpacks of this block wait for the copy below
            else:
                fresh = ref.gen != block.gen
                self._consume(block, ref)
        if to_device:
            buf, fresh = self._to_device(block, ref, buf)
        if fresh and buf.device.type == "cpu":
            self._note_moved(block.padded)
        if self._warnings:
            self._flush_warnings()
        return _view(buf, ref)

    def _to_device(self, block: _Block, ref: _Ref, host: torch.Tensor) -> tuple[torch.Tensor, bool]:
        """Copy a block read back into host memory to its device, without the lock held.

        The device buffer is allocated on the current (compute) stream of this backward thread,
        so the caching allocator orders its reuse after the kernels that will read it."""
        dev: torch.Tensor | None = None
        try:
            dev = torch.empty(block.padded, dtype=torch.uint8, device=block.device)
            dev.copy_(host)
        finally:
            with self._lock:
                block.finishing = False
                if dev is not None and block.resident is host:
                    block.resident = dev
                fresh = ref.gen != block.gen
                if dev is not None:
                    self._consume(block, ref)
                self._cond.notify_all()
        return dev, fresh

    def _note_moved(self, nbytes: int) -> None:
        """Trim the C heap once per ``trim_host_bytes`` of CPU activations moved (see config)."""
        if self._trim is None:
            return
        self._moved_since_trim += nbytes
        if self._moved_since_trim >= self.config.trim_host_bytes:
            self._moved_since_trim = 0
            self._trim(0)

    def _load(self, block: _Block, *, prefetch: bool) -> None:
        """Make ``block.resident``: copy chunks held in memory, read the others (async)."""
        assert self._disk is not None and self._engine is not None
        # CUDA: staging/host slots are complete only once the D2H copy is; unpack waited for it
        # without the lock and prefetch only takes blocks whose copy completed.
        assert block.copy_done is None or block.copy_done.done(wait=False)
        engine = self._gds if block.direct else self._engine
        assert engine is not None
        ready: Callable[[], None] | None = None
        if block.direct:
            buf = torch.empty(block.padded, dtype=torch.uint8, device=block.device)
            # The caching allocator may hand out memory that kernels queued on this stream
            # still use; a GDS read from another thread ignores stream order, so wait for them.
            allocated = torch.cuda.Event()
            allocated.record(torch.cuda.current_stream(block.device))
            ready = allocated.synchronize
        else:
            buf = aligned_empty(block.padded)
        block.resident = buf
        block.resident_bytes = block.padded
        block.gen += 1
        block.unconsumed = block.refs
        block.prefetched = prefetch
        block.error = None
        self._add_resident(block.padded)
        if prefetch:
            self._prefetch_live += block.padded
        on_demand = False
        pos = 0
        for chunk in block.chunks:
            dst = buf[pos : pos + chunk.nbytes]
            if block.direct:  # GDS chunks hold their real length, not the padded one
                dst = dst[: max(0, min(chunk.nbytes, block.nbytes - pos))]
            write = chunk.request
            if chunk.mem is not None:
                dst.copy_(chunk.mem[: dst.numel()])
            elif block.direct and write is not None and write.op is Op.WRITE:
                dst.copy_(write.keepalive)  # still being written: take the device source
                self._stats.forwarded_bytes += chunk.nbytes
            elif chunk.slot is not None:
                pool = self._host_pool if self.config.tier == "cpu" else self._staging
                assert pool is not None
                req = chunk.request
                if req is not None and req.op is Op.WRITE and self._engine.cancel(req):
                    self._on_write_cancelled(chunk)
                    dst.copy_(pool.tensor(chunk.slot, chunk.nbytes))
                    pool.release(chunk.slot)
                    chunk.slot = None
                    self._sub_resident(chunk.nbytes)
                    block.pinned_resident = True
                else:
                    dst.copy_(pool.tensor(chunk.slot, chunk.nbytes))
                self._stats.forwarded_bytes += chunk.nbytes
            elif chunk.on_disk:
                f = self._disk.files[chunk.file]
                req = Request(
                    Op.READ,
                    f.fd,
                    f.path,
                    chunk.offset,
                    dst.data_ptr(),
                    dst.numel(),
                    self._on_read_done,
                    before=ready,
                    keepalive=dst if block.direct else buf,
                    context=(block, chunk),
                )
                chunk.request = req
                block.loading += 1
                on_demand = True
                engine.submit(req)
            else:  # a write still running: its slot was released, wait and read
                raise AssertionError("chunk without data")
            pos += chunk.nbytes
        if prefetch:
            self._stats.prefetched_bytes += block.padded
        elif on_demand:
            self._stats.on_demand_reads += 1

    def _on_write_cancelled(self, chunk: _Chunk) -> None:
        chunk.request = None
        self._writes_in_flight -= 1
        self._free_chunk_disk(chunk)
        self._cond.notify_all()

    def _on_read_done(self, req: Request) -> None:
        block, chunk = req.context
        with self._lock:
            chunk.request = None
            block.loading -= 1
            if req.error is not None:
                block.error = req.error
            else:
                self._stats.bytes_read += chunk.nbytes
            if block.freed:
                self._free_chunk_disk(chunk)
            self._cond.notify_all()

    def _consume(self, block: _Block, ref: _Ref) -> None:
        if ref.gen != block.gen:
            ref.gen = block.gen
            block.unconsumed -= 1
            if block.unconsumed <= 0 and not block.pinned_resident:
                self._drop_resident(block)

    def _drop_resident(self, block: _Block, *, loading_ok: bool = False) -> None:
        if block.resident is None or (block.loading and not loading_ok):
            return
        block.resident = None
        self._sub_resident(block.resident_bytes)
        if block.prefetched:
            self._prefetch_live -= block.padded
            block.prefetched = False

    def _prefetch_below(self, seq: int) -> None:
        """Read ahead, in reverse pack order from ``seq``, up to the prefetch window.

        A sweep remembers where it stopped: an unpack inside the range already scanned resumes
        there, so backward costs O(blocks) in all, not O(blocks) per unpack."""
        window = self.config.prefetch_bytes
        if self._prefetch_live >= window:
            return
        if self._pf_low <= seq <= self._pf_high:
            start = self._pf_low
        else:  # a new sweep (a new backward, or a jump below what was scanned)
            start = self._pf_high = seq
        i = bisect.bisect_left(self._order, start) - 1
        while i >= 0 and self._prefetch_live < window:
            block = self._blocks[self._order[i]]
            i -= 1
            if (
                block.resident is None
                and block.state == _CAPTURED
                and (block.gen == 0 or block.unconsumed > 0)  # not consumed by every ref yet
                and not block.modified
                and (block.copy_done is None or block.copy_done.done(wait=False))
                and any(c.on_disk and c.request is None for c in block.chunks)
            ):
                self._load(block, prefetch=True)
        self._pf_low = self._order[i] + 1 if i >= 0 else 0

    # -- freeing ---------------------------------------------------------------------------

    def _drain(self) -> None:
        """Apply the events queued without the lock (lock held), in the order they happened:
        ``~nbytes`` for a small tensor saved and kept (pack's hot path), ``nbytes`` for its
        release (``_Kept.__del__``), a ``_Ref`` for the release of a ref to a block. The paths
        that add resident bytes in bulk (a block packed or captured, a read) drain first, so no
        queued save is counted after a later add and the peak sees it."""
        q = self._released
        st = self._stats
        while q:
            item = q.popleft()
            if type(item) is int:
                if item < 0:
                    n = ~item
                    st.saved_tensors += 1
                    st.saved_bytes += n
                    st.kept_bytes += n
                    self._add_resident(n)
                else:
                    self._sub_resident(item)
                continue
            ref: _Ref = item
            block = ref.block
            block.refs -= 1
            if ref.tensor is not None:  # tier keep: the block is only accounting
                if block.refs == 0:
                    self._sub_resident(block.resident_bytes)
                    self._forget(block)
                continue
            if block.resident is not None and ref.gen != block.gen:
                block.unconsumed -= 1
                if block.unconsumed <= 0 and not block.pinned_resident and block.refs:
                    self._drop_resident(block)
            if block.refs == 0:
                self._free_block(block)

    def _free_block(self, block: _Block) -> None:
        block.freed = True
        block.pinned_resident = False
        if block.state == _CAPTURING:
            self._forget(block)  # no new save may join it
            return  # the capturing thread frees the rest once done (see _capture)
        self._release_source(block, _CAPTURED)
        # Even while reads are in flight: each request keeps its buffer alive, and the read
        # callback frees the disk slot of a freed block.
        self._drop_resident(block, loading_ok=True)
        self._release_chunks(block)
        self._forget(block)

    def _release_chunks(self, block: _Block) -> None:
        copy = block.copy_done
        if copy is not None and not copy.done(wait=False):
            # A slot may be reused only once its D2H copy completed; rather than waiting with
            # the lock held, _poll_copies releases the chunks then.
            if block not in self._awaiting_copy:
                self._awaiting_copy.append(block)
            return
        pool = self._host_pool if self.config.tier == "cpu" else self._staging
        for chunk in block.chunks:
            req = chunk.request
            if (
                req is not None
                and req.op is Op.WRITE
                and not block.direct  # GDS writes finish; their callback frees the slot
                and self._engine is not None
                and self._engine.cancel(req)
            ):
                self._on_write_cancelled(chunk)
            if chunk.request is None and chunk.slot is not None and pool is not None:
                pool.release(chunk.slot)
                chunk.slot = None
                self._sub_resident(chunk.nbytes)
            if chunk.mem is not None:
                chunk.mem = None
                self._sub_resident(chunk.nbytes)
            if chunk.request is None:
                self._free_chunk_disk(chunk)
        self._cond.notify_all()

    def _free_chunk_disk(self, chunk: _Chunk) -> None:
        if chunk.offset >= 0 and self._disk is not None:
            self._disk.files[chunk.file].free(chunk.offset)
            chunk.offset = -1
            chunk.on_disk = False
            self._note_disk()

    def _forget(self, block: _Block) -> None:
        if self._blocks.pop(block.seq, None) is not None:
            i = bisect.bisect_left(self._order, block.seq)
            if i < len(self._order) and self._order[i] == block.seq:
                del self._order[i]
        if block.key is not None:
            hit = self._dedup.get(block.key)
            if hit is not None and hit[2] is block:
                del self._dedup[block.key]

    # -- accounting ------------------------------------------------------------------------

    def _add_resident(self, n: int) -> None:
        st = self._stats
        st.resident_bytes += n
        if st.resident_bytes > st.peak_resident_bytes:
            st.peak_resident_bytes = st.resident_bytes

    def _sub_resident(self, n: int) -> None:
        self._stats.resident_bytes -= n

    def _note_disk(self) -> None:
        assert self._disk is not None
        used = self._disk.used_bytes
        self._stats.disk_bytes = used
        if used > self._stats.peak_disk_bytes:
            self._stats.peak_disk_bytes = used

    def _warn_once(self, key: str, message: str) -> None:
        """Log now; raise the Python warning later on the training thread, outside the lock
        (I/O callbacks call this, and warnings may be configured to raise). Callers may or may
        not hold the Offloader's lock (the daemon client's threads do not): its own lock."""
        with self._warn_lock:
            if key in self._warned:
                return
            self._warned.add(key)
        log.warning(message)
        self._warnings.append(message)

    def _flush_warnings(self) -> None:
        while self._warnings:
            warnings.warn(self._warnings.popleft(), RuntimeWarning, stacklevel=4)


def _storage_of(t: torch.Tensor) -> torch.UntypedStorage | None:
    """The storage of a materialized, strided, non-meta tensor, else None (never raises)."""
    if is_lazy(t) or t.layout is not torch.strided or t.is_meta:
        return None
    try:
        return t.untyped_storage()
    except Exception:  # no storage of its own (functorch wrappers, some subclasses)
        return None


def _movable_storage(t: torch.Tensor, tier: str) -> torch.UntypedStorage | None:
    """The storage of a plain dense CPU/CUDA tensor that can be moved and rebuilt, else None."""
    device = t.device.type
    if (
        device not in ("cpu", "cuda")
        or (tier == "cpu" and device == "cpu")  # host to host saves nothing
        or t.is_quantized
        or t.is_conj()
        or t.is_neg()
    ):
        return None
    return _storage_of(t)


def _nbytes(t: torch.Tensor) -> int:
    """Bytes of a tensor offloadd does not move, for the stats; 0 where it has no such size."""
    if t.layout is not torch.strided:
        return 0
    try:
        return int(t.nbytes)
    except Exception:  # symbolic or data-dependent sizes (tracing)
        return 0


def _copy_waiter(block: _Block) -> Callable[[], None] | None:
    """What a write of a registered block's chunk must wait on (CUDA), or None."""
    copy = block.copy_done
    if copy is None:
        return None

    def wait() -> None:
        copy.done(wait=True)

    return wait


def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim``, or None elsewhere (musl, macOS)."""
    if platform.libc_ver()[0] != "glibc":
        return None
    try:
        fn = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_size_t]
    fn.restype = ctypes.c_int
    return fn


def _storage_bytes(t: torch.Tensor) -> torch.Tensor:
    """All bytes of ``t``'s storage, as a flat uint8 tensor on its device."""
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())


def _view(buf: torch.Tensor, ref: _Ref) -> torch.Tensor:
    """The saved tensor, rebuilt on ``buf`` with its exact dtype, size, stride and offset."""
    itemsize = ref.dtype.itemsize
    byte_offset = buf.storage_offset() + ref.offset * itemsize
    out = torch.empty(0, dtype=ref.dtype, device=buf.device)
    out.set_(buf.untyped_storage(), byte_offset // itemsize, ref.size, ref.stride)
    return out
