"""CUDA paths: side-stream copies, pinned pools, the cpu tier. Skipped without a GPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from .helpers import assert_bitwise_equal, small_offloader

pytestmark = [pytest.mark.cuda, pytest.mark.usefixtures("backend")]


def _train_cuda(off: object, steps: int = 3) -> list[list[torch.Tensor]]:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(256, 2048), nn.GELU(), nn.Dropout(0.1), nn.Linear(2048, 256)).cuda()
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    g = torch.Generator(device="cuda").manual_seed(1)
    out = []
    for _ in range(steps):
        x = torch.randn(1024, 256, device="cuda", generator=g)
        if off is None:
            loss = m(x).square().mean()
        else:
            with off:  # type: ignore[attr-defined]
                loss = m(x).square().mean()
        loss.backward()
        out.append([loss.detach().clone()] + [p.grad.clone() for p in m.parameters()])
        opt.step()
        opt.zero_grad()
    torch.cuda.synchronize()
    return out


@pytest.mark.parametrize("tier", ["keep", "ssd", "cpu"])
def test_cuda_bit_identical(tier: str, disk_dir: Path) -> None:
    ref = _train_cuda(None)
    off = small_offloader(disk_dir, tier=tier, host_budget_bytes=4 << 20)
    got = _train_cuda(off)
    st = off.stats()
    off.close()
    assert_bitwise_equal(ref, got)
    if tier != "keep":
        assert st.offloaded_bytes > 0


def test_cuda_inplace_before_copy_is_caught_or_exact(disk_dir: Path) -> None:
    x = torch.randn(1024, 1024, device="cuda", requires_grad=True)
    expected = torch.autograd.grad((x * 2).sin().sum(), x)[0]
    off = small_offloader(disk_dir)
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


def test_cuda_memory_is_released_during_forward(disk_dir: Path) -> None:
    off = small_offloader(disk_dir, min_bytes=1 << 20, staging_bytes=64 << 20, chunk_bytes=1 << 20)
    m = nn.Sequential(*[nn.Sequential(nn.Linear(1024, 1024), nn.GELU()) for _ in range(16)]).cuda()
    x = torch.randn(4096, 1024, device="cuda")
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        base = torch.cuda.memory_allocated()
        loss = m(x).sum()
        keep_peak = torch.cuda.memory_allocated() - base
    del loss
    with off:
        base = torch.cuda.memory_allocated()
        loss = m(x).sum()
        off.synchronize()
        off.stats()
        held = torch.cuda.memory_allocated() - base
    loss.backward()
    off.close()
    assert held < 0.5 * keep_peak
