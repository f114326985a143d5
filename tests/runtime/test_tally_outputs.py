"""Tier keep counts each storage once (Note [the tally] in offloadd/runtime/held.py), whatever
shares it: an op's output saved again and through a view, and the pieces of one allocation
that ops split without views (``unsafe_chunk``: LSTM and GRU cells' gates). C and Python
alike."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

from offloadd import Offloader

pytestmark = pytest.mark.unit

KIB16 = 64 * 64 * 4


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


def _storages_held(forward: Callable[[], object]) -> int:
    """The bytes of the storages ``forward`` saves, each once, parameters and their views aside:
    what tier keep holds."""
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        base = t._base
        if not isinstance(t, nn.Parameter) and not isinstance(base, nn.Parameter):
            storages[t.untyped_storage()._cdata] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        forward()
    return sum(storages.values())


@pytest.mark.parametrize("batch", [1, 3])
def test_an_lstm_cells_gates_count_their_whole_storage(tally_kind: str, batch: int) -> None:
    """LSTMCell splits its gates with ``unsafe_chunk`` (outputs that are no views, sharing one
    storage) and saves each: the storage counts whole, once, as the Python twin counts it."""
    torch.manual_seed(0)
    cell = nn.LSTMCell(8, 16)
    x = torch.randn(batch, 8)
    expected = _storages_held(lambda: cell(x))
    off = Offloader(tier="keep", min_bytes=0)
    with off:
        h, c = cell(x)
    assert off.stats().resident_bytes == expected
    (h.sum() + c.sum()).backward()
    assert off.stats().resident_bytes == 0
    off.close()


def test_pieces_of_one_storage_count_it_whole(tally_kind: str) -> None:
    """Two pieces of one storage split without views (``unsafe_chunk``), both saved: the
    storage counts whole, once."""
    x = torch.randn(64, 64, requires_grad=True)
    off = Offloader(tier="keep", min_bytes=0)
    with off:
        a, b = (x * 2).unsafe_chunk(2, 0)
        y = a.sin() + b.sin()
    st = off.stats()
    assert st.resident_bytes == KIB16
    assert st.peak_resident_bytes == KIB16
    y.sum().backward()
    assert off.stats().resident_bytes == 0
    off.close()
