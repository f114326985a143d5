"""memsave's native mask kernels (csrc/memsave/, the extension module built by offloadd's install):
bitwise the results of the torch ops they replace, on special values (NaN payloads of either
sign, -0.0, infinities, denormals), on sizes that end mid-byte and that span several of torch's
parallel chunks; and the memsaved modules bitwise plain PyTorch with the kernels and without.
"""

from __future__ import annotations

import copy
import logging
import math
import os
import subprocess
import sys
from collections.abc import Callable

import pytest
import torch
from torch import nn

from offloadd.memsave import kernels
from offloadd.memsave.bits import pack_bits, unpack_bits
from offloadd.memsave.pool import compact_indices, expand_indices
from offloadd.memsave.replace import memsave

_THRESHOLD_BACKWARD = torch.ops.aten.threshold_backward.default

SIZES = [*range(1, 18), 31, 33, 4099, (1 << 18) + 3, (1 << 20) + 13]
"""Mid-byte ends, one vector and less, and two sizes over the kernels' parallel grain."""

_SPECIAL32 = [
    0x00000000, 0x80000000, 0x7FC00000, 0xFFC00001, 0x7F800001, 0x7FBFFFFF, 0x7F800000,
    0xFF800000, 0x00000001, 0x80000001, 0x007FFFFF, 0x807FFFFF, 0x3F800000, 0xBF800000,
]  # fmt: skip
_SPECIAL16 = [
    0x0000, 0x8000, 0x7FC0, 0xFFC1, 0x7F81, 0x7F80, 0xFF80, 0x0001, 0x8001, 0x3F80, 0xBF80,
]  # fmt: skip


@pytest.fixture(scope="module")
def k() -> kernels.Kernels:
    lib = kernels.native()
    if lib is None:
        pytest.skip("memsave's kernels are unavailable here (not built, or no AVX2)")
    return lib


