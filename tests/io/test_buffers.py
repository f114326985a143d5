"""The staging buffers' lifetime: memory is unmapped only once nothing views it."""

from __future__ import annotations

import gc
import weakref

from offloadd.io.buffers import AlignedBuffer, SlotPool


def test_a_buffer_closed_while_viewed_is_unmapped_when_its_last_view_dies() -> None:
    """``torch.frombuffer`` over an mmap holds no buffer export, so closing the mmap used to
    unmap it under live tensors (reading one then faulted). A view made before close (a
    staging slot a writer still copies from when a daemon link is dropped) stays readable;
    the memory goes with the last view."""
    buf = AlignedBuffer(8192)
    mapping = weakref.ref(buf._mmap)  # type: ignore[arg-type]
    view = buf.tensor[4096:]
    view.fill_(7)
    buf.close()
    assert buf._mmap is None and mapping() is not None  # still mapped: viewed
    assert int(view.sum()) == 7 * 4096
    del view
    gc.collect()
    assert mapping() is None  # unmapped with its last view


def test_a_pool_closed_unviewed_unmaps_at_once() -> None:
    pool = SlotPool(4 * 4096, 4096)
    pool.tensor(pool.acquire() or 0, 16).fill_(1)  # a view made and dropped
    mapping = weakref.ref(pool.buffer._mmap)  # type: ignore[arg-type]
    pool.close()
    assert mapping() is None
