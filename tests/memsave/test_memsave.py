"""memsave on whole models and as a whole: the class swap, freezing between steps,
double backward, transformers' ResNet and ViT, composition with an Offloader, the gate of a fully
trainable model, and the equivalence suite's models. Layer by layer: tests/memsave/test_memsave_layers.py.
"""

from __future__ import annotations

import copy
import pickle
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

import offloadd
from offloadd.memsave.replace import memsave, unmemsave
from offloadd.tools.bench.memsave import Logits
from tests._support.helpers import MakeOffloader
from tests._support.memsave_cases import DTYPES, compare, rand, run, same

ENGINE_PARAMS = ("python",)  # the offload composition tests: one engine is enough here


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


def test_memsave_with_offloader(make_offloader: MakeOffloader, disk_dir: Path) -> None:
    torch.manual_seed(0)
    plain = freeze(tiny_resnet(), "norm-bias").train()
    ms = memsave(copy.deepcopy(plain))
    x = rand(4, 3, 32, 32)
    a, _ = run(plain, x, True, 0, steps=2)
    results = []
    off = make_offloader(disk_dir, min_bytes=0)
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
def test_sgd_steps_with_offload_match_plain(
    make_offloader: MakeOffloader, disk_dir: Path, dropout: float
) -> None:
    """helpers.train (SGD, three steps, RNG state compared; every parameter trains, as the
    equivalence tests' models do): plain PyTorch without offloadd against memsave inside an
    Offloader."""
    from tests._support.helpers import assert_bitwise_equal, train

    def make(memsaved: bool) -> Callable[[], nn.Module]:
        def build() -> nn.Module:
            model = small_cnn()
            model[7].p = dropout
            return memsave(model) if memsaved else model

        return build

    def make_input(gen: torch.Generator) -> torch.Tensor:
        return torch.randn(4, 3, 8, 8, generator=gen)

    reference = train(make(False), make_input, None)
    off = make_offloader(disk_dir, min_bytes=0)
    try:
        got = train(make(True), make_input, off, settle_first=True)
        off.synchronize()
    finally:
        off.close()
    assert_bitwise_equal(reference, got)


# -- a fully trainable model: nothing changes (Note [fully trainable] in memsave/frozen_gate.py) ---


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
    make_offloader: MakeOffloader, model: str, tier: str, disk_dir: Path
) -> None:
    """The models of tests/properties/test_equivalence.py, first layer frozen: memsaved and offloaded,
    bitwise the unmodified model trained without offloadd (dropout on)."""
    from tests._support.helpers import assert_bitwise_equal, train
    from tests.properties.test_equivalence import MODELS

    make, make_input = MODELS[model]
    reference = train(_first_layer_frozen(make, False), make_input, None)
    off = make_offloader(disk_dir, tier=tier)
    try:
        got = train(_first_layer_frozen(make, True), make_input, off, settle_first=True)
    finally:
        off.close()
    assert_bitwise_equal(reference, got)


def test_the_gate_is_set_at_memsave_for_submodules_called_directly() -> None:
    """A fully trainable model memsaved, then run through its submodules (``model.backbone(x)``,
    which never runs the model's own hook): plain PyTorch's forward, so a gradient penalty's
    double backward works. The masks were on until the model's own forward first ran, and it
    raised "trying to differentiate twice" (as under ``OFFLOADD_MEMSAVE=1``, which memsaves from
    inside the model's first call)."""
    torch.manual_seed(0)
    model = memsave(nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64)))
    x = torch.randn(32, 64, requires_grad=True)
    y = model[2](model[1](model[0](x)))
    (gx,) = torch.autograd.grad(y.square().sum(), x, create_graph=True)
    gx.square().sum().backward()
    assert model[0].weight.grad is not None