def special(n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Normal values with a tenth of them (at least one) replaced by special bit patterns."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g).to(dtype)
    table = _SPECIAL32 if dtype == torch.float32 else _SPECIAL16
    width = torch.int32 if dtype == torch.float32 else torch.int16
    patterns = torch.tensor(table, dtype=torch.int64).to(width).view(dtype)
    count = max(1, n // 10)
    where = torch.randperm(n, generator=g)[:count]  # distinct: a repeated index races
    x[where] = patterns[torch.randint(0, len(patterns), (count,), generator=g)]
    return x


def bits_of(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32 if t.element_size() == 4 else torch.int16)


@pytest.mark.unit
@pytest.mark.parametrize("inplace", [False, True], ids=["new", "inplace"])
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_relu_and_its_mask_are_torchs(
    k: kernels.Kernels, dtype: torch.dtype, n: int, inplace: bool
) -> None:
    x = special(n, dtype, seed=n)
    want = torch.relu(x)
    out, packed = k.relu(x, inplace)
    assert (out is x) == inplace
    assert torch.equal(bits_of(out), bits_of(want))
    assert torch.equal(packed, pack_bits(want.bool()))  # not (result <= 0): NaN passes
    assert packed.numel() == (n + 7) // 8


@pytest.mark.unit
@pytest.mark.parametrize("n", SIZES)
def test_select_is_threshold_backward(k: kernels.Kernels, n: int) -> None:
    result = torch.relu(special(n, torch.float32, seed=n))
    grad = special(n, torch.float32, seed=n + 1)
    got = k.select(grad, pack_bits(result.bool()))
    assert torch.equal(bits_of(got), bits_of(_THRESHOLD_BACKWARD(grad, result, 0)))


@pytest.mark.unit
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_pack_and_expand(k: kernels.Kernels, dtype: torch.dtype, n: int) -> None:
    x = special(n, dtype, seed=n)
    assert torch.equal(k.pack(x, positive=True), pack_bits(x > 0))  # NaN: not positive
    assert torch.equal(k.pack(x, positive=False), pack_bits(~(x <= 0)))  # NaN: set
    packed = pack_bits(x > 0)
    assert torch.equal(
        bits_of(k.expand(packed, (n,), dtype)), bits_of(unpack_bits(packed, (n,)).to(dtype))
    )


@pytest.mark.unit
def test_one_thread_gives_the_same_bits(k: kernels.Kernels) -> None:
    x = special((1 << 20) + 5, torch.float32, seed=3)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = k.relu(x, False)
    finally:
        torch.set_num_threads(threads)
    many = k.relu(x, False)
    assert torch.equal(bits_of(one[0]), bits_of(many[0])) and torch.equal(one[1], many[1])


def test_the_ops_refuse_what_they_cannot_read(k: kernels.Kernels) -> None:
    with pytest.raises(RuntimeError, match="pack_mask: t must be a contiguous CPU tensor"):
        k.pack(torch.zeros(4, 4).t(), True)
    with pytest.raises(RuntimeError, match="float32 or bfloat16 only"):
        k.relu(torch.zeros(4, dtype=torch.float16), False)
    with pytest.raises(RuntimeError, match="at least 13 bytes for 100 elements"):
        k.expand(torch.zeros(1, dtype=torch.uint8), (100,), torch.float32)
    with pytest.raises(RuntimeError, match="int64 indices"):
        k.pool_compact(
            torch.zeros(2, 3, dtype=torch.int32), torch.Size([2, 6]), POOL_2X, torch.uint8
        )


POOL_2X = ([2], [2], [0], [1])


@pytest.mark.unit
def test_serves_only_contiguous_cpu_float32_and_bfloat16() -> None:
    assert kernels.serves(torch.zeros(4)) and kernels.serves(torch.zeros(4, dtype=torch.bfloat16))
    assert not kernels.serves(torch.zeros(4, dtype=torch.float16))
    assert not kernels.serves(torch.zeros(4, dtype=torch.float64))
    assert not kernels.serves(torch.zeros(4, 4).t())
    assert not kernels.serves(torch.zeros(0))


POOLS = [  # (input shape, kernel, stride, padding, dilation, ceil_mode)
    ((2, 3, 1, 10), [1, 2], [1, 2], [0, 0], [1, 1], False),  # a 1d pool, as pool.py gives it
    ((2, 3, 9, 9), [3, 3], [2, 2], [1, 1], [1, 1], False),
    ((2, 2, 7, 8), [2, 3], [1, 2], [1, 0], [1, 1], True),
    ((1, 2, 9, 9), [3, 3], [1, 1], [1, 1], [2, 2], False),
    ((1, 1, 20, 20), [17, 17], [1, 1], [8, 8], [1, 1], False),  # int16 offsets
    ((2, 1, 40, 300), [2, 300], [1, 1], [0, 0], [1, 1], False),
    ((1, 2, 6, 5, 7), [3, 3, 3], [2, 2, 2], [1, 1, 1], [1, 1, 1], True),
    ((1, 1, 5, 7, 6), [2, 3, 2], [1, 1, 1], [1, 1, 0], [1, 2, 2], False),
    ((4, 64, 56, 56), [3, 3], [2, 2], [1, 1], [1, 1], False),  # ResNet's, over the grain
]


@pytest.mark.unit
@pytest.mark.parametrize("case", POOLS, ids=lambda c: "x".join(map(str, c[0])))
def test_pool_offsets_are_pool_pys(k: kernels.Kernels, case: tuple) -> None:
    shape, kernel, stride, padding, dilation, ceil = case
    geometry = (kernel, stride, padding, dilation)
    x = special(math.prod(shape), torch.float32, seed=len(shape)).view(shape)
    pool = (
        torch.ops.aten.max_pool3d_with_indices
        if len(kernel) == 3
        else torch.ops.aten.max_pool2d_with_indices
    )
    _, indices = pool(x, *geometry, ceil)
    want = compact_indices(indices, x.shape, geometry)
    got = k.pool_compact(indices, x.shape, geometry, want.dtype)
    assert got.dtype == want.dtype and torch.equal(got, want)
    assert torch.equal(k.pool_expand(got, x.shape, geometry), indices)
    assert torch.equal(expand_indices(got, x.shape, geometry), indices)


# -- the modules, with the kernels and without ----------------------------------------------


def _grads(m: nn.Module, x: torch.Tensor, seed: int) -> list[torch.Tensor]:
    leaf = x.detach().clone().requires_grad_()
    torch.manual_seed(seed)
    out = m(leaf * 1)  # not the leaf: in-place modules modify their input
    g = special(out.numel(), out.dtype, seed=seed + 7).view(out.shape)
    out.backward(g)
    assert leaf.grad is not None
    return [out.detach(), leaf.grad, torch.rand(1)]


MODULES: list[tuple[str, Callable[[], nn.Module]]] = [
    ("relu", lambda: nn.ReLU()),
    ("relu-inplace", lambda: nn.ReLU(inplace=True)),
    ("leaky", lambda: nn.LeakyReLU(0.1)),
    ("leaky-inplace", lambda: nn.LeakyReLU(0.2, inplace=True)),
    ("dropout", lambda: nn.Dropout(0.3)),
    ("dropout-inplace", lambda: nn.Dropout(0.5, inplace=True)),
    (
        "maxpool",
        lambda: nn.Sequential(nn.Unflatten(1, (1, -1, 1)), nn.MaxPool2d((3, 1), 2, (1, 0))),
    ),
    (  # the C++ function of csrc/memsave/autograd_ops.cpp, or the Python one
        "conv-frozen",
        lambda: nn.Sequential(
            nn.Unflatten(1, (1, -1)), nn.Conv1d(1, 2, 3, padding=1).requires_grad_(False)
        ),
    ),
]


@pytest.mark.parametrize("n", [13, 4099, (1 << 18) + 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(("name", "make"), MODULES, ids=[m[0] for m in MODULES])
def test_modules_bitwise_plain_either_path(
    memsave_path: str, name: str, make: Callable[[], nn.Module], dtype: torch.dtype, n: int
) -> None:
    x = special(n, dtype, seed=n).view(1, -1)
    plain = make().to(dtype)
    ms = memsave(copy.deepcopy(plain))
    a = _grads(plain, x, seed=5)
    b = _grads(ms, x, seed=5)
    for u, v in zip(a, b, strict=True):
        assert torch.equal(bits_of(u), bits_of(v))


@pytest.mark.unit
def test_relu_with_denormals_flushed(memsave_path: str) -> None:
    if not torch.set_flush_denormal(True):
        pytest.skip("this CPU cannot flush denormals")
    try:
        x = special(4099, torch.float32, seed=11).view(1, -1)
        a = _grads(nn.ReLU(), x, seed=2)
        b = _grads(memsave(nn.ReLU()), x, seed=2)
    finally:
        torch.set_flush_denormal(False)
    for u, v in zip(a, b, strict=True):
        assert torch.equal(bits_of(u), bits_of(v))


# -- when they cannot serve -----------------------------------------------------------------


def test_turned_off_by_the_environment() -> None:
    code = (
        "import torch, offloadd\n"
        "from offloadd.memsave import kernels\n"
        "assert kernels.native() is None\n"
        "m = offloadd.memsave(torch.nn.ReLU())\n"
        "x = torch.randn(100, requires_grad=True)\n"
        "m(x * 1).sum().backward()\n"
        "assert torch.equal(x.grad, (x > 0).float())\n"
    )
    env = {**os.environ, kernels.ENV: "0"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_unavailable_kernels_fall_back_with_one_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The library not built (or not loading): memsave's Python path, with one warning per
    process that names the module and how to build it."""
    monkeypatch.setitem(sys.modules, kernels.EXTENSION, None)  # an import of it fails
    monkeypatch.setattr(kernels, "_state", [])
    with caplog.at_level(logging.WARNING, logger="offloadd"):
        assert kernels.native() is None
        assert kernels.native() is None
    warnings = [r for r in caplog.records if kernels.EXTENSION in r.getMessage()]
    assert len(warnings) == 1, [r.getMessage() for r in caplog.records]
    assert "Python path" in warnings[0].getMessage()
    assert "pip install --no-build-isolation" in warnings[0].getMessage()
    x = torch.randn(64, requires_grad=True)
    memsave(nn.ReLU())(x * 1).sum().backward()
    assert x.grad is not None and torch.equal(x.grad, (x > 0).float())


def test_the_switch_is_not_taken_for_a_config_key() -> None:
    from offloadd.config import Config
    from offloadd.config.loader import from_environ

    assert from_environ(Config, {kernels.ENV: "0"}) == {}
