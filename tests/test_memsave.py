"""memsave (issue 16): bitwise the outputs, gradients and running statistics of plain PyTorch,
with fewer saved bytes where gradients flow through frozen layers.

Every check runs the same module twice, unmodified and memsaved (a deep copy), on the same input
and RNG seed, and compares with ``torch.equal``.
"""

from __future__ import annotations

import copy
import itertools
import pickle
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

import offloadd
from offloadd.memsave.bits import pack_bits, packed_bytes, unpack_bits
from offloadd.memsave.pool import compact_indices, expand_indices
from offloadd.memsave.replace import REPLACEMENTS, memsave, unmemsave
from offloadd.tools.bench_memsave import Logits, count_saved_bytes

from .helpers import small_offloader

ENGINE_PARAMS = ("python",)  # the offload composition tests: one engine is enough here

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


def special(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Random values with exact zeros, -0.0, NaN and infinities among them."""
    x = rand(*shape, dtype=dtype).flatten()
    x[:6] = torch.tensor([0.0, -0.0, float("nan"), float("inf"), -float("inf"), 1e-40])
    return x.view(shape)


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
    assert y is x and x._version > version  # plain bumps it once, a dirty custom Function twice
    y.sum().backward()
    assert torch.equal(leaf.grad, (leaf > 0).float())
    leaf = rand(3).requires_grad_()
    before = leaf.detach().clone()
    with pytest.raises(RuntimeError, match="leaf Variable that requires grad"):
        m(leaf)
    assert torch.equal(leaf.detach(), before)  # refused before writing, as plain refuses


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


# -- the swap itself -------------------------------------------------------------------------


def small_cnn() -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(inplace=True),
        nn.MaxPool2d(3, 2, 1),
        nn.Conv2d(8, 8, 3, padding=1, bias=False),
        nn.BatchNorm2d(8),
        nn.LeakyReLU(0.1),
        nn.Dropout(0.2),
        nn.Flatten(),
        nn.Linear(8 * 4 * 4, 5),
    )


def test_swap_keeps_identity_state_and_copies() -> None:
    model = small_cnn()
    params = [id(p) for p in model.parameters()]
    keys = list(model.state_dict())
    assert offloadd.memsave(model) is model
    assert [id(p) for p in model.parameters()] == params and list(model.state_dict()) == keys
    assert isinstance(model[0], nn.Conv2d) and type(model[0]).__name__ == "MemsaveConv2d"
    assert type(model[9]) is nn.Linear and type(model[8]) is nn.Flatten
    memsave(model)  # idempotent
    clone = copy.deepcopy(model)
    assert type(clone[0]) is type(model[0])
    restored = pickle.loads(pickle.dumps(model))
    assert type(restored[5]) is type(model[5])
    fresh = memsave(small_cnn())
    fresh.load_state_dict(model.state_dict())
    x = rand(2, 3, 8, 8)
    model.eval(), fresh.eval(), restored.eval()
    assert torch.equal(model(x), fresh(x)) and torch.equal(model(x), restored(x))
    unmemsave(model)
    assert type(model[0]) is nn.Conv2d and type(model[6]) is nn.LeakyReLU


def test_subclasses_left_untouched() -> None:
    class MyConv(nn.Conv2d):
        pass

    m = nn.Sequential(MyConv(3, 3, 1), nn.ReLU())
    memsave(m)
    assert type(m[0]) is MyConv and type(m[1]) is not nn.ReLU


@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
def test_freeze_unfreeze_between_steps(train: bool) -> None:
    torch.manual_seed(0)
    plain = small_cnn().train(train)
    ms = memsave(copy.deepcopy(plain))
    schedules = [(False, True), (True, True), (False, False), (True, False), (False, True)]
    for step, (conv_w, bn_w) in enumerate(schedules):
        for model in (plain, ms):
            for m in model.modules():
                if isinstance(m, nn.Conv2d):
                    m.weight.requires_grad_(conv_w)
                if isinstance(m, nn.BatchNorm2d):
                    m.weight.requires_grad_(bn_w)
                    m.bias.requires_grad_(bn_w)
                m.zero_grad(set_to_none=True)
        a, _ = run(plain, rand(2, 3, 8, 8, seed=step), True, step)
        b, _nbytes = run(ms, rand(2, 3, 8, 8, seed=step), True, step)
        assert all(same(u, v) for u, v in zip(a, b, strict=True)), step


@pytest.mark.parametrize(
    "make",
    [
        lambda: nn.ReLU(),
        lambda: nn.LeakyReLU(0.1),
        lambda: nn.MaxPool2d(2),
        lambda: nn.Dropout(0.5),
        lambda: nn.BatchNorm2d(3).eval().requires_grad_(False),
    ],
    ids=["relu", "leaky", "maxpool", "dropout", "bn-eval"],
)
def test_double_backward_raises_and_backward_does_not(make: Callable[[], nn.Module]) -> None:
    m = memsave(make())
    x = rand(2, 3, 6, 6).requires_grad_()
    (g,) = torch.autograd.grad(m(x * 1).pow(2).sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable"):
        g.sum().backward()
    m(x * 1).pow(2).sum().backward()  # an ordinary backward: grad mode off, no wrapper
    assert x.grad is not None


def test_double_backward_raises() -> None:
    conv = memsave(nn.Conv2d(3, 4, 3))
    conv.weight.requires_grad_(False)
    x = rand(2, 3, 6, 6).requires_grad_()
    (g,) = torch.autograd.grad(conv(x).pow(2).sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable"):
        g.sum().backward()
    # a first backward with create_graph=True is still exact
    plain = nn.Conv2d(3, 4, 3)
    plain.load_state_dict(conv.state_dict())
    plain.weight.requires_grad_(False)
    (g_plain,) = torch.autograd.grad(plain(x).pow(2).sum(), x, create_graph=True)
    assert torch.equal(g.detach(), g_plain.detach())


# -- whole models (transformers, random weights) ---------------------------------------------

transformers = pytest.importorskip("transformers")


def tiny_resnet() -> nn.Module:
    cfg = transformers.ResNetConfig(
        embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], layer_type="bottleneck", num_labels=3
    )
    return Logits(transformers.ResNetForImageClassification(cfg))


def tiny_vit() -> nn.Module:
    cfg = transformers.ViTConfig(
        image_size=16,
        patch_size=4,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=32,
        hidden_dropout_prob=0.1,
        attention_probs_dropout_prob=0.1,
        num_labels=3,
        attn_implementation="eager",
    )
    return Logits(transformers.ViTForImageClassification(cfg))


def freeze(model: nn.Module, regime: str) -> nn.Module:
    """``all``: everything trainable; ``head``: the backbone frozen, the classifier trainable;
    ``norm-bias``: only norm layers' affine and biases (BN tuning, LayerNorm/bias tuning);
    ``none``: nothing (saliency: only the input requires grad)."""
    for name, p in model.named_parameters():
        if regime == "all":
            p.requires_grad_(True)
        elif regime == "head":
            p.requires_grad_("classifier" in name)
        elif regime == "norm-bias":
            p.requires_grad_(
                "normalization" in name or "layernorm" in name or name.endswith("bias")
            )
        else:
            p.requires_grad_(False)
    return model


REGIMES = ["all", "head", "norm-bias", "none"]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("regime", REGIMES)
@pytest.mark.parametrize(
    ("name", "make", "shape"),
    [("resnet", tiny_resnet, (2, 3, 32, 32)), ("vit", tiny_vit, (2, 3, 16, 16))],
    ids=["resnet", "vit"],
)
def test_whole_model_bitwise(
    name: str,
    make: Callable[[], nn.Module],
    shape: tuple[int, ...],
    regime: str,
    train: bool,
    dtype: torch.dtype,
) -> None:
    rx = regime != "head"  # the input requires grad too, except when only the head trains
    plain_bytes, ms_bytes = compare(
        lambda: freeze(make(), regime),
        rand(*shape, dtype=dtype),
        (rx, False, False),
        train=train,
        steps=2,
        keep_grads=True,
    )
    assert ms_bytes <= plain_bytes * (1.05 if regime == "all" else 1.0)
    if name == "resnet" and regime == "none" and not train:
        assert ms_bytes <= 0.1 * plain_bytes  # saliency on a frozen model
    if name == "resnet" and regime == "norm-bias" and train:
        assert ms_bytes <= 0.6 * plain_bytes  # BN tuning


def test_memsave_with_offloader(disk_dir: Path) -> None:
    torch.manual_seed(0)
    plain = freeze(tiny_resnet(), "norm-bias").train()
    ms = memsave(copy.deepcopy(plain))
    x = rand(4, 3, 32, 32)
    a, _ = run(plain, x, True, 0, steps=2)
    results = []
    off = small_offloader(disk_dir, min_bytes=0)
    try:
        for step in range(2):
            leaf = x.clone().requires_grad_()
            torch.manual_seed(step)
            with off:
                out = ms(leaf.clone())
            results.append(out.detach().clone())
            out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(0)))
            results += [leaf.grad, torch.rand(1)]
        off.synchronize()
        stats = off.stats()
    finally:
        off.close()
    results += [
        p.grad if p.grad is not None else torch.zeros(0) for _, p in sorted(ms.named_parameters())
    ]
    results += [b for _, b in sorted(ms.named_buffers())]
    assert len(a) == len(results)
    assert all(same(u, v) for u, v in zip(a, results, strict=True))
    assert stats.offloaded_bytes > 0


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    ("make", "shape"),
    [
        (lambda: nn.Conv2d(64, 64, 3, padding=1, bias=False), (2, 64, 28, 28)),
        (lambda: nn.Conv2d(64, 256, 1), (2, 64, 28, 28)),
        (lambda: nn.ConvTranspose2d(32, 16, 4, stride=2, padding=1), (2, 32, 14, 14)),
    ],
    ids=["3x3", "1x1", "transposed"],
)
def test_conv_realistic_sizes(
    make: Callable[[], nn.Module], shape: tuple[int, ...], dtype: torch.dtype
) -> None:
    """Sizes where oneDNN picks its own algorithms: still bitwise, input gradient only."""
    plain_bytes, ms_bytes = compare(make, rand(*shape, dtype=dtype), (True, False, False))
    assert ms_bytes == 0 < plain_bytes


@pytest.mark.parametrize("dropout", [0.0, 0.2])
def test_sgd_steps_with_offload_match_plain(disk_dir: Path, dropout: float) -> None:
    """helpers.train (SGD, three steps, RNG state compared; every parameter trains, as the
    equivalence tests' models do): plain PyTorch without offloadd against memsave inside an
    Offloader."""
    from .helpers import assert_bitwise_equal, train

    def make(memsaved: bool) -> Callable[[], nn.Module]:
        def build() -> nn.Module:
            model = small_cnn()
            model[7].p = dropout
            return memsave(model) if memsaved else model

        return build

    def make_input(gen: torch.Generator) -> torch.Tensor:
        return torch.randn(4, 3, 8, 8, generator=gen)

    reference = train(make(False), make_input, None)
    off = small_offloader(disk_dir, min_bytes=0)
    try:
        got = train(make(True), make_input, off, settle_first=True)
        off.synchronize()
    finally:
        off.close()
    assert_bitwise_equal(reference, got)


# -- a fully trainable model: nothing changes (Note [fully trainable] in memsave/gate.py) --------


def _saved_shapes(model: nn.Module, x: torch.Tensor) -> list[tuple[tuple[int, ...], torch.dtype]]:
    shapes = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        shapes.append((tuple(t.shape), t.dtype))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x).sum().backward()
    return shapes


def test_a_fully_trainable_model_saves_what_plain_saves() -> None:
    """Every parameter trainable: the memsaved model saves the same tensors as plain PyTorch
    (ReLU, MaxPool and Dropout included), bitwise the same results; freezing one parameter
    switches the masks on at the next forward, unfreezing it off again."""
    torch.manual_seed(0)
    plain = small_cnn().train()
    ms = memsave(copy.deepcopy(plain))
    x = rand(2, 3, 8, 8)
    torch.manual_seed(1)
    want = _saved_shapes(plain, x)
    torch.manual_seed(1)
    assert _saved_shapes(ms, x) == want
    a, plain_bytes = run(plain, x, True, 3)
    b, ms_bytes = run(ms, x, True, 3)
    assert ms_bytes == plain_bytes and all(same(u, v) for u, v in zip(a, b, strict=True))
    ms[0].weight.requires_grad_(False)
    torch.manual_seed(1)
    assert any(dt == torch.uint8 for _, dt in _saved_shapes(ms, x))  # bit masks
    ms[0].weight.requires_grad_(True)
    torch.manual_seed(1)
    assert _saved_shapes(ms, x) == want


def test_the_gate_follows_copies_and_goes_with_unmemsave() -> None:
    torch.manual_seed(0)
    model = memsave(small_cnn())
    clone = copy.deepcopy(model)
    restored = pickle.loads(pickle.dumps(model))
    for m in (clone, restored):
        m[0].weight.requires_grad_(False)
    x = rand(2, 3, 8, 8)
    for m, masks in ((model, False), (clone, True), (restored, True)):
        torch.manual_seed(1)
        assert any(dt == torch.uint8 for _, dt in _saved_shapes(m, x)) == masks
    unmemsave(clone)
    assert not clone._forward_pre_hooks
    assert all("_memsave_gate" not in m.__dict__ for m in clone.modules())


# -- the equivalence suite's models, memsaved, with their first layer frozen ------------------


def _first_layer_frozen(make: Callable[[], nn.Module], memsaved: bool) -> Callable[[], nn.Module]:
    """``make``'s model with the weight of its first module that has one frozen (gradients flow
    through it: the masks are on, Note [fully trainable]); memsaved or not."""

    def build() -> nn.Module:
        model = make()
        first = next(
            m for m in model.modules() if isinstance(getattr(m, "weight", None), nn.Parameter)
        )
        first.weight.requires_grad_(False)
        return memsave(model) if memsaved else model

    return build


@pytest.mark.parametrize("tier", ["keep", "ssd", "cpu"])
@pytest.mark.parametrize("model", ["mlp", "convnet", "encoder", "gpt"])
def test_equivalence_models_memsaved_under_every_tier(
    model: str, tier: str, disk_dir: Path
) -> None:
    """The models of tests/test_equivalence.py, first layer frozen: memsaved and offloaded,
    bitwise the unmodified model trained without offloadd (dropout on)."""
    from .helpers import assert_bitwise_equal, train
    from .test_equivalence import MODELS

    make, make_input = MODELS[model]
    reference = train(_first_layer_frozen(make, False), make_input, None)
    off = small_offloader(disk_dir, tier=tier)
    try:
        got = train(_first_layer_frozen(make, True), make_input, off, settle_first=True)
    finally:
        off.close()
    assert_bitwise_equal(reference, got)
