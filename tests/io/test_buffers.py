"""The staging buffers' lifetime: memory is unmapped only once nothing views it."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from offloadd.io.buffers import AlignedBuffer, SlotPool, copy_bytes


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


@pytest.mark.parametrize("nbytes", [0, 1, 4095, 64 << 10, 3 << 20])  # 3 MiB: the GIL released
def test_copy_bytes_copies_exactly_the_bytes_asked(nbytes: int) -> None:
    src = torch.randint(0, 256, (nbytes + 64,), dtype=torch.uint8)
    dst = torch.zeros(nbytes + 64, dtype=torch.uint8)
    copy_bytes(dst.data_ptr() + 7, src.data_ptr() + 3, nbytes)
    assert torch.equal(dst[7 : 7 + nbytes], src[3 : 3 + nbytes])
    assert not dst[:7].any() and not dst[7 + nbytes :].any()


def test_the_native_copy_refuses_what_it_cannot_copy() -> None:
    native = pytest.importorskip("offloadd.io._native")
    assert copy_bytes is native.copy  # the build in use: ctypes' costs a microsecond more
    buf = torch.zeros(8, dtype=torch.uint8)
    with pytest.raises(ValueError, match="nbytes must be >= 0, got -1"):
        native.copy(buf.data_ptr(), buf.data_ptr(), -1)
    with pytest.raises(ValueError, match="an address is 0"):
        native.copy(0, buf.data_ptr(), 8)
    with pytest.raises(TypeError, match="takes 3 arguments, got 2"):
        native.copy(buf.data_ptr(), buf.data_ptr())  # type: ignore[call-arg]
    native.copy(0, 0, 0)  # nothing to copy: no address read
