"""The training-side client: saved-tensor hooks that move activations out and back in time.

:class:`Runtime` is the machinery of one ``offloadd.Offloader`` (offloadd/offloader.py, the
class users call, which owns it): it builds the parts, one module each, and gives them to
:class:`~offloadd.runtime.hooks.Hooks` (pack and unpack, the hot path). The parts: ``handles``
(what pack returns), ``dedup`` (parameter storages, storages already saved), ``blocks``
(blocks, chunks, the block map), ``capture`` (when a saved tensor's bytes are taken),
``lifetime`` (capture and freeing), ``writer`` (slots, copies, writes), ``reader`` (loads,
forwarding, prefetch), ``ordering`` (device streams and events; ``simulated`` for CI),
``accounting`` (the lock and the counters), and a :class:`~offloadd.backend.base.Backend` (the
embedded engine or the daemon).
The optional stages, the budget planner and the codec, come in through ``stages``
(runtime/stages.py); ``offloadd.Offloader`` passes both.

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
from offloadd.runtime.hooks import Hooks
from offloadd.runtime.lifetime import Lifetime
from offloadd.runtime.ordering import CudaOrdering, Ordering
from offloadd.runtime.reader import Reader
from offloadd.runtime.shutdown import shutdown
from offloadd.runtime.stages import Coder, Planner, PlannerView, Stages
from offloadd.runtime.stats import Stats
from offloadd.runtime.thread_state import ThreadState
from offloadd.runtime.writer import Writer

__all__ = ["Runtime"]


class Runtime:
    """One Offloader's parts, its hooks, and its steps' entry and exit (``offloadd.Offloader``
    says what each does for the user; it owns one Runtime and nothing else subclasses or
    holds it). The parts are public to the runtime's modules, the tools and the tests."""

    def __init__(
        self,
        config: Config,
        *,
        io_engine: Engine | None = None,
        ordering: Ordering | None = None,
        stages: Stages | None = None,
    ) -> None:
        cfg = config
        stages = stages if stages is not None else Stages()
        stages.check(cfg)
        self.config = cfg
        self.ledger = ledger = Ledger(cfg.trim_host_bytes)
        self.lock = ledger.lock
        self.counts = counts = ledger.stats  # the live counters (stats() snapshots them)
        self.blocks = BlockMap()
        self.index = StorageIndex(cfg.dedup)
        self.tls = ThreadState()
        self._active_scopes = 0
        self.ordering: Ordering = ordering if ordering is not None else CudaOrdering()
        self.backend: Backend | None = open_backend(cfg, io_engine, ledger.warn_once)
        backend = self.backend
        if backend is not None:
            counts.buffered_io = backend.buffered
            counts.engine = backend.name
        self.writer = Writer(cfg, ledger, self.blocks, backend, self.ordering)
        self.reader = Reader(self.writer)
        self.life = life = Lifetime(self.index, self.writer, self.reader)
        self.captures = life.captures
        # With a budget: keep, offload or recompute per block (see [auto] in auto/planner.py).
        self.planner: Planner | None = None
        if cfg.budget is not None and stages.planner is not None:
            self.planner = stages.planner(cfg, PlannerView(ledger, self.tls))
            if self.writer.in_place is not None:  # see [room for writes]
                self.writer.in_place.room = self.planner.write_room
        # Lossy codes of some saved activations, opt-in (see [codes through the tiers]).
        self.codec: Coder | None = None
        if cfg.codec.name != "none" and stages.coder is not None:
            self.codec = stages.coder(cfg)
            counts.codec = cfg.codec.name
        self.hooks = Hooks(
            cfg,
            ledger=ledger,
            blocks=self.blocks,
            index=self.index,
            tls=self.tls,
            ordering=self.ordering,
            writer=self.writer,
            reader=self.reader,
            life=life,
            planner=self.planner,
            codec=self.codec,
        )
        # Last before the finalizer that releases it: a part refusing the config (the backend,
        # the writer) leaves torch's allocator alone.
        self.host_cache = host_allocator.open_for(cfg, ledger.warn_once)
        counts.host_allocator = "caching" if self.host_cache else "system"
        # Runs at close(), when the Offloader is collected, or at interpreter exit.
        self.finalizer = weakref.finalize(
            self, shutdown, backend, self.writer.pools, self.ordering, self.host_cache
        )

    @property
    def closed(self) -> bool:
        return self.life.closed

    def enter(self) -> None:
        """A scope begins on this thread (``Offloader.__enter__``)."""
        if self.life.closed:
            raise RuntimeError("offloadd: this Offloader is closed")
        transforms.check_enter()  # inside torch.func.grad & co. (see [torch.func in a scope])
        stack = self.tls.stack
        if stack is None:
            stack = self.tls.stack = []
        planner = self.planner
        if not stack:  # a forward begins (see [warm buffers] in io/pools.py)
            with self.lock:
                self.reader.pool.new_step()
                if planner is not None:
                    self.life.drain()  # the last step's releases: the planner reads what is held
                    if planner.plan_offloads is False:
                        self.reader.pool.release_idle()  # no block offloaded: no read-backs
                        self.writer.note_buffers()
            if planner is not None:
                planner.forward_begins()  # may refuse a budget no plan fits in, before any hook
        if self.backend is not None:
            self.backend.begin_step()  # the daemon client reconnects after a loss
        codec = self.codec
        if codec is None:
            hooks: Any = torch.autograd.graph.saved_tensors_hooks(*self.hooks.pair(self))
        else:
            if not stack:
                codec.begin_step()
            hooks = contextlib.ExitStack()
            hooks.enter_context(torch.autograd.graph.saved_tensors_hooks(*self.hooks.pair(self)))
            hooks.enter_context(codec.scope())
        hooks.__enter__()
        stack.append(hooks)
        with self.lock:
            self._active_scopes += 1
            if self._active_scopes == 1:
                self.index.step += 1  # parameters are learned again once (see dedup.py)
        if self._active_scopes == 1:
            compiled.scope_opened(self)  # see [no module hook] in compiled.py

    def exit(self, exc: tuple[object, object, object]) -> None:
        """The scope entered last on this thread ends (``Offloader.__exit__``)."""
        evicted.drop_claims(self)  # a compiled forward that raised after emptying a tensor
        stack = self.tls.stack
        if not stack:
            raise RuntimeError(
                "offloadd: Offloader exited more times than it was entered on this thread"
            )
        stack.pop().__exit__(*exc)
        if self.planner is not None and not stack:
            self.planner.forward_ends()
        start = time.perf_counter()
        self.life.capture_all()  # between ops: everything this thread packed has returned
        self.counts.pack_s += time.perf_counter() - start  # the forward's last copies and writes
        with self.lock:
            self._active_scopes -= 1
            closed = self._active_scopes == 0
            self.life.drain()
            self.writer.poll_copies()
        if closed:
            compiled.scopes_closed(self)
        self.ledger.flush_warnings()
        if (refused := transforms.refusal(exc[1])) is not None:
            raise refused  # torch.func.grad & co. called in the scope, caused by exc[1]

    def note_module(self, module: torch.nn.Module) -> None:
        """See ``Offloader.note_module``."""
        module = compiled.check_wrapper(self, module)
        with self.lock:
            self.index.note_module(module)
        if self.planner is not None and self.planner.root is None:
            self.planner.attach(module)
        compiled.check_children(self, module)

    def plan(self) -> Any:
        """See ``Offloader.plan``."""
        if self.planner is None:
            return None
        self.planner.settle()
        return self.planner.last_plan

    def awaits_model(self) -> bool:
        """Whether a budget's planner has no model yet (see [no module hook])."""
        return self.planner is not None and self.planner.root is None and not self.life.closed

    def wants_pass(self) -> bool:
        """Whether a model compiled whole in the scope gets inductor's pass."""
        return self.config.compile_ops and self.config.tier != "keep"

    def in_scope(self) -> bool:
        """Whether this thread is inside one of this runtime's scopes."""
        return bool(self.tls.stack)

    def stats(self) -> Stats:
        """A snapshot of the counters (see :class:`~offloadd.Stats`)."""
        with self.lock:
            self.life.drain()
            self.writer.poll_copies()
            self.reader.pool.collect()
            self.writer.note_buffers()
            if self.host_cache:
                host_allocator.note_stats(self.counts)
            if self.codec is not None:
                self.codec.note_stats(self.counts)
            if self.backend is not None:
                self.counts.disk_bytes = self.backend.used_bytes
                self.counts.engine = self.backend.name
            snapshot = Stats(**self.counts.as_dict())
        self.ledger.flush_warnings()
        return snapshot

    def synchronize(self) -> None:
        """See ``Offloader.synchronize``."""
        self.life.capture_all()
        with self.lock:
            copies = list(self.writer.pending_copies)
            # Copies from slots to the device, of live blocks and of freed ones whose slots
            # wait for them (see H2D in [device ordering]): their slots go back below.
            blocks = [*self.blocks, *self.writer.awaiting_copy]
            uploads = [b.slots_read for b in blocks if b.slots_read is not None]
        for copy in copies:  # async devices: copies, waited for without the lock
            copy.done(wait=True)
        for upload in uploads:
            upload.synchronize()
        with self.lock:
            self.life.settle()

    def close(self) -> None:
        """See ``Offloader.close``."""
        if self.life.closed:
            return
        self.life.closed = True
        compiled.scopes_closed(self)
        if self.planner is not None:
            self.planner.detach()
        self.ordering.synchronize_all()  # no copy may still target the slot pools
        if self.backend is not None:
            self.backend.close()
        with self.lock:
            self.life.drain()
        self.finalizer()

    def detach(self) -> None:
        """See ``Offloader.detach``."""
        self.finalizer.detach()
