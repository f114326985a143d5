"""The hooks torch calls for each saved tensor: pack (keep it, or give it a block that moves)
and unpack (check it, or have the reader bring it back), with and without a codec.

:class:`Hooks` holds only the hot path, over the parts it is given;
:class:`~offloadd.runtime.runtime.Runtime` builds those parts and owns it.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from offloadd.config import Config
from offloadd.runtime import evicted, held, transforms
from offloadd.runtime.accounting import Ledger
from offloadd.runtime.blocks import BlockMap, Out
from offloadd.runtime.compiled import is_traced, refuse_codec, unseen, wrapper_on_stack
from offloadd.runtime.dedup import StorageIndex
from offloadd.runtime.evicted import Evicted
from offloadd.runtime.handles import Ref
from offloadd.runtime.hook_stack import PASSES_TO
from offloadd.runtime.identity import (
    Facts,
    describe,
    inplace_error,
    is_parameter,
    nbytes_of,
    unlinked,
    version_handle,
)
from offloadd.runtime.lifetime import Lifetime
from offloadd.runtime.ordering import Ordering
from offloadd.runtime.reader import Reader
from offloadd.runtime.stages import Coder, Planner
from offloadd.runtime.thread_state import ThreadState
from offloadd.runtime.writer import Writer
from offloadd.trace import span

__all__ = ["Hooks"]

_Parameter = torch.nn.Parameter


class Hooks:
    """pack and unpack over the parts of one Offloader, given at construction."""

    def __init__(
        self,
        config: Config,
        *,
        ledger: Ledger,
        blocks: BlockMap,
        index: StorageIndex,
        tls: ThreadState,
        ordering: Ordering,
        writer: Writer,
        reader: Reader,
        life: Lifetime,
        planner: Planner | None,
        codec: Coder | None,
    ) -> None:
        self.config = config
        self._min_bytes = config.min_bytes
        self._ledger = ledger
        self._lock = ledger.lock
        self._stats = ledger.stats
        self._blocks = blocks
        self._index = index
        self._tls = tls
        self._ordering = ordering
        self._writer = writer
        self._reader = reader
        self._life = life
        self._released = life.released  # refs released (see [freeing] in handles.py)
        self._tally = life.tally  # tensors kept as they are (see [the tally] in held.py)
        self._captures = life.captures
        self._drain = life.drain
        self._closed = lambda: life.closed
        self._auto = planner
        # Tier keep: every saved tensor held where it is, its storage counted once, no block
        # (see [the tally] in held.py). Without dedup, each save counts its storage: blocks.
        self._share = config.tier == "keep" and planner is None and config.dedup
        self._codec = codec
        self._coded_type = codec.handle_type if codec is not None else None

    def pair(self, owner: Any) -> tuple[Any, Any]:
        """What torch calls; dynamo never traces them (see [invisible to dynamo] in compiled.py).
        Made at each entry: kept on the runtime, they would make a cycle with it, and an
        Offloader must go when its last reference does (see [shutdown] in shutdown.py).
        ``owner`` (the runtime) is what a compiled graph's evict reaches through the pack.

        Without a codec and with offloadd's C library, the hooks are its ``Pack`` and
        ``Unpack``: a small plain tensor (under tier keep, any plain tensor but one the index
        must first be asked about) is kept and given back without a Python frame, and anything else goes on to :meth:`pack` and :meth:`unpack` (see [the tally] in held.py;
        ``offloadd bench hooks`` measures both)."""
        pack: Any
        unpack: Any
        if self._codec is not None:
            pack = unseen(self._pack_coded)
            unpack = unseen(self._unpack_coded)
        elif held.NATIVE:
            pack = held.Pack(
                self._tally,
                self._min_bytes,
                self._index if self._share else None,
                self._captures,
                evicted.tls(),
                unseen(self.pack),
                torch.Tensor,
                torch.nn.Parameter,
                torch.strided,
                is_parameter,
            )
            unpack = held.Unpack(unseen(self.unpack))
        else:
            pack, unpack = unseen(self.pack), unseen(self.unpack)
        if self._codec is None:
            pack.offloader = owner  # evict's (graph_ops.py)
        setattr(pack, PASSES_TO, True)
        return pack, unpack

    # -- pack ------------------------------------------------------------------------------

    def pack(self, t: torch.Tensor, min_bytes: int = -1, facts: Facts | None = None) -> Any:
        """``facts``: what the codec already asked of ``t`` (Note [asked once] in identity.py)."""
        if min_bytes < 0:
            min_bytes = self._min_bytes
        if self._captures.num_pending:  # the copies and writes of earlier saves (timed)
            start = time.perf_counter()
            self._life.capture_due()
            self._stats.pack_s += time.perf_counter() - start
        if evicted.pending() and type(t) is torch.Tensor:
            claimed = evicted.claim(t)  # packed in a compiled graph (see graph_ops.py)
            if claimed is not None:
                return claimed
        storage = None
        if type(t) is _Parameter:  # held by the model anyway
            return self._tally.keep(t, nbytes_of(t), 0)
        if type(t) is torch.Tensor and t.layout is torch.strided and not t.is_meta:
            nbytes = t.nbytes
            if nbytes >= min_bytes and nbytes:
                if transforms.holds_no_bytes(t):
                    nbytes = 0  # forward AD's zero tangent: no storage (see [zero tangents])
                else:
                    if facts is None:
                        facts = Facts(t)
                    if self._share:  # tier keep: nothing moves, any storage is held alike
                        storage = facts.storage
                    else:
                        host_to_host = self.config.tier == "cpu" and not self._ordering.is_async(
                            t.device
                        )
                        storage = facts.movable(t, host_to_host)
        else:  # subclasses (DTensor…), sparse, nested: kept as they are
            if is_traced(t):
                return t  # fake, functional, meta: untouched (see [invisible to dynamo])
            nbytes = nbytes_of(t)
        if storage is None:  # kept as it is (see [the tally] in held.py)
            param = facts.parameter if facts is not None else is_parameter(t)
            return self._tally.keep(t, nbytes, 0 if param else nbytes)
        assert facts is not None
        if self._share:  # tier keep: no block either (see [the tally])
            with self._lock:
                param = self._index.backs_parameter(t, facts)
            return self._tally.keep(t, nbytes, 0) if param else self._tally.share(t, nbytes)
        # Timed from here on (Stats.pack_s): tensors that may move. A kept small one is not
        # timed: the clock's reads would be a noticeable part of its cost (bench hooks).
        start = time.perf_counter()
        try:
            with span("offloadd::pack"):
                return self._pack_block(t, facts, nbytes)
        finally:
            self._stats.pack_s += time.perf_counter() - start

    def _pack_block(self, t: torch.Tensor, facts: Facts, nbytes: int) -> Any:
        """The pack of a tensor that may move (``facts.storage``): its block (new, or shared
        through dedup)."""
        storage = facts.storage
        assert storage is not None
        st = self._stats
        keep = self.config.tier == "keep"
        auto = self._auto
        if auto is not None and not keep:
            keep = getattr(self._tls, "keep", False)  # the block's decision
        with self._lock:
            self._drain()
            self._writer.poll_copies()
            index = self._index
            if index.backs_parameter(t, facts):
                # Held by the model anyway: kept, but not activation memory of ours.
                return self._tally.keep(t, nbytes, 0)
            st.saved_tensors += 1
            st.saved_bytes += nbytes
            key = index.key(t, facts)
            block = index.lookup(key, facts.root)  # see [dedup identity] in dedup.py
            if block is not None:
                block.refs += 1
                st.deduplicated_bytes += nbytes
                return Ref(block, t, self._released, keep=block.kept)  # its first save decides
            skew = self._writer.skew_of(t.device, storage.data_ptr())
            block = self._blocks.new(storage.nbytes(), t.device, self.config.chunk_bytes, skew)
            index.remember(key, storage, facts.root, block)
            if auto is not None:
                self._note_saved(auto, block.nbytes)
            if keep:
                block.kept = True
                block.move_out(Out.HELD)  # where it is, by the ref; never captured
                block.resident_bytes = block.nbytes
                self._ledger.add_resident(block.nbytes, kept=True)
                st.kept_bytes += nbytes
                return Ref(block, t, self._released, keep=True)
            # Pending until the op that saved it has returned (see capture.py).
            block.source = unlinked(t)
            block.handle = version_handle(t)
            block.source_ptr = storage.data_ptr()
            block.version = t._version
            if self._ordering.is_async(t.device):
                block.stream = self._ordering.producer(t.device)
            self._ledger.add_resident(block.nbytes)
        self._captures.add(block)
        return Ref(block, t, self._released, keep=False)

    def _pack_coded(self, t: torch.Tensor) -> Any:
        """pack with a codec: encoded where [what gets compressed] in codec/allowlist.py allows it
        and the storage is not already saved exactly, else :meth:`pack`. What it asks of ``t``
        is asked once (Note [asked once] in identity.py)."""
        codec = self._codec
        assert codec is not None
        if wrapper_on_stack() is not None:  # a model compiled whole (a walk of the stack)
            raise refuse_codec(self.config.codec.name)
        facts = Facts(t) if codec.wants(t) else None
        if (
            facts is not None
            and facts.storage is not None
            and not codec.saved_exactly(t, facts)
            and not self._backs_parameter(t, facts)
        ):
            big = t.nbytes >= self._min_bytes
            coded = codec.pack(t, facts, self._pack_codes if big else self.pack, self.pack)
            if coded is not None:
                return coded
        packed = self.pack(t, facts=facts)
        codec.note_exact(t, facts)
        return packed

    def _pack_codes(self, codes: torch.Tensor) -> Any:
        """The codes of an activation that is itself worth moving move whatever their size."""
        return self.pack(codes, 1)

    def _backs_parameter(self, t: torch.Tensor, facts: Facts) -> bool:
        with self._lock:
            return self._index.backs_parameter(t, facts)

    def _unpack_coded(self, packed: Any) -> torch.Tensor:
        if type(packed) is self._coded_type:
            assert self._codec is not None
            return self._codec.unpack(packed, self.unpack)
        return self.unpack(packed)

    def _note_saved(self, auto: Planner, nbytes: int) -> None:
        tag = getattr(self._tls, "tag", None)
        if tag is not None:
            auto.saved(tag, nbytes)

    # -- unpack ----------------------------------------------------------------------------

    def unpack(self, packed: Any) -> torch.Tensor:
        if type(packed) is held.Held:
            t = packed.tensor
            if t._version != packed.version:
                raise inplace_error(describe(t), packed.version, t._version)
            return t
        if type(packed) is not Ref:
            if type(packed) is Evicted:
                return evicted.placeholder(packed)  # its compiled backward fetches it
            return packed  # a traced tensor pack passed through (see [invisible to dynamo])
        ref: Ref = packed
        if ref.tensor is not None:  # a kept block (see Ref)
            t = ref.tensor
            if t._version != ref.version:
                raise inplace_error(ref.desc, ref.version, t._version)
            return t
        start = time.perf_counter()  # Stats.unpack_s: offloaded tensors only (see pack)
        try:
            with span("offloadd::unpack"):
                return self._reader.unpack(ref, self._drain, self._closed)
        finally:
            self._stats.unpack_s += time.perf_counter() - start
