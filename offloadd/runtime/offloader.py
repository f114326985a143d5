"""The training-side client: saved-tensor hooks that move activations out and back in time.

:class:`Offloader` is the public API over ``hooks`` (pack and unpack, the hot path). The parts
it composes, one module each: ``handles`` (what pack returns), ``dedup`` (parameter storages, storages already
saved), ``blocks`` (blocks, chunks, the block map), ``capture`` (when a saved tensor's bytes are
taken), ``lifetime`` (capture and freeing), ``writer`` (slots, copies, writes), ``reader`` (loads, forwarding, prefetch),
``ordering`` (device streams and events; ``simulated`` for CI), ``accounting`` (the lock and the
counters), and a :class:`~offloadd.backend.base.Backend` (the embedded engine or the daemon).
The optional stages, the budget planner and the codec, come in through ``stages``
(runtime/stages.py); ``offloadd.Offloader`` (offloadd/offloader.py) wires them in.

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
import time
import weakref
from typing import Any

import torch

from offloadd.backend import Backend, open_backend
from offloadd.config import Config
from offloadd.io.request import Engine
from offloadd.runtime import compiled, evicted, host_allocator, transforms
from offloadd.runtime.accounting import Ledger
from offloadd.runtime.blocks import BlockMap
from offloadd.runtime.dedup import StorageIndex
from offloadd.runtime.hooks import SavedTensorHooks, ThreadState
from offloadd.runtime.lifetime import Lifetime
from offloadd.runtime.ordering import CudaOrdering, Ordering
from offloadd.runtime.reader import Reader
from offloadd.runtime.shutdown import shutdown
from offloadd.runtime.stages import Coder, Planner, Stages
from offloadd.runtime.stats import Stats
from offloadd.runtime.writer import Writer

__all__ = ["Offloader"]


class Offloader(SavedTensorHooks):
    """Saved-tensor hooks that offload activations; use as a context manager around forward.

    Inside ``with off:``, each tensor autograd saves for backward is kept, moved to pinned host
    memory or written to files, and read back, in time, when backward needs it; gradients are
    bitwise those of plain PyTorch unless a lossy codec is asked for. Enter it once per forward
    (``with off:`` around each step's forward, as ``OFFLOADD=1`` does): each outermost entry
    begins a training step, at which the read pool unmaps the buffers of sizes that the last two
    steps did not use (see [warm buffers] in io/pools.py). Entered once around the whole loop,
    it unmaps them only when it closes. Backward runs outside the scope.

    Args:
        config (Config | None): the settings; ``None``: ``Config()``, the defaults. The
            keyword arguments below override its fields.
        io_engine (Engine | None): another I/O engine for the embedded backend (by default
            ``engine`` chooses one). Not with ``daemon.socket``.
        ordering (Ordering | None): how an asynchronous device orders its copies (default:
            CUDA streams and events; tests pass ``SimulatedOrdering``).
        stages (Stages | None): the budget planner and the codec (see runtime/stages.py);
            ``offloadd.Offloader`` passes both, and without them a config with a ``budget`` or
            a codec is refused.
        **overrides: any key of :class:`~offloadd.Config`, each read and checked as the
            config file's would be (``"4MiB"`` for a size); a section takes a mapping of some
            of its keys, merged into the config's section, or a whole section object:

            - ``tier`` (str): ``"ssd"`` (default: files in ``ssd_dirs``), ``"cpu"`` (CUDA
              tensors to pinned host memory up to ``host_budget_bytes``, spilling to
              ``ssd_dirs``) or ``"keep"`` (hooks only: the accounting baseline).
            - ``ssd_dirs`` (list[str]): offload directories, striped chunk by chunk; empty: a
              per-user directory on a local disk.
            - ``min_bytes`` (int | str): smaller tensors stay in memory (default 1 MiB).
            - ``dedup`` (bool): move a storage shared by several saved tensors once.
            - ``staging_bytes``, ``host_budget_bytes``, ``prefetch_bytes``, ``chunk_bytes``
              (int | str): the write staging pool, the cpu tier's pinned budget, backward's
              read-ahead, and the I/O unit (a multiple of 4096).
            - ``io_threads`` (int), ``direct_io`` (``"auto"``/``"on"``/``"off"``),
              ``engine`` (``"auto"``/``"native"``/``"python"``/``"kvikio"``), ``io_uring``
              (``"auto"``/``"on"``/``"off"``): the embedded I/O engine.
            - ``trim_host_bytes`` (int | str), ``host_allocator`` (``"auto"``/``"caching"``/
              ``"system"``): host memory of CPU activations (glibc trims, offloadd's cache).
            - ``budget`` (int | float | str | None): a peak for saved activations (``"6GiB"``
              or ``"0.3x"`` of keep's); offloadd then keeps, offloads or recomputes each
              block to fit. ``None`` (default): offload everything the tier says.
            - ``memsave`` (bool): under ``OFFLOADD=1`` only, apply :func:`offloadd.memsave`.
            - ``compile_ops`` (bool): a model compiled whole streams its saved activations.
            - ``codec`` (mapping | CodecConfig): lossy compression, off by default:
              ``codec={"name": "int8"}`` and its other keys ``group``, ``symmetric``,
              ``stochastic``, ``seed``, ``min_bytes``, ``ops``.
            - ``daemon`` (mapping | DaemonConfig): ``daemon={"socket": path}`` has the
              ``offloadd serve`` daemon there do the ssd tier's I/O; ``trusted_uids`` the
              uids besides its own and root whose daemon it talks to.

            Old names (``daemon_socket``, ``codec="int8"``, ``codec_group``, ...) are read with
            a DeprecationWarning until 0.3.0 (docs/usage-envvar.md, "Deprecated names").

    Raises:
        ValueError: a key that does not exist, or a value that is not of its kind (the
            message names the dotted key, as ``codec.group: 3 is not an integer in
            8..1048576``); two keys that do not fit together (``staging_bytes`` below
            ``chunk_bytes``); an offload directory that is missing or not writable;
            ``codec.ops`` naming no torch function; ``io_engine`` with ``daemon.socket``.
        RuntimeError: an engine or backend asked for by name that cannot run here
            (``engine="native"``/``"kvikio"``, ``io_uring="on"``), or
            ``host_allocator="caching"`` where the host cache cannot be loaded. Entering a
            closed Offloader, or a codec under ``torch.compile(model)``, raises it too.
        ConnectionError: ``daemon.socket`` is set and the daemon there cannot be reached,
            is not trusted, or refuses the session.

    Example:
        >>> import torch
        >>> from offloadd import Offloader
        >>> model = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.GELU(),
        ...                             torch.nn.Linear(4096, 1024))
        >>> off = Offloader(tier="ssd", min_bytes="64KiB")  # or Offloader(Config.load(path))
        >>> for step in range(3):
        ...     x = torch.randn(64, 1024)
        ...     with off:  # forward inside: saved activations leave as they are saved
        ...         loss = model(x).square().mean()
        ...     loss.backward()  # outside: each comes back before the op that needs it
        >>> print(off.stats().summary())  # doctest: +SKIP
        >>> off.close()
    """

    def __init__(
        self,
        config: Config | None = None,
        *,
        io_engine: Engine | None = None,
        ordering: Ordering | None = None,
        stages: Stages | None = None,
        **overrides: Any,
    ) -> None:
        cfg = config if config is not None else Config()
        if overrides:
            cfg = cfg.replace(**overrides)
        stages = stages if stages is not None else Stages()
        stages.check(cfg)
        self.config = cfg
        self._min_bytes = cfg.min_bytes
        self._ledger = ledger = Ledger(cfg.trim_host_bytes)
        self._lock = ledger.lock
        self._stats = ledger.stats
        self._blocks = BlockMap()
        self._index = StorageIndex(cfg.dedup)
        self._tls = ThreadState()
        self._active_scopes = 0
        self._ordering: Ordering = ordering if ordering is not None else CudaOrdering()
        self._backend: Backend | None = open_backend(cfg, io_engine, ledger.warn_once)
        backend = self._backend
        if backend is not None:
            self._stats.buffered_io = backend.buffered
            self._stats.engine = backend.name
        self._writer = Writer(cfg, ledger, self._blocks, backend, self._ordering)
        self._reader = Reader(self._writer)
        self._life = life = Lifetime(self._index, self._writer, self._reader)
        self._released = life.released  # refs released (see [freeing] in handles.py)
        self._tally = life.tally  # tensors kept as they are (see [the tally] in held.py)
        self._captures = life.captures
        self._drain = life.drain
        self._closed = lambda: life.closed
        # With a budget: keep, offload or recompute per block (see [auto] in auto/planner.py).
        self._auto: Planner | None = None
        if cfg.budget is not None and stages.planner is not None:
            self._auto = stages.planner(cfg, ledger, self._tls)
            if self._writer.in_place is not None:  # see [room for writes]
                self._writer.in_place.room = self._auto.write_room
        # Tier keep: every saved tensor held where it is, its storage counted once, no block
        # (see [the tally] in held.py). Without dedup, each save counts its storage: blocks.
        self._share = cfg.tier == "keep" and self._auto is None and cfg.dedup
        # Lossy codes of some saved activations, opt-in (see [codes through the tiers]).
        self._codec: Coder | None = None
        self._coded_type: type | None = None
        if cfg.codec.name != "none" and stages.coder is not None:
            self._codec = stages.coder(cfg)
            self._coded_type = self._codec.handle_type
            self._stats.codec = cfg.codec.name
        # Last before the finalizer that releases it: a part refusing the config (the backend,
        # the writer) leaves torch's allocator alone.
        self._host_cache = host_allocator.open_for(cfg, ledger.warn_once)
        self._stats.host_allocator = "caching" if self._host_cache else "system"
        # Runs at close(), when the Offloader is collected, or at interpreter exit.
        self._finalizer = weakref.finalize(
            self,
            shutdown,
            backend,
            self._writer.pools,
            self._ordering,
            self._host_cache,
        )

    # -- public API ------------------------------------------------------------------------

    def __enter__(self) -> Offloader:
        if self._life.closed:
            raise RuntimeError("offloadd: this Offloader is closed")
        transforms.check_enter()  # inside torch.func.grad & co. (see [torch.func in a scope])
        stack = getattr(self._tls, "stack", None)
        if stack is None:
            stack = self._tls.stack = []
        if not stack:  # a forward begins (see [warm buffers] in io/pools.py)
            with self._lock:
                self._reader.pool.new_step()
                if self._auto is not None:
                    self._drain()  # the last step's releases: the planner reads what is held now
                    if self._auto.plan_offloads is False:
                        self._reader.pool.release_idle()  # no block offloaded: no read-backs
                        self._writer.note_buffers()
            if self._auto is not None:
                self._auto.forward_begins()  # may refuse a budget no plan fits in, before any hook
        if self._backend is not None:
            self._backend.begin_step()  # the daemon client reconnects after a loss
        codec = self._codec
        if codec is None:
            hooks: Any = torch.autograd.graph.saved_tensors_hooks(*self._hook_pair())
        else:
            if not stack:
                codec.begin_step()
            hooks = contextlib.ExitStack()
            hooks.enter_context(torch.autograd.graph.saved_tensors_hooks(*self._hook_pair()))
            hooks.enter_context(codec.scope())
        hooks.__enter__()
        stack.append(hooks)
        with self._lock:
            self._active_scopes += 1
            if self._active_scopes == 1:
                self._index.step += 1  # parameters are learned again once (see dedup.py)
        if self._active_scopes == 1:
            compiled.scope_opened(self)  # see [no module hook] in compiled.py
        return self

    def __exit__(self, *exc: object) -> None:
        evicted.drop_claims(self)  # a compiled forward that raised after emptying a tensor
        stack = self._tls.stack
        if not stack:
            raise RuntimeError(
                "offloadd: Offloader exited more times than it was entered on this thread"
            )
        stack.pop().__exit__(*exc)
        if self._auto is not None and not stack:
            self._auto.forward_ends()
        start = time.perf_counter()
        self._life.capture_all()  # between ops: everything this thread packed has returned
        self._stats.pack_s += time.perf_counter() - start  # the forward's last copies and writes
        with self._lock:
            self._active_scopes -= 1
            closed = self._active_scopes == 0
            self._drain()
            self._writer.poll_copies()
        if closed:
            compiled.scopes_closed(self)
        self._ledger.flush_warnings()
        if (refused := transforms.refusal(exc[1])) is not None:
            raise refused  # torch.func.grad & co. called in the scope, caused by exc[1]

    def note_module(self, module: torch.nn.Module) -> None:
        """Treat the parameters and buffers of ``module`` and its submodules as parameters
        (never moved), from now on and after they change (``.to()``).

        Modules called in the scope are found by themselves (see [no module hook] in
        compiled.py); integrations call this for modules that run outside it (see
        ``offloadd.integrations.autoload``). With a budget, the first module noted is the model
        whose blocks are planned."""
        module = compiled.check_wrapper(self, module)
        with self._lock:
            self._index.note_module(module)
        if self._auto is not None and self._auto.root is None:
            self._auto.attach(module)
        compiled.check_children(self, module)

    def plan(self) -> Any:
        """With a budget: the plan of the last step planned (see [auto] in auto/planner.py),
        made now if a profile step's backward has run; None before that, or without a budget."""
        if self._auto is None:
            return None
        self._auto.settle()
        return self._auto.last_plan

    def _awaits_model(self) -> bool:
        """Whether a budget's planner has no model yet (see [no module hook])."""
        return self._auto is not None and self._auto.root is None and not self._life.closed

    def _wants_pass(self) -> bool:
        """Whether a model compiled whole in the scope gets inductor's pass."""
        return self.config.compile_ops and self.config.tier != "keep"

    def stats(self) -> Stats:
        """A snapshot of the counters (see :class:`~offloadd.Stats`)."""
        with self._lock:
            self._drain()
            self._writer.poll_copies()
            self._reader.pool.collect()
            self._writer.note_buffers()
            if self._host_cache:
                host_allocator.note_stats(self._stats)
            if self._codec is not None:
                self._codec.note_stats(self._stats)
            if self._backend is not None:
                self._stats.disk_bytes = self._backend.used_bytes
                self._stats.engine = self._backend.name
            snapshot = Stats(**self._stats.as_dict())
        self._ledger.flush_warnings()
        return snapshot

    def synchronize(self) -> None:
        """Wait until no write or read is in flight (e.g. before reading stats in a benchmark).

        Called between ops, it first captures what this thread packed and has not captured."""
        self._life.capture_all()
        with self._lock:
            copies = list(self._writer.pending_copies)
            # Copies from slots to the device, of live blocks and of freed ones whose slots
            # wait for them (see H2D in [device ordering]): their slots go back below.
            blocks = [*self._blocks, *self._writer.awaiting_copy]
            uploads = [b.slots_read for b in blocks if b.slots_read is not None]
        for copy in copies:  # async devices: copies, waited for without the lock
            copy.done(wait=True)
        for upload in uploads:
            upload.synchronize()
        with self._lock:
            self._ledger.wait_while(
                lambda: bool(self._writer.in_flight or self._blocks.any_loading()),
                "every write and read in flight",
                self._writer.stall_hint,
            )
            self._writer.poll_copies()
            self._drain()

    def close(self) -> None:
        """Finish in-flight I/O, release files and memory. Idempotent; also runs at exit."""
        if self._life.closed:
            return
        self._life.closed = True
        compiled.scopes_closed(self)
        if self._auto is not None:
            self._auto.detach()
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
