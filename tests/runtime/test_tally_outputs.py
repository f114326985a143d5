"""Tier keep's ops' outputs, keyed without their storage objects (Note [an output's storage]
in offloadd/runtime/held.py)."""

from __future__ import annotations

import gc

import pytest
import torch

from offloadd import Offloader
from offloadd.runtime import held

pytestmark = pytest.mark.unit

KIB16 = 64 * 64 * 4


def _storage_objects() -> int:
    gc.collect()
    return sum(1 for o in gc.get_objects() if isinstance(o, torch.UntypedStorage))


def test_outputs_saved_again_and_viewed_count_once(tally_kind: str) -> None:
    """An output saved by two ops and, through a view, by a third counts its bytes once; the C
    pack and its Python twin agree."""
    off = Offloader(tier="keep", min_bytes=0)
    x = torch.randn(64, 64, requires_grad=True)
    with off:
        y = x * 2  # an output: no grad_fn saves it yet
        a = y.sin() + y.cos()  # saves y twice
        b = torch.mm(y.t(), y)  # saves y's transpose (a view) and y
        loss = (a.sum() + b.sum()).mul(1e-6).exp()  # exp saves its own (0-d) output
    st = off.stats()
    assert st.resident_bytes == KIB16 + 4  # y's storage once, and exp's 4 bytes
    assert st.deduplicated_bytes == 3 * KIB16
    loss.backward()
    assert off.stats().resident_bytes == 0
    ref = torch.randn(64, 64, requires_grad=True)
    with torch.no_grad():
        ref.copy_(x)
    yr = ref * 2
    ((yr.sin() + yr.cos()).sum() + torch.mm(yr.t(), yr).sum()).mul(1e-6).exp().backward()
    assert torch.equal(x.grad, ref.grad)  # type: ignore[arg-type]
    off.close()


def test_outputs_make_no_storage_objects() -> None:
    """Saving ops' outputs under tier keep makes no storage object for the collector to track;
    a view's save makes one, and pins its entry."""
    if not held.NATIVE or getattr(torch._C, "_storage_address", None) is None:
        pytest.skip("needs offloadd's C library and torch._C._storage_address")
    off = Offloader(tier="keep", min_bytes=0)
    x = torch.randn(64, 64, requires_grad=True)
    before = _storage_objects()
    with off:
        y = (x * 2).sin().exp()  # sin saves x * 2, exp its own output
    assert _storage_objects() == before
    assert off.stats().resident_bytes == 2 * KIB16
    with off:
        z = y.t().sin()  # saves a view of exp's output: its storage, asked
    assert _storage_objects() == before + 1
    assert off.stats().resident_bytes == 2 * KIB16  # the same storage, counted once
    (y.sum() + z.sum()).backward()
    assert off.stats().resident_bytes == 0
    off.close()


def test_an_attribute_set_on_torch_tensor_is_read_as_python_would(
    tally_kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The C pack reads tensor attributes through getters it found on ``torch.Tensor`` (Note
    [attributes read directly]); one set on the class later is what it reads, as getattr would,
    and the getters are found again once it is gone."""
    off = Offloader(tier="keep", min_bytes=0)
    x = torch.randn(64, 64, requires_grad=True)
    with off:
        a = (x * 2).sin()
    assert off.stats().saved_bytes == KIB16
    with monkeypatch.context() as patch:
        patch.setattr(torch.Tensor, "nbytes", property(lambda self: 7), raising=False)
        with off:
            b = (x * 3).sin()
    assert off.stats().saved_bytes == KIB16 + 7
    with off:
        c = (x * 4).sin()
    assert off.stats().saved_bytes == 2 * KIB16 + 7
    del a, b, c
    assert off.stats().resident_bytes == 0
    off.close()
