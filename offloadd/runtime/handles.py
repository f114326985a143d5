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

from offloadd.runtime.blocks import Block
from offloadd.runtime.identity import describe, unlinked

__all__ = ["Ref", "view"]


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
