"""memsave, layer by layer: bitwise the outputs, gradients and running statistics of
plain PyTorch, with fewer saved bytes where gradients flow through frozen layers.

Every check runs the same module twice, unmodified and memsaved (a deep copy), on the same input
and RNG seed, and compares the bits (tests/_support/memsave_cases.py).
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from torch import nn

from offloadd.memsave.bits import pack_bits, packed_bytes, unpack_bits
from offloadd.memsave.pool import compact_indices, expand_indices
from offloadd.memsave.replace import memsave
from tests._support.memsave_cases import DTYPES, GRADS, compare, rand, same, special

# -- bits ------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 63, 64, 65, 1000, 4099])
def test_bits_round_trip(n: int) -> None:
    mask = torch.rand(n, generator=torch.Generator().manual_seed(n)) > 0.5
    packed = pack_bits(mask)
    assert packed.dtype == torch.uint8 and packed.numel() == packed_bytes(n)
    assert torch.equal(unpack_bits(packed, (n,)), mask)
    if n >= 8:  # element 8 j + i is bit i of byte j
        ref = sum(int(mask[i]) << i for i in range(8))
        assert int(packed[0]) == ref


def test_bits_shapes_and_views() -> None:
    mask = torch.rand(3, 5, 7) > 0.3
    view = mask.transpose(0, 2)
    assert torch.equal(unpack_bits(pack_bits(view), view.shape), view)
    with pytest.raises(TypeError):
        pack_bits(torch.zeros(3))


# -- conv ------------------------------------------------------------------------------------

CONVS: list[tuple[str, Callable[[], nn.Module], tuple[int, ...]]] = [
    ("conv1d", lambda: nn.Conv1d(4, 6, 3), (2, 4, 11)),
    ("conv1d-s2p1d2", lambda: nn.Conv1d(4, 6, 3, stride=2, padding=1, dilation=2), (2, 4, 13)),
    ("conv1d-g2-nobias", lambda: nn.Conv1d(4, 6, 3, groups=2, bias=False), (2, 4, 9)),
    ("conv1d-reflect", lambda: nn.Conv1d(4, 6, 3, padding=2, padding_mode="reflect"), (2, 4, 9)),
    ("conv2d", lambda: nn.Conv2d(3, 5, 3), (2, 3, 8, 8)),
    ("conv2d-s2p1", lambda: nn.Conv2d(4, 8, 3, stride=2, padding=1), (2, 4, 9, 9)),
    (
        "conv2d-d2-g4-nobias",
        lambda: nn.Conv2d(4, 8, 3, dilation=2, groups=4, bias=False),
        (2, 4, 9, 9),
    ),
    ("conv2d-1x1", lambda: nn.Conv2d(6, 4, 1), (2, 6, 5, 5)),
    (
        "conv2d-circular",
        lambda: nn.Conv2d(3, 4, 3, padding=1, padding_mode="circular"),
        (2, 3, 6, 6),
    ),
    ("conv3d", lambda: nn.Conv3d(2, 4, 3, padding=1), (2, 2, 5, 5, 5)),
    ("conv3d-s2-g2", lambda: nn.Conv3d(4, 4, 2, stride=2, groups=2), (1, 4, 6, 6, 6)),
    (
        "convT1d",
        lambda: nn.ConvTranspose1d(4, 6, 3, stride=2, padding=1, output_padding=1),
        (2, 4, 7),
    ),
    ("convT2d", lambda: nn.ConvTranspose2d(4, 6, 3), (2, 4, 5, 5)),
    (
        "convT2d-s2-op1-g2-d2",
        lambda: nn.ConvTranspose2d(
            4, 6, 3, stride=2, padding=1, output_padding=1, groups=2, dilation=2
        ),
        (2, 4, 5, 5),
    ),
    ("convT2d-nobias", lambda: nn.ConvTranspose2d(3, 2, 2, stride=2, bias=False), (2, 3, 4, 4)),
    ("convT3d", lambda: nn.ConvTranspose3d(2, 3, 3, stride=2, padding=1), (1, 2, 3, 4, 3)),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("grads", GRADS, ids=lambda g: "x{:d}w{:d}b{:d}".format(*g))
@pytest.mark.parametrize(("name", "make", "shape"), CONVS, ids=[c[0] for c in CONVS])
def test_conv_bitwise(
    name: str,
    make: Callable[[], nn.Module],
    shape: tuple[int, ...],
    grads: tuple[bool, bool, bool],
    dtype: torch.dtype,
) -> None:
    plain_bytes, ms_bytes = compare(make, rand(*shape, dtype=dtype), grads)
    rx, rw, _ = grads
    if rx and not rw and "reflect" not in name and "circular" not in name:
        assert ms_bytes == 0 < plain_bytes  # the input is not saved
    else:
        assert ms_bytes <= plain_bytes


def test_conv_transpose_output_size() -> None:
    def make() -> nn.Module:
        class M(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.up = nn.ConvTranspose2d(3, 2, 3, stride=2, padding=1)

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                return self.up(x, output_size=[10, 10])

        return M()

    compare(make, rand(2, 3, 5, 5), (True, False, True))


def test_conv_channels_last_and_unbatched_stay_plain() -> None:
    x = rand(2, 3, 8, 8).to(memory_format=torch.channels_last)
    compare(lambda: nn.Conv2d(3, 4, 3), x, (True, False, False))
    compare(lambda: nn.Conv2d(3, 4, 3), rand(3, 8, 8), (True, False, True))
    compare(lambda: nn.Conv2d(3, 4, 3, padding="same"), rand(2, 3, 8, 8), (True, False, True))


# -- batch norm ------------------------------------------------------------------------------

BNS: list[tuple[str, type[nn.Module], tuple[int, ...]]] = [
    ("bn1d-2d", nn.BatchNorm1d, (4, 3)),
    ("bn1d-3d", nn.BatchNorm1d, (4, 3, 5)),
    ("bn2d", nn.BatchNorm2d, (3, 3, 4, 4)),
    ("bn3d", nn.BatchNorm3d, (2, 3, 3, 3, 3)),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("grads", GRADS, ids=lambda g: "x{:d}w{:d}b{:d}".format(*g))
@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize(
    ("affine", "track"),
    [(True, True), (False, True), (True, False)],
    ids=["affine", "noaffine", "notrack"],
)
@pytest.mark.parametrize(("name", "cls", "shape"), BNS, ids=[b[0] for b in BNS])
def test_batch_norm_bitwise(
    name: str,
    cls: type[nn.Module],
    shape: tuple[int, ...],
    affine: bool,
    track: bool,
    train: bool,
    grads: tuple[bool, bool, bool],
    dtype: torch.dtype,
) -> None:
    c = shape[1]

    def make() -> nn.Module:
        bn = cls(c, affine=affine, track_running_stats=track)
        if affine:  # not the identity: a frozen affine must still be applied
            with torch.no_grad():
                bn.weight.uniform_(0.5, 1.5)
                bn.bias.uniform_(-0.5, 0.5)
        if track:
            with torch.no_grad():
                bn.running_mean.uniform_(-0.5, 0.5)
                bn.running_var.uniform_(0.5, 2.0)
        return bn

    x = rand(*shape, dtype=dtype) * 2 + 0.5
    plain_bytes, ms_bytes = compare(make, x, grads, train=train, steps=2)
    rx, rw, _ = grads
    if rx and not (affine and rw) and not train and track:
        assert ms_bytes < plain_bytes and ms_bytes <= 64  # the statistics, not the input
    elif train or not track:
        assert ms_bytes == plain_bytes  # batch statistics: plain's graph


# -- relu, leaky relu ------------------------------------------------------------------------


POINTWISE: list[tuple[str, Callable[[], nn.Module]]] = [
    ("relu", lambda: nn.ReLU()),
    ("relu-inplace", lambda: nn.ReLU(inplace=True)),
    ("leaky", lambda: nn.LeakyReLU()),
    ("leaky-0.2-inplace", lambda: nn.LeakyReLU(0.2, inplace=True)),
    ("leaky-neg", lambda: nn.LeakyReLU(-0.3)),
    ("leaky-0", lambda: nn.LeakyReLU(0.0)),
    ("leaky-0-inplace", lambda: nn.LeakyReLU(0.0, inplace=True)),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(3, 5, 7), (2, 9), (13,)], ids=str)
@pytest.mark.parametrize(("name", "make"), POINTWISE, ids=[p[0] for p in POINTWISE])
@pytest.mark.parametrize("rx", [True, False], ids=["xgrad", "nograd"])
def test_relu_bitwise(
    name: str, make: Callable[[], nn.Module], shape: tuple[int, ...], dtype: torch.dtype, rx: bool
) -> None:
    x = special(shape, dtype)
    plain_bytes, ms_bytes = compare(make, x, (rx, False, False))
    if rx and name != "leaky-0-inplace":
        n = x.numel()
        assert ms_bytes == packed_bytes(n) < plain_bytes == n * x.element_size()


def test_relu_inplace_aliasing() -> None:
    m = memsave(nn.ReLU(inplace=True))
    leaf = rand(4, 5).requires_grad_()
    x = leaf * 1
    version = x._version
    y = m(x)
    assert y is x and x._version > version  # once (plain, C++); twice (a dirty Python Function)
    y.sum().backward()
    assert torch.equal(leaf.grad, (leaf > 0).float())
    leaf = rand(3).requires_grad_()
    before = leaf.detach().clone()
    with pytest.raises(RuntimeError, match="leaf Variable that requires grad"):
        m(leaf)
    assert torch.equal(leaf.detach(), before)  # refused before writing, as plain refuses


# -- gradient layout (Note [gradient layout] in pointwise.py) ----------------------------------

LAYOUTS = [
    ("relu", lambda: nn.ReLU()),
    ("relu-inplace", lambda: nn.ReLU(inplace=True)),
    ("leaky", lambda: nn.LeakyReLU(0.1)),
    ("leaky-inplace", lambda: nn.LeakyReLU(0.1, inplace=True)),
    ("dropout", lambda: nn.Dropout(0.5)),
]
CL = torch.channels_last


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    ("x_format", "grad_format"), [(CL, CL), (None, CL), (CL, None), ("slice", None), ("slice", CL)]
)
@pytest.mark.parametrize(("name", "make"), LAYOUTS, ids=[p[0] for p in LAYOUTS])
def test_the_gradient_keeps_plains_layout(
    name: str,
    make: Callable[[], nn.Module],
    x_format: torch.memory_format | str | None,
    grad_format: torch.memory_format | None,
    dtype: torch.dtype,
) -> None:
    """The gradient a memsaved layer gives back has plain's values and strides, for inputs and
    gradients in channels_last or not, and for a slice (not dense): another layout gives other
    bits in the reductions before it (a BatchNorm's)."""

    def grad_in(m: nn.Module) -> torch.Tensor:
        torch.manual_seed(0)
        leaf = rand(2, 6, 5, 4, dtype=dtype).requires_grad_()
        base = leaf * 1 if x_format in (None, "slice") else leaf.to(memory_format=x_format)
        x = base[..., :3] if x_format == "slice" else base
        got: list[torch.Tensor] = []
        # in place on a slice, the gradient reaches the view's base only (CopySlices)
        (base if name.endswith("inplace") else x).register_hook(got.append)
        weight = rand(*x.shape, dtype=dtype, seed=2)
        if grad_format is not None:
            weight = weight.to(memory_format=grad_format)
        (m(x) * weight).sum().backward()
        return got[0]

    plain = make()
    want, got = grad_in(plain), grad_in(memsave(copy.deepcopy(plain)))
    assert got.stride() == want.stride() and same(got, want)


def test_a_frozen_stems_batch_norm_in_channels_last_is_bitwise() -> None:
    """A frozen conv, then BatchNorm and ReLU, in channels_last: the ReLU's gradient must have
    plain's strides for BatchNorm's backward to sum as plain's does."""
    torch.manual_seed(0)
    conv = nn.Conv2d(3, 16, 3, padding=1).requires_grad_(False)
    plain = nn.Sequential(conv, nn.BatchNorm2d(16), nn.ReLU(), nn.Flatten(), nn.Linear(4096, 10))
    plain = plain.to(memory_format=CL)
    ms = memsave(copy.deepcopy(plain))
    x = rand(8, 3, 16, 16).to(memory_format=CL)
    for m in (plain, ms):
        m(x).square().mean().backward()
    for (name, p), q in zip(plain.named_parameters(), ms.parameters(), strict=True):
        assert (p.grad is None) == (q.grad is None), name
        assert p.grad is None or same(p.grad, q.grad), name


# -- max pool --------------------------------------------------------------------------------

POOLS: list[tuple[str, Callable[[], nn.Module], tuple[int, ...]]] = [
    ("mp1d", lambda: nn.MaxPool1d(2), (2, 3, 10)),
    ("mp1d-k3s1p1", lambda: nn.MaxPool1d(3, 1, 1), (2, 3, 10)),
    ("mp1d-k3s2d2-ceil", lambda: nn.MaxPool1d(3, 2, 1, dilation=2, ceil_mode=True), (2, 3, 12)),
    ("mp2d", lambda: nn.MaxPool2d(2), (2, 3, 8, 8)),
    ("mp2d-k3s2p1", lambda: nn.MaxPool2d(3, 2, 1), (2, 3, 9, 9)),
    ("mp2d-rect-ceil", lambda: nn.MaxPool2d((2, 3), (1, 2), (1, 0), ceil_mode=True), (2, 2, 7, 8)),
    ("mp2d-d2", lambda: nn.MaxPool2d(3, 1, 1, dilation=2), (1, 2, 9, 9)),
    ("mp2d-k17", lambda: nn.MaxPool2d(17, 1, 8), (1, 1, 20, 20)),
    ("mp3d", lambda: nn.MaxPool3d(2), (1, 2, 4, 4, 4)),
    ("mp3d-k3s2p1-ceil", lambda: nn.MaxPool3d(3, 2, 1, ceil_mode=True), (1, 2, 6, 5, 7)),
    ("mp3d-d2", lambda: nn.MaxPool3d((2, 3, 2), 1, (1, 1, 0), dilation=(1, 2, 2)), (1, 1, 5, 7, 6)),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rx", [True, False], ids=["xgrad", "nograd"])
@pytest.mark.parametrize(("name", "make", "shape"), POOLS, ids=[p[0] for p in POOLS])
def test_max_pool_bitwise(
    name: str, make: Callable[[], nn.Module], shape: tuple[int, ...], rx: bool, dtype: torch.dtype
) -> None:
    x = rand(*shape, dtype=dtype)
    x.view(-1)[::7] = 0.5  # ties: the first maximum's index must be kept
    plain_bytes, ms_bytes = compare(make, x, (rx, False, False))
    if rx:
        assert 0 < ms_bytes * 4 <= plain_bytes - x.numel() * x.element_size()


def test_max_pool_return_indices_and_nans_stay_plain() -> None:
    compare(
        lambda: nn.MaxPool2d(2, return_indices=False),
        special((2, 3, 8, 8), torch.float32),
        (True, False, False),
    )

    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.pool = nn.MaxPool2d(2, return_indices=True)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out, idx = self.pool(x)
            return out + idx.to(out.dtype)

    compare(M, rand(2, 3, 8, 8), (True, False, False))


@pytest.mark.parametrize("kernel", [(2,), (3, 3), (17, 17), (2, 300)])
def test_compact_indices_dtype(kernel: tuple[int, ...]) -> None:
    nd = len(kernel)
    x = rand(1, 1, *[k + 3 for k in kernel])
    fn = (
        torch.ops.aten.max_pool2d_with_indices
        if nd <= 2
        else torch.ops.aten.max_pool3d_with_indices
    )
    if nd == 1:
        kernel = (1, *kernel)
        x = x.unsqueeze(-2)
    geometry = (list(kernel), [1] * len(kernel), [0] * len(kernel), [1] * len(kernel))
    _, idx = fn(x, *geometry, False)
    off = compact_indices(idx, x.shape, geometry)
    vol = 1
    for k in kernel:
        vol *= k
    assert off.element_size() == (1 if vol <= 256 else 2)
    assert torch.equal(expand_indices(off, x.shape, geometry), idx)


# -- dropout ---------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("p", [0.0, 0.1, 0.5, 1.0])
@pytest.mark.parametrize("inplace", [False, True], ids=["new", "inplace"])
@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("rx", [True, False], ids=["xgrad", "nograd"])
def test_dropout_bitwise(
    p: float, inplace: bool, train: bool, rx: bool, dtype: torch.dtype
) -> None:
    x = rand(4, 33, dtype=dtype)
    plain_bytes, ms_bytes = compare(
        lambda: nn.Dropout(p, inplace), x, (rx, False, False), train=train, steps=3
    )
    if rx and train and 0 < p < 1:
        assert ms_bytes == packed_bytes(x.numel()) < plain_bytes


@pytest.mark.parametrize(
    "make",
    [
        lambda: nn.Dropout2d(0.5),
        lambda: nn.Dropout1d(0.5),
        lambda: nn.AlphaDropout(0.5),
        lambda: nn.GELU(),
    ],
)
def test_unsupported_left_untouched(make: Callable[[], nn.Module]) -> None:
    m = make()
    assert type(memsave(m)) is type(make())
    shape = (2, 3, 5) if isinstance(m, nn.Dropout1d) else (2, 3, 4, 4)
    compare(make, rand(*shape), (True, False, False), steps=2)
