"""GPUDirect Storage (kvikio): CUDA tensors written and read without host staging.

The GPU tests skip where a GPU, kvikio or cuFile is missing; the error path runs everywhere.
"""

from __future__ import annotations

import errno
from pathlib import Path

import pytest
import torch
from torch import nn

from offloadd import Offloader, gds
from offloadd.engine import Op, Request

from .helpers import assert_bitwise_equal, small_offloader

ENGINE_PARAMS = ("default",)  # the host engine does not matter here


def test_kvikio_named_without_gds_fails_with_reason(disk_dir: Path) -> None:
    ok, why = gds.probe()
    if ok:
        pytest.skip("GDS works here")
    with pytest.raises(RuntimeError, match="engine = kvikio, but") as e:
        Offloader(ssd_dirs=[str(disk_dir)], engine="kvikio")
    assert why in str(e.value)


def test_auto_without_gds_keeps_cpu_paths(disk_dir: Path) -> None:
    off = small_offloader(disk_dir, engine="auto")
    assert "kvikio" not in off.stats().engine
    off.close()


def _need_gds() -> None:
    ok, why = gds.probe()
    if not ok:
        pytest.skip(f"GDS unavailable: {why}")


def _train(off: Offloader | None, make: type[nn.Module] | None = None) -> list[list[torch.Tensor]]:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(256, 2048), nn.GELU(), nn.Dropout(0.1), nn.Linear(2048, 256)).cuda()
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    g = torch.Generator(device="cuda").manual_seed(1)
    out = []
    for _ in range(3):
        x = torch.randn(1000, 256, device="cuda", generator=g)  # 1000: chunks not 4096-aligned
        if off is None:
            loss = m(x).square().mean()
        else:
            with off:
                loss = m(x).square().mean()
        loss.backward()
        out.append([loss.detach().clone()] + [p.grad.clone() for p in m.parameters()])
        opt.step()
        opt.zero_grad()
    torch.cuda.synchronize()
    return out


@pytest.mark.cuda
def test_gds_bit_identical(disk_dir: Path) -> None:
    _need_gds()
    ref = _train(None)
    off = small_offloader(disk_dir, engine="kvikio")
    got = _train(off)
    st = off.stats()
    off.close()
    assert_bitwise_equal(ref, got)
    assert st.engine.endswith("+kvikio") and st.bytes_written > 0 and st.bytes_read > 0


@pytest.mark.cuda
def test_gds_inplace_is_caught_or_exact(disk_dir: Path) -> None:
    _need_gds()
    x = torch.randn(1024, 1024, device="cuda", requires_grad=True)
    expected = torch.autograd.grad((x * 2).sin().sum(), x)[0]
    off = small_offloader(disk_dir, engine="kvikio")
    with off:
        y = x * 2
        z = y.sin()
        y.add_(1)
    try:
        (g,) = torch.autograd.grad(z.sum(), x)
    except RuntimeError as e:
        assert "modified by an inplace operation" in str(e)
    else:
        assert torch.equal(g, expected)
    off.close()


@pytest.mark.cuda
def test_gds_write_error_falls_back_exactly(
    disk_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _need_gds()
    real = gds.KvikioEngine.transfer

    def failing(self: gds.KvikioEngine, request: Request) -> None:
        if request.op is Op.WRITE:
            raise OSError(errno.ENOSPC, "injected", request.path)
        real(self, request)

    monkeypatch.setattr(gds.KvikioEngine, "transfer", failing)
    ref = _train(None)
    off = small_offloader(disk_dir, engine="kvikio")
    with pytest.warns(RuntimeWarning, match="write failed"):
        got = _train(off)
    st = off.stats()
    off.close()
    assert_bitwise_equal(ref, got)
    assert st.fallbacks > 0
