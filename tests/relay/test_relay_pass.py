"""Relay's saved-tensor pair for the tensors it passes on, in C (csrc/hot_path/passing.c):
what it passes, what it hands to relay's Python hooks, and relay trained with it and without."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import offloadd
from offloadd import Offloader
from offloadd.relay import backward
from offloadd.relay.state import state_of
from tests._support.helpers import linked_tensors
from tests.relay.cases import Layered, MakeRelayConfig, freeze_layers, same, square_loss, step

if backward.PassPack is None:  # pragma: no cover - CI builds it
    pytest.fail("offloadd.runtime._held has no PassPack (it must be built wherever CI runs)")
PassPack, PassUnpack = backward.PassPack, backward.PassUnpack


class _Sub(torch.Tensor):
    pass


def _slow(tag: str) -> Any:
    return lambda x: (tag, x)


def test_pass_pack_passes_what_lies_on_no_slab() -> None:
    t, p = torch.randn(4), torch.nn.Parameter(torch.randn(3))
    alone = PassPack({}, _slow("slow"), None, torch.Tensor, torch.nn.Parameter)
    assert alone(t) is t and alone(p) is p  # no hooks below, no grad_fn: kept as it is
    out = p * 2  # an op's output: kept without its grad_fn (Note [passed on detached])
    kept = alone(out)
    assert kept is not out and kept.grad_fn is None and not kept.requires_grad
    assert kept.data_ptr() == out.data_ptr() and kept._version == out._version
    out.add_(1)  # the version counter is shared: autograd still sees a write after the save
    assert kept._version == out._version
    below = PassPack({}, _slow("slow"), _slow("outer"), torch.Tensor, torch.nn.Parameter)
    assert below(t) == ("outer", t) and below(out) == ("outer", out)  # theirs to keep


def test_pass_pack_gives_relay_what_may_be_a_weight() -> None:
    slab = torch.zeros(64)
    view = slab[8:24].view(4, 4)
    slabs = {slab.untyped_storage()._cdata: "group"}
    pack = PassPack(slabs, _slow("slow"), _slow("outer"), torch.Tensor, torch.nn.Parameter)
    assert pack(view) == ("slow", view)  # on a slab swapped in
    sub = torch.randn(2).as_subclass(_Sub)
    assert pack(sub) == ("slow", sub)  # a subclass: relay's Python pack decides
    sparse = torch.randn(3, 3).to_sparse()
    assert pack(sparse) == ("slow", sparse)  # no storage of its own
    del slabs[slab.untyped_storage()._cdata]  # swapped out: passed on again
    assert pack(view) == ("outer", view)


def test_pass_pair_raises_what_its_hooks_raise() -> None:
    def boom(x: Any) -> Any:
        raise KeyError("below")

    pack = PassPack({}, _slow("slow"), boom, torch.Tensor, torch.nn.Parameter)
    with pytest.raises(KeyError, match="below"):
        pack(torch.randn(2))
    unpack = PassUnpack(backward.WeightRef, _slow("slow"), boom)
    with pytest.raises(KeyError, match="below"):
        unpack(torch.randn(2))
    with pytest.raises(TypeError):
        PassPack([], _slow("slow"), None, torch.Tensor, torch.nn.Parameter)  # not a dict
    with pytest.raises(TypeError):
        PassUnpack("WeightRef", _slow("slow"), None)  # not a type
    with pytest.raises(TypeError):
        pack(torch.randn(2), torch.randn(2))  # one tensor a call


def test_pass_unpack_gives_relay_its_refs_only() -> None:
    ref = backward.WeightRef.__new__(backward.WeightRef)
    ref.unpacked = True  # its finalizer then does nothing
    t = torch.randn(3)
    assert PassUnpack(backward.WeightRef, _slow("slow"), None)(t) is t
    assert PassUnpack(backward.WeightRef, _slow("slow"), _slow("outer"))(t) == ("outer", t)
    assert PassUnpack(backward.WeightRef, _slow("slow"), _slow("outer"))(ref) == ("slow", ref)


@pytest.mark.parametrize("pair", ["c", "python"])
@pytest.mark.parametrize("below", [None, "keep", "ssd"])
def test_relay_trains_alike_with_either_pair(
    make_relay_config: MakeRelayConfig,
    disk_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    pair: str,
    below: str | None,
) -> None:
    """Relay with its pair in C and with the Python one (where the library is not built):
    gradients bit for bit the plain model's, alone and under an Offloader's hooks, which get
    every tensor but the weights."""
    if pair == "python":
        monkeypatch.setattr(backward, "PassPack", None)
        monkeypatch.setattr(backward, "PassUnpack", None)
    x = torch.randn(6, 16, generator=torch.Generator().manual_seed(1))
    torch.manual_seed(0)
    want = step(freeze_layers(Layered()), x, square_loss)
    torch.manual_seed(0)
    model = offloadd.relay(freeze_layers(Layered()), config=make_relay_config(disk_dir))
    off = None
    if below is not None:
        off = Offloader(tier=below, ssd_dirs=[str(disk_dir)], min_bytes=0)
    for _ in range(3):
        assert same(want, step(model, x, square_loss, off))
    hooks = state_of(model).relay.saved.hooks()
    assert (type(hooks[0]) is PassPack) == (pair == "c")
    if off is not None:
        assert off.stats().saved_tensors > 0  # the tensors relay passed on reached it
        off.close()
    offloadd.unrelay(model)


class _SavesOutputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 128), nn.Sigmoid())
            for _ in range(3)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


@pytest.mark.parametrize("pair", ["c", "python"])
def test_graphs_dropped_without_backward_free_what_relay_passed_on(
    make_relay_config: MakeRelayConfig, disk_dir: Path, monkeypatch: pytest.MonkeyPatch, pair: str
) -> None:
    """ReLU and sigmoid save their own outputs. Kept with their grad_fn where no hooks are below
    relay's, each would be a cycle through the graph that no collection frees: forwards whose
    graphs are dropped unused (an evaluation with grad on, a step that raised) or kept by
    retain_graph leaked every such activation (Note [passed on detached])."""
    if pair == "python":
        monkeypatch.setattr(backward, "PassPack", None)
        monkeypatch.setattr(backward, "PassUnpack", None)
    torch.manual_seed(0)
    model = offloadd.relay(freeze_layers(_SavesOutputs()), config=make_relay_config(disk_dir))
    x = torch.randn(4, 128, requires_grad=True)
    model(x).sum().backward()  # warm: slabs, views, the pair made
    before = linked_tensors()
    for _ in range(4):
        model(x)  # dropped without a backward
    y = model(x).sum()
    y.backward(retain_graph=True)
    del y  # the retained graph dropped
    assert linked_tensors() == before  # 6 more a forward when kept with their grad_fn
    assert not any(state_of(model).relay.saved._pending.values())  # every ref forgotten
    offloadd.unrelay(model)
