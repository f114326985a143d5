"""Pack and unpack's side of a compiled graph's saved tensors emptied in the graph (Note
[emptied in the graph] in graph_ops.py): light, so that eager users never import inductor."""

from __future__ import annotations

import sys
import threading
import weakref
from typing import Any

import torch
from torch import Tensor

from offloadd.runtime.blocks import Out
from offloadd.runtime.handles import Ref
from offloadd.runtime.identity import version_handle

__all__ = [
    "Evicted",
    "claim",
    "claims",
    "drop_claims",
    "live",
    "note",
    "pending",
    "placeholder",
    "take_placed",
    "tls",
]


class _Local(threading.local):
    """``claims``: what evict packed on this thread, until pack claims it. A class default, so
    that pack's test for it raises no AttributeError inside getattr, a cost per saved tensor
    (docs/benchmarks/hooks_cpu-2core_2026-12-05.md)."""

    claims: dict[int, Any] | None = None


_tls = _Local()
_lock = threading.Lock()
_placed: dict[int, Evicted] = {}  # placeholders unpack made, until fetch reads them back


class Evicted:
    """What pack returns for a tensor emptied in a compiled graph: the Offloader and the
    :class:`~offloadd.runtime.handles.Ref` evict packed (which has the tensor's geometry)."""

    __slots__ = ("off", "ref")

    def __init__(self, off: Any, ref: Ref) -> None:
        self.off = off
        self.ref = ref


class _Claim:
    __slots__ = ("block", "geometry", "off", "packed", "storage")

    def __init__(self, off: Any, packed: Any, storage: Any, block: Any, geometry: Any) -> None:
        self.off = off
        self.packed = packed
        # Held until claimed: its address (the key) is not reused by another storage meanwhile.
        self.storage = storage
        self.block = block  # while the block may still read the storage's pages
        self.geometry = geometry  # claimed only by a tensor of the same (another alias: not)


def tls() -> threading.local:
    """This module's thread-local state: ``claims`` is set and not empty while this thread has
    anything to claim (read by pack's C fast path, see hooks.py)."""
    return _tls


def claims() -> dict[int, _Claim]:
    """This thread's claims, by storage (its ``_cdata``)."""
    d: dict[int, _Claim] | None = getattr(_tls, "claims", None)
    if d is None:
        d = _tls.claims = {}
    return d


def note(off: Any, t: Tensor, packed: Any, storage: Any, block: Any) -> None:
    """What evict packed for ``t`` (``block``: the storage is emptied once that block no longer
    reads it), and empty what can be emptied now."""
    c = claims()[storage._cdata] = _Claim(off, packed, storage, block, _geometry(t))
    waiting: list[_Claim] = _tls.__dict__.setdefault("waiting", [])
    if block is not None:
        waiting.append(c)
    _empty(waiting)


def _empty(waiting: list[_Claim]) -> None:
    """Empty the storages whose blocks no longer read them (see [zero-copy] in
    writer_in_place.py: a write from the tensor's own pages holds it until it completes)."""
    keep = []
    for c in waiting:
        block = c.block
        if block is None:
            continue  # claimed while its write still ran
        if block.direct_source is None and (block.out is Out.CAPTURED or block.out is Out.DROPPED):
            if c.storage.nbytes() == block.nbytes and not block.modified:
                c.storage.resize_(0)
            c.block = None
        else:
            keep.append(c)
    waiting[:] = keep


def _geometry(t: Tensor) -> tuple[Any, ...]:
    return (t.dtype, t.size(), t.stride(), t.storage_offset())


def pending() -> bool:
    """Whether this thread has anything to claim (pack's test: one attribute read)."""
    return bool(getattr(_tls, "claims", None))


def claim(t: Tensor) -> Any:
    """What evict packed for ``t`` on this thread, or None: an :class:`Evicted` if its block is
    offloaded (emptied in the graph, or still being written from its own pages: either way its
    backward's fetch reads it back, when it is due), else what pack returned (kept)."""
    d = claims()
    waiting = getattr(_tls, "waiting", None)
    if waiting:
        _empty(waiting)
    key = t.untyped_storage()._cdata
    c = d.get(key)
    if c is None or c.geometry != _geometry(t):
        return None
    del d[key]
    c.block = None  # if its write still runs, t is freed when it completes, as in eager
    if not d:
        _tls.waiting = []
    packed = c.packed
    if type(packed) is Ref and packed.tensor is None:  # offloaded: its fetch reads it back
        # Versions from here on are those of the tensor autograd saves, which may be another
        # alias of the buffer evict saw, with a counter of its own (inductor's
        # reinterpret_tensor): an in-place change after the save is checked against it.
        with c.off.lock:
            block = packed.block
            block.handle = version_handle(t)
            block.version = packed.version = t._version
            return Evicted(c.off, packed)
    return packed


def drop_claims(off: Any) -> None:
    """At ``off``'s scope exit: drop what a forward that raised after evict left unclaimed."""
    d = getattr(_tls, "claims", None)
    if d:
        for key in [k for k, c in d.items() if c.off is off]:
            del d[key]
        _tls.waiting = [c for c in getattr(_tls, "waiting", ()) if c.off is not off]


def placeholder(ev: Evicted) -> Tensor:
    """The saved tensor, without bytes, for the compiled backward: its fetch reads it back.

    Under compiled autograd, which traces AOTAutograd's backward as it was before inductor's
    passes (no fetch), the tensor itself, read back now."""
    ca = sys.modules.get("torch._dynamo.compiled_autograd")
    if ca is not None and (ca.compiled_autograd_enabled or ca.in_compiled_autograd_region):
        t: Tensor = ev.off.hooks.unpack(ev.ref)
        return t
    ref = ev.ref
    t = torch.empty(0, dtype=ref.dtype)
    # set_ allocates what the geometry needs, so data_ptr is aligned (inductor checks it)
    t.set_(torch.UntypedStorage(ref.block.nbytes), ref.offset, ref.size, ref.stride)
    storage = t.untyped_storage()
    storage.resize_(0)
    key = storage._cdata
    with _lock:
        _placed[key] = ev
    weakref.finalize(t, take_placed, key)  # a backward that raised before its fetch
    return t


def take_placed(key: int) -> Evicted | None:
    with _lock:
        return _placed.pop(key, None)


def live() -> int:
    """Claims (this thread's) and placeholders not yet taken: 0 once every graph ran."""
    with _lock:
        return len(claims()) + len(_placed)
