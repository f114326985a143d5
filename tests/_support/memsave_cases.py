"""What the memsave tests share: running a module plain and memsaved and comparing the bits
(tests/memsave/test_memsave_layers.py per layer type, tests/memsave/test_memsave.py on whole models)."""

from __future__ import annotations

import copy
import itertools
from collections.abc import Callable

import torch
from torch import nn

from offloadd.memsave.replace import REPLACEMENTS, memsave
from offloadd.tools.bench.memsave import count_saved_bytes

DTYPES = [torch.float32, torch.bfloat16]
GRADS = list(itertools.product([False, True], repeat=3))  # input, weight, bias require grad


# -- helpers ---------------------------------------------------------------------------------


def set_grads(m: nn.Module, weight: bool, bias: bool) -> None:
    for name, p in m.named_parameters():
        p.requires_grad_(bias if name.endswith("bias") else weight)


def run(
    m: nn.Module, x: torch.Tensor, rx: bool, seed: int, steps: int = 1
) -> tuple[list[torch.Tensor], int]:
    """Outputs, input gradient, parameter gradients and buffers after ``steps`` forward/backward
    passes; and the saved bytes of the last one."""
    results: list[torch.Tensor] = []
    nbytes = 0
    for step in range(steps):
        leaf = x.detach().clone().requires_grad_(rx)
        torch.manual_seed(seed + step)
        with count_saved_bytes(m) as counted:
            out = m(leaf.clone())  # not the leaf: in-place modules may modify it
        nbytes = counted[0]
        results.append(out.detach().clone())
        if out.requires_grad:
            g = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed)).to(out.dtype)
            out.backward(g)
        results.append(leaf.grad if leaf.grad is not None else torch.zeros(0))
        results.append(torch.rand(1))  # RNG state after: same consumption
    for _, p in sorted(m.named_parameters()):
        results.append(p.grad if p.grad is not None else torch.zeros(0))
    for _, b in sorted(m.named_buffers()):
        results.append(b)
    return results, nbytes


_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def same(u: torch.Tensor, v: torch.Tensor) -> bool:
    """Bitwise equal (NaN payloads and the sign of zero included)."""
    if u.is_floating_point():
        bits = _BITS[u.element_size()]
        return torch.equal(u.view(bits), v.view(bits))
    return torch.equal(u, v)


def compare(
    make: Callable[[], nn.Module],
    x: torch.Tensor,
    grads: tuple[bool, bool, bool],
    *,
    train: bool = True,
    seed: int = 0,
    steps: int = 1,
    keep_grads: bool = False,
) -> tuple[int, int]:
    """Plain against memsave, bitwise; returns (plain, memsave) saved bytes. ``keep_grads``: the
    parameters' ``requires_grad`` as ``make`` set them (``grads[1:]`` unused)."""
    rx, rw, rb = grads
    torch.manual_seed(seed)
    plain = make().to(x.dtype).train(train)
    if not keep_grads:
        set_grads(plain, rw, rb)
    ms = memsave(copy.deepcopy(plain))
    assert any(type(m) in REPLACEMENTS.values() for m in ms.modules()) or not any(
        type(m) in REPLACEMENTS for m in plain.modules()
    )
    a, plain_bytes = run(plain, x, rx, seed, steps)
    b, ms_bytes = run(ms, x, rx, seed, steps)
    assert len(a) == len(b)
    for i, (u, v) in enumerate(zip(a, b, strict=True)):
        assert u.dtype == v.dtype and u.shape == v.shape, i
        assert same(u, v), f"result {i} differs: {(u.float() - v.float()).abs().max()}"
    return plain_bytes, ms_bytes


def rand(*shape: int, dtype: torch.dtype = torch.float32, seed: int = 1) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def special(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Random values with exact zeros, -0.0, NaN and infinities among them."""
    x = rand(*shape, dtype=dtype).flatten()
    x[:6] = torch.tensor([0.0, -0.0, float("nan"), float("inf"), -float("inf"), 1e-40])
    return x.view(shape)
