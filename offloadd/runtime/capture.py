"""When the bytes of a saved tensor are taken: once the op that saved it has returned.

Note: [capture after the op] Autograd calls the pack hook when it *saves* a tensor, and for an
op's inputs that is before the op's kernel runs. Most kernels never write their inputs, but some
fill a buffer they were handed and also saved: ``rrelu_with_noise`` saves ``noise`` and then
writes the random slopes into it, without bumping its version counter. Without hooks autograd
keeps a reference and reads the bytes at backward, once the kernel has long finished; a copy
taken inside pack would hold the bytes from *before* the kernel, a silently wrong gradient.

So pack only records the tensor, its version counter and (CUDA) the stream it was produced on;
the copy is issued once the op has returned. The op that saved a tensor has returned when any of
these holds, and the capture happens at the first of them:

* a later pack on the same thread belongs to another autograd node. Autograd numbers the nodes
  it creates per thread (``torch.autograd._get_sequence_nr()`` is the number the next node will
  get), and an op creates its node before it saves anything, so a pack with a larger number than
  a pending tensor's comes from a later op;
* the thread leaves the offloading scope (``Offloader.__exit__``) or calls ``synchronize()``:
  both run between ops;
* backward unpacks it before any of that happened (another thread's backward, say): then unpack
  uses the tensor itself, checked like a kept one, and nothing is copied yet.

At capture the version counter must still be the one recorded at pack; if it moved, the tensor
was changed in place after it was saved, and unpack raises PyTorch's in-place error, exactly as
autograd does without hooks. On CUDA the producer event is recorded at capture on the stream
recorded at pack, i.e. after the op's kernels were queued (see [device ordering] in ordering.py).

Note: [the version handle] The node number has one gap: an op that creates a node between its
saves and its kernel. ``a.mul_(b)`` saves ``b``, then clones the original ``a`` (a new node, a
larger number) before its kernel runs; ``_foreach_mul_`` saves every element before its one
kernel. A save of such an op may be captured before the kernel ran. Those kernels are in-place
ops: they bump the version of what they write. So each offloaded block also keeps a *version
handle*, a tensor without storage that shares the saved tensor's version counter (made below
the dispatch key that bumps versions, so making it bumps nothing), and unpack compares it with
the version recorded at pack. Any in-place change between save and backward, before or after
capture, raises PyTorch's error, as autograd does without hooks; a copy taken too early can
therefore only be wrong for a kernel that writes a buffer it saved *without* bumping its
version, and such a kernel (rrelu's) creates no node before it runs. What remains outside any
version check, with or without hooks, is a write that bypasses the counter (``x.data``, ``set_``,
the storage) or a kernel like rrelu's writing into a buffer that an earlier op saved: eager
PyTorch then uses the live bytes, offloadd the bytes captured (docs/how-it-works.md, "Known limit").

Until capture, unpack returns a view of the saved tensor itself (sharing its version counter, so
that a graph built on it by double backward still sees later in-place changes).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["CaptureQueue", "next_node_number"]


def _sequence_nr_function() -> Callable[[], int] | None:
    fn = getattr(torch.autograd, "_get_sequence_nr", None)
    if fn is None:  # pragma: no cover - present in every torch offloadd supports
        fn = getattr(torch._C._autograd, "_get_sequence_nr", None)
    return fn


_SEQUENCE_NR = _sequence_nr_function()


def next_node_number() -> int:
    """The number autograd gives the next node created on this thread (-1 if unknown).

    Without the counter every pending tensor waits for the scope's end: still exact, but its
    memory is held through the forward."""
    return _SEQUENCE_NR() if _SEQUENCE_NR is not None else -1


class CaptureQueue:
    """Per-thread lists of packed tensors whose op may not have returned yet.

    Items are opaque to the queue (the Offloader's blocks); each is queued with the node number
    current at its pack. ``num_pending`` is a hint shared by all threads, cheap to test on the
    hot path; the lists themselves are thread-local, since an op only ever runs on one thread."""

    def __init__(self) -> None:
        self._tls = threading.local()
        self.num_pending = 0

    def _items(self) -> deque[tuple[int, Any]]:
        q: deque[tuple[int, Any]] | None = getattr(self._tls, "q", None)
        if q is None:
            q = self._tls.q = deque()
        return q

    def add(self, item: Any) -> None:
        """Queue ``item``, packed just now on this thread."""
        self._items().append((next_node_number(), item))
        self.num_pending += 1

    def due(self) -> list[Any]:
        """This thread's items whose op has returned (packed under an earlier node number)."""
        q: deque[tuple[int, Any]] | None = getattr(self._tls, "q", None)
        if not q:
            return []
        now = next_node_number()
        out = []
        while q and 0 <= q[0][0] < now:
            out.append(q.popleft()[1])
        self.num_pending -= len(out)
        return out

    def take_all(self) -> list[Any]:
        """Every item of this thread (its ops have all returned: the caller is between ops)."""
        q: deque[tuple[int, Any]] | None = getattr(self._tls, "q", None)
        if not q:
            return []
        out = [item for _, item in q]
        q.clear()
        self.num_pending -= len(out)
        return out
