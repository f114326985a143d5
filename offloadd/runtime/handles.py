"""What pack returns to autograd and unpack rebuilds from it.

A saved tensor becomes a :class:`Ref` to a block (plus its dtype, size, stride and storage
offset) or, when it is not worth moving, a ``Held`` that holds the tensor itself (held.py). Both
remember the tensor's version counter at pack.

Note: [freeing] Autograd drops a packed object when the graph frees that saved tensor (after the
node ran, or when the graph is released). A Ref's ``__del__`` only appends it to a deque; the
bookkeeping runs under the lock at the next pack, unpack, stats() or close() (see
``Lifetime.drain`` in lifetime.py), never inside a garbage-collector callback that might interrupt our own
critical section.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import torch
from torch.nn.parameter import is_lazy
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from offloadd.runtime.blocks import Block

__all__ = [
    "HoldsNoBytes",
    "Ref",
    "describe",
    "inplace_error",
    "movable_storage",
    "nbytes_of",
    "storage_bytes",
    "storage_of",
    "unlinked",
    "version_handle",
    "view",
]

_INPLACE_HINT = (
    "Hint: the backtrace further above shows the operation that failed to compute its gradient. "
    "The variable in question was changed in there or anywhere later. Good luck!"
)


def inplace_error(t_desc: str, saved: int, now: int) -> RuntimeError:
    """PyTorch's own error for a saved tensor changed in place, word for word."""
    return RuntimeError(
        "one of the variables needed for gradient computation has been modified by an inplace "
        f"operation: [{t_desc}] is at version {now}; expected version {saved} instead. "
        + _INPLACE_HINT
    )


def describe(t: torch.Tensor) -> str:
    return f"{t.type()} {list(t.shape)}"


def unlinked(t: torch.Tensor) -> torch.Tensor:
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


_BELOW_INPLACE_OR_VIEW = getattr(torch._C, "_AutoDispatchBelowADInplaceOrView", None)


def version_handle(t: torch.Tensor) -> torch.Tensor | None:
    """A tensor without storage that shares ``t``'s version counter (None if this torch cannot
    make one without bumping the counter). See [the version handle] in capture.py."""
    if _BELOW_INPLACE_OR_VIEW is None:
        return None
    h = t.detach()
    with _BELOW_INPLACE_OR_VIEW():  # below the kernel that bumps versions: set_ leaves it alone
        h.set_(torch.empty(0, dtype=t.dtype, device=t.device).untyped_storage())
    return h


class Ref:
    """A saved tensor whose storage is a block: offloaded, or held as is and only counted (a
    plan's keep, tier keep without dedup; tier keep otherwise holds a ``Held``, held.py)."""

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

    def __init__(self, block: Block, t: torch.Tensor, released: deque[Any], keep: bool) -> None:
        self.block = block
        self.tensor = unlinked(t) if keep else None
        self.dtype = t.dtype
        self.size = t.size()
        self.stride = t.stride()
        self.offset = t.storage_offset()
        self.version = t._version
        self.desc = describe(t)
        self.gen = -1
        self.released = released

    def __del__(self) -> None:
        self.released.append(self)


def view(buf: torch.Tensor, ref: Ref) -> torch.Tensor:
    """The saved tensor, rebuilt on ``buf`` with its exact dtype, size, stride and offset."""
    itemsize = ref.dtype.itemsize
    byte_offset = buf.storage_offset() + ref.offset * itemsize
    out = torch.empty(0, dtype=ref.dtype, device=buf.device)
    out.set_(buf.untyped_storage(), byte_offset // itemsize, ref.size, ref.stride)
    return out


class HoldsNoBytes:
    """A mixin for tensor subclasses whose bytes are elsewhere and must not be asked for
    (``offloadd.relay``'s placeholder): :func:`storage_of` gives None for them, untouched."""


def storage_of(t: torch.Tensor) -> torch.UntypedStorage | None:
    """The storage of a materialized, strided, non-meta tensor, else None (never raises)."""
    if isinstance(t, HoldsNoBytes) or is_lazy(t) or t.layout is not torch.strided or t.is_meta:
        return None
    try:
        return t.untyped_storage()
    except Exception:  # no storage of its own (functorch wrappers, some subclasses)
        return None


def movable_storage(t: torch.Tensor, host_to_host: bool) -> torch.UntypedStorage | None:
    """The storage of a plain dense CPU/CUDA tensor that can be moved and rebuilt, else None.

    ``host_to_host``: moving this tensor would copy host memory to host memory (the cpu tier,
    a tensor already in host memory), which saves nothing."""
    if (
        t.device.type not in ("cpu", "cuda")
        or host_to_host
        or t.is_quantized
        or t.is_conj()
        or t.is_neg()
    ):
        return None
    return storage_of(t)


def nbytes_of(t: torch.Tensor) -> int:
    """Bytes of a tensor offloadd does not move, for the stats; 0 where it has no such size.

    A wrapper subclass counts the tensors it wraps, which are what this process holds: a
    DTensor its local shard (its own ``nbytes`` is the global size, world-size times the shard
    of a sharded one), a TwoTensor both halves."""
    if is_traceable_wrapper_subclass(t):
        try:
            names, _ = t.__tensor_flatten__()
            inner = [getattr(t, name) for name in names]
        except Exception:  # a subclass whose flatten needs more than a plain call
            inner = None
        if inner is not None:
            return sum(nbytes_of(x) for x in inner if isinstance(x, torch.Tensor))
    if t.layout is not torch.strided:
        return 0
    try:
        return int(t.nbytes)
    except Exception:  # symbolic or data-dependent sizes (tracing)
        return 0


def storage_bytes(t: torch.Tensor) -> torch.Tensor:
    """All bytes of ``t``'s storage, as a flat uint8 tensor on its device."""
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())
