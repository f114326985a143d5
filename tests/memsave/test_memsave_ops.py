"""memsave's C++ autograd functions (csrc/memsave/autograd_ops.cpp): the graph they record behaves as plain
PyTorch's and as memsave's Python functions (which run under ``torch_ops_only``) wherever a user
can see it: the saved tensors that hooks see, in-place writes on views, version counters,
backward twice, gradients of a subset of the inputs, double and forward-mode differentiation.
The values themselves are compared bit for bit in test_memsave_layers.py, test_memsave.py and
test_memsave_kernels.py.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

from offloadd.memsave import kernels
from offloadd.memsave.bits import packed_bytes
from offloadd.memsave.replace import memsave

pytestmark = pytest.mark.unit


@pytest.fixture
def native() -> kernels.Kernels:
    """The native library, for the tests of its C++ functions alone."""
    lib = kernels.native()
    if lib is None:
        pytest.skip("memsave's native library is unavailable here")
    return lib


def rand(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def frozen_conv(bias: bool = True) -> nn.Conv2d:
    conv = nn.Conv2d(3, 4, 3, padding=1, bias=bias)
    conv.weight.requires_grad_(False)
    return conv


def test_the_nodes_are_the_cpp_functions(memsave_path: str) -> None:
    x = rand(2, 3, 5, 5).requires_grad_()
    relu = memsave(nn.ReLU())(x).grad_fn
    conv = memsave(frozen_conv())(x).grad_fn
    assert relu is not None and conv is not None
    if memsave_path == "native":
        assert (relu.name(), conv.name()) == ("ReluBitsBackward", "ConvSelectiveBackward")
    else:
        assert (relu.name(), conv.name()) == ("_ReLUBitsBackward", "_ConvSelectiveBackward")


def _saved(fn: Callable[[], torch.Tensor]) -> tuple[list[tuple[torch.dtype, int]], torch.Tensor]:
    seen: list[tuple[torch.dtype, int]] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        seen.append((t.dtype, t.numel()))
        return t.clone()  # what comes back in backward is the hook's, not the original

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return seen, out


@pytest.mark.parametrize("inplace", [False, True])
def test_hooks_see_the_bits_of_the_relu(memsave_path: str, inplace: bool) -> None:
    leaf = rand(3, 37).requires_grad_()
    seen, out = _saved(lambda: memsave(nn.ReLU(inplace))(leaf * 1))
    assert seen == [(torch.uint8, packed_bytes(leaf.numel()))]
    out.sum().backward()
    assert leaf.grad is not None and torch.equal(leaf.grad, (leaf > 0).float())


@pytest.mark.parametrize("x_grad", [True, False])
def test_hooks_see_only_the_weight_of_a_frozen_conv(memsave_path: str, x_grad: bool) -> None:
    conv = frozen_conv()  # the bias trains: a graph is built even for an x without grad
    plain = nn.Conv2d(3, 4, 3, padding=1)
    plain.load_state_dict(conv.state_dict())
    plain.weight.requires_grad_(False)
    x = rand(2, 3, 6, 6).requires_grad_(x_grad)
    seen, out = _saved(lambda: memsave(conv)(x))
    assert seen == [(torch.float32, conv.weight.numel())]
    out.square().sum().backward()
    plain(x.detach().requires_grad_(x_grad)).square().sum().backward()
    assert conv.bias.grad is not None and plain.bias.grad is not None
    assert torch.equal(conv.bias.grad, plain.bias.grad)


def test_relu_in_place_on_a_view_rebases_its_base(memsave_path: str) -> None:
    leaf = rand(4, 6, seed=1).requires_grad_()
    grads = []
    for m in (nn.ReLU(inplace=True), memsave(nn.ReLU(inplace=True))):
        leaf.grad = None
        base = leaf * 2
        out = m(base[1:3])
        assert out._base is base
        (base * rand(4, 6, seed=2)).sum().backward()
        grads.append(leaf.grad)
    assert torch.equal(grads[0], grads[1])


def test_in_place_on_a_view_of_a_leaf_is_refused_before_writing(native: kernels.Kernels) -> None:
    leaf = rand(4, 6).requires_grad_()
    before = leaf.detach().clone()
    with pytest.raises(RuntimeError, match="a view of a leaf Variable that requires grad"):
        memsave(nn.ReLU(inplace=True))(leaf[1:3])
    assert torch.equal(leaf.detach(), before)


def test_in_place_bumps_the_version_once_as_plain(native: kernels.Kernels) -> None:
    for dtype in (torch.float32, torch.bfloat16):
        x = rand(5, 7).to(dtype).requires_grad_() * 1
        y = x * 1
        nn.ReLU(inplace=True)(x)
        memsave(nn.ReLU(inplace=True))(y)
        assert x._version == y._version


@pytest.mark.parametrize("which", ["relu", "conv"])
def test_backward_twice(memsave_path: str, which: str) -> None:
    make = (lambda: nn.ReLU()) if which == "relu" else frozen_conv
    plain = make()
    ms = memsave(make())
    ms.load_state_dict(plain.state_dict())
    x = rand(2, 3, 5, 5).requires_grad_()
    grads = []
    for m in (plain, ms):
        x.grad = None
        loss = m(x).square().sum()
        loss.backward(retain_graph=True)
        loss.backward()  # accumulates: twice the gradient
        with pytest.raises(RuntimeError, match="backward through the graph a second time"):
            loss.backward()
        grads.append(x.grad)
    assert torch.equal(grads[0], grads[1])


def test_gradients_of_a_subset_of_the_inputs(memsave_path: str) -> None:
    conv = frozen_conv()
    plain = nn.Conv2d(3, 4, 3, padding=1)
    plain.load_state_dict(conv.state_dict())
    plain.weight.requires_grad_(False)
    ms = memsave(conv)
    x = rand(2, 3, 6, 6).requires_grad_()
    for wrt in ("bias", "x"):
        got = []
        for m in (plain, ms):
            loss = m(x).square().sum()
            (g,) = torch.autograd.grad(loss, [m.bias if wrt == "bias" else x])
            got.append(g)
        assert torch.equal(got[0], got[1])


@pytest.mark.filterwarnings(
    "ignore:`torch.jit.script` is deprecated:DeprecationWarning"
)  # make_dual
def test_forward_mode_ad_is_refused_by_name(native: kernels.Kernels) -> None:
    import torch.autograd.forward_ad as fwad

    x = rand(2, 3, 5, 5).requires_grad_()
    with fwad.dual_level():
        dual = fwad.make_dual(x, torch.ones_like(x))
        with pytest.raises(RuntimeError, match="forward-mode AD"):
            memsave(nn.ReLU())(dual)
        with pytest.raises(RuntimeError, match="forward-mode AD"):
            memsave(frozen_conv())(dual)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_under_autocast_bitwise_plain(memsave_path: str, dtype: torch.dtype) -> None:
    # Note [autocast] in memsave/conv.py: autocast casts at F.conv*, above aten.convolution
    def make() -> nn.Module:
        torch.manual_seed(3)
        model = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1),
            nn.BatchNorm2d(8),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.ConvTranspose2d(8, 4, 2, stride=2),
        )
        model[0].weight.requires_grad_(False)
        model[4].weight.requires_grad_(False)
        return model

    x = rand(2, 3, 8, 8, seed=4)
    results = []
    for model in (make(), memsave(make())):
        leaf = x.clone().requires_grad_()
        with torch.autocast("cpu", dtype=dtype):
            out = model(leaf)
        out.float().square().sum().backward()
        grads = [p.grad for p in model.parameters() if p.requires_grad]
        results.append([out.detach(), leaf.grad, *grads])
    for u, v in zip(*results, strict=True):
        assert u.dtype == v.dtype and torch.equal(u, v)
