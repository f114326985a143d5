"""Edges of the tally and tier keep's shared storages (Note [the tally] in
offloadd/runtime/held.py), found by a hostile review: each with the C library and its twin."""

from __future__ import annotations

import gc
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from offloadd import Offloader
from offloadd.runtime import held

pytestmark = pytest.mark.unit

KIB16 = 64 * 64 * 4


def test_a_pack_refused_its_index_releases_nothing_it_did_not_take() -> None:
    """A Pack whose index has no parameter table raises, and leaves its other arguments'
    reference counts as they were (it once released borrowed ones: a crash at dealloc)."""
    if not held.NATIVE:
        pytest.fail("offloadd.runtime._held is not built (it must be wherever CI runs)")
    from offloadd.runtime import _held

    class Marks:
        num_pending = 0

    marks = Marks()
    before = gc.get_referrers(marks), sys.getrefcount(marks)
    for _ in range(3):
        with pytest.raises(AttributeError, match="_params"):
            _held.Pack(
                _held.Tally(), 0, object(), marks, marks, print, torch.Tensor,
                torch.nn.Parameter, torch.strided, print,
            )  # fmt: skip
    gc.collect()
    assert sys.getrefcount(marks) == before[1]


class _FreeOnDetach(TorchDispatchMode):
    """Stands for whatever may run while pack detaches a tensor (a collection, another
    thread's backward): frees the graph that held the storage's other saves."""

    def __init__(self, holder: list[torch.Tensor]) -> None:
        super().__init__()
        self.holder = holder
        self.fired = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func is torch.ops.aten.detach.default and self.holder and not self.fired:
            self.fired = True
            self.holder.clear()
        return func(*args, **(kwargs or {}))


def test_a_storage_released_while_saved_again_stays_counted(tally_kind: str) -> None:
    """The last other save of a storage goes while pack keeps a new one: the storage stays
    held (counted once), and is let go with that last save."""
    off = Offloader(tier="keep", min_bytes=0)
    x = torch.randn(64, 64, requires_grad=True)
    with off:
        y = x.sin()  # saves x
    holder = [y]
    del y
    mode = _FreeOnDetach(holder)
    with off, mode:
        z = x.cos()  # saves x again; y's graph goes during its detach
    assert mode.fired
    assert off.stats().resident_bytes == KIB16
    with off:
        w = x.sin()  # saves x once more
    assert off.stats().resident_bytes == KIB16  # the same storage, counted once
    del z
    assert off.stats().resident_bytes == KIB16  # w still holds it
    del w
    gc.collect()
    assert off.stats().resident_bytes == 0
    off.close()


def test_a_storage_left_through_data_is_not_taken_for_a_new_one(tally_kind: str) -> None:
    """``x.data = ...`` frees the storage a save of x was counted under; a new storage must not
    take its address and count as the same one (the entry pins it)."""
    off = Offloader(tier="keep", min_bytes=0)
    w = torch.randn(64, 64, requires_grad=True)
    x = torch.randn(64, 64)
    with off:
        y = w * x  # saves x (no grad: held as itself)
    first = x.untyped_storage()._cdata
    x.data = torch.randn(64, 64)
    kept: list[torch.Tensor] = []
    for _ in range(50):
        z = torch.randn(64, 64)
        assert z.untyped_storage()._cdata != first  # pinned: the address is not reused
        kept.append(z)
    with off:
        q = w * kept[0]
    st = off.stats()
    assert st.deduplicated_bytes == 0  # kept[0] is not x's first storage
    assert st.resident_bytes == 2 * KIB16  # x's first storage (y's graph holds it), kept[0]
    del y, q
    assert off.stats().resident_bytes == 0
    off.close()


def test_tier_keep_counts_any_storage_alike(tally_kind: str) -> None:
    """A conjugate view shares its storage like any other (C and Python alike)."""
    off = Offloader(tier="keep", min_bytes=0)
    x = torch.randn(16, dtype=torch.complex64, requires_grad=True)
    with off:
        loss = (x.conj() * x.conj()).abs().sum()  # mul saves the conj view twice
    st = off.stats()
    assert st.deduplicated_bytes == 16 * 8 and st.resident_bytes >= 16 * 8
    loss.backward()
    assert off.stats().resident_bytes == 0
    off.close()


def test_parameters_assigned_anew_are_learned(walks: list[int]) -> None:
    """``load_state_dict(assign=True)`` with an optimizer holding the old parameters: the
    index walks the model again at the next step (its marks are looked up by name)."""

    class Mul(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("scale", torch.rand(64, 64))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * self.scale

    model = nn.Sequential(nn.Linear(64, 64), Mul(), nn.Linear(64, 64))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    off = Offloader(tier="keep", min_bytes=0)

    def step() -> int:
        with off:
            y = model(torch.randn(64, 64, requires_grad=True))
        held_now = off.stats().resident_bytes
        y.sum().backward()
        opt.zero_grad()
        return held_now

    assert [step() for _ in range(3)] == [2 * KIB16] * 3  # the inputs of both Linears
    model.load_state_dict({k: v.clone() for k, v in model.state_dict().items()}, assign=True)
    assert [step() for _ in range(3)] == [2 * KIB16] * 3  # never the new buffer
    assert len(walks) == 2, walks
    off.close()


def test_a_read_back_refused_midway_releases_its_bytes(disk_dir: Path) -> None:
    """The engine refuses a read in the middle of a block (closed under a backward): unpack
    raises, and the block's read-back buffer is let go with the graph."""
    off = Offloader(tier="ssd", ssd_dirs=[str(disk_dir)], min_bytes=4096, chunk_bytes=1 << 20)
    x = torch.randn(1 << 22, requires_grad=True)
    with off:
        y = (x * 2).sin()
        z = y.sin()
    off.synchronize()
    backend = off.runtime.backend
    assert backend is not None
    submit, calls = backend.submit, [0]

    def refusing(req, **kwargs):  # type: ignore[no-untyped-def]
        calls[0] += 1
        if calls[0] >= 2:
            raise RuntimeError("offloadd: I/O engine is closed (test)")
        return submit(req, **kwargs)

    backend.submit = refusing  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="engine is closed"):
        z.sum().backward()
    backend.submit = submit  # type: ignore[method-assign]
    off.synchronize()
    del y, z
    gc.collect()
    assert off.stats().resident_bytes == 0
    off.close()


def test_saves_leave_no_objects_behind(tally_kind: str) -> None:
    """Each kind of save (a leaf, a parameter and a view of one, an output, pieces of one
    storage, a storage saved again) gives back every object it made once its graph goes: the
    interpreter's allocated blocks stay flat over hundreds of steps. csrc/tests/sanitize.sh runs
    without LeakSanitizer (CPython keeps memory for its life), so a reference leaked in the C
    hooks shows here (one a save: thousands of blocks)."""
    off = Offloader(tier="keep", min_bytes=0)
    torch.manual_seed(0)
    lin = nn.Linear(16, 16)
    cell = nn.LSTMCell(16, 16)
    x = torch.randn(4, 16, requires_grad=True)

    def step() -> None:
        with off:
            y = lin(x).sin()
            h, c = cell(y)
            z = (h * y.t().sum() + c).exp()
        z.sum().backward()

    for _ in range(30):
        step()
    gc.collect()
    before = sys.getallocatedblocks()
    for _ in range(300):
        step()
    gc.collect()
    assert sys.getallocatedblocks() - before < 100
    assert off.stats().resident_bytes == 0
    off.close()
