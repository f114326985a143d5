"""memsave's fused bit-mask kernels (Note [fused masks] in offloadd/memsave/bits.py) give the
torch path's bytes exactly."""

from __future__ import annotations

import pytest
import torch

from offloadd.memsave import bits
from offloadd.memsave.bits import nonzero_bits, pack_bits, select_by_bits, unpack_flags

pytestmark = pytest.mark.skipif(bits._bits is None, reason="built without the fused kernels")

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


def awkward(n: int, dtype: torch.dtype) -> torch.Tensor:
    """Random values with zeros of both signs, NaN and infinities sprinkled in."""
    g = torch.Generator().manual_seed(n)
    x = torch.randn(n, generator=g).to(dtype)
    special = torch.tensor([0.0, -0.0, float("nan"), float("inf"), -float("inf")], dtype=dtype)
    where = torch.randint(0, n, (max(1, n // 5),), generator=g)
    x[where] = special[torch.randint(0, 5, where.shape, generator=g)]
    return x


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 7, 8, 63, 64, 1000, 200_003])
@pytest.mark.parametrize("threads", [1, 3])
def test_the_kernels_give_the_torch_paths_bytes(
    dtype: torch.dtype, n: int, threads: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(bits, "_threads", lambda: threads)
    x = awkward(n, dtype)
    packed = nonzero_bits(x)
    assert torch.equal(packed, pack_bits(x.bool()))
    assert torch.equal(packed, nonzero_bits(x, fused=False))
    grad = awkward(n + 1, dtype)[:n].clone()
    fused = select_by_bits(grad, packed, x.shape)
    if dtype.itemsize < 4:
        assert fused is None  # threshold_backward rewrites 16-bit NaN payloads: torch's path
        return
    assert fused is not None
    passes = unpack_flags(packed, x.shape).to(dtype)
    plain = torch.ops.aten.threshold_backward(grad, passes, 0)
    assert torch.equal(fused.view(torch.uint8), plain.view(torch.uint8))  # bits, NaN included


def test_a_non_contiguous_gradient_takes_the_torch_path() -> None:
    grad = torch.randn(8, 8).t()
    assert select_by_bits(grad, nonzero_bits(torch.randn(8, 8)), (8, 8)) is None
