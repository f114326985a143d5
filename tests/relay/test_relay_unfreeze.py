"""Relayed weights that come to require grad (Note [made resident] in offloadd/relay/release.py):
their group is made resident for good, once and said, and trains as it would without relay."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import offloadd
from offloadd.relay import RelayError, relay_stats
from tests.relay.cases import MakeRelayConfig, llama, llama_loss, same, step, train_llama

pytest.importorskip("transformers")

IDS = torch.randint(0, 512, (2, 12), generator=torch.Generator().manual_seed(3))


def _build() -> nn.Module:
    torch.manual_seed(0)
    return llama(4)


def test_a_layer_unfrozen_after_relay_trains_as_without_relay(
    make_relay_config: MakeRelayConfig, disk_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    plain = _build()
    plain.model.layers[3].requires_grad_(True)
    want = train_llama(plain)

    model = _build()
    weight = model.model.layers[3].mlp.up_proj.weight  # the parameter object, before relay
    offloadd.relay(model, config=make_relay_config(disk_dir))
    assert relay_stats(model).groups == 4
    train_llama(model, steps=0)
    with caplog.at_level(logging.WARNING, logger="offloadd"):
        model.model.layers[3].requires_grad_(True)  # between steps, before the optimizer
    said = [r.getMessage() for r in caplog.records if "made resident" in r.getMessage()]
    assert len(said) == 1 and "model.layers.3" in said[0], said
    assert model.model.layers[3].mlp.up_proj.weight is weight and weight.requires_grad
    st = relay_stats(model)
    assert st.groups == 3 and len(st.kept) == 0
    got = train_llama(model)
    assert all(same(a, b) for a, b in zip(want, got, strict=True))
    sd = model.state_dict()
    assert all(torch.equal(sd[k], v) for k, v in plain.state_dict().items())
    model.load_state_dict(plain.state_dict())
    assert all(
        same(a, b) for a, b in zip(train_llama(plain, 1), train_llama(model, 1), strict=True)
    )
    offloadd.unrelay(model)


def test_a_weight_unfrozen_within_resident_is_taken_as_the_block_ends(
    make_relay_config: MakeRelayConfig, disk_dir: Path
) -> None:
    plain = _build()
    plain.model.layers[1].self_attn.q_proj.weight.requires_grad_(True)
    want = train_llama(plain, 2)
    model = offloadd.relay(_build(), config=make_relay_config(disk_dir))
    with offloadd.resident(model):  # the real parameters are in place here
        model.model.layers[1].self_attn.q_proj.weight.requires_grad_(True)
    got = train_llama(model, 2)
    assert all(same(a, b) for a, b in zip(want, got, strict=True))
    assert relay_stats(model).groups == 3
    offloadd.unrelay(model)


def test_unfreezing_while_the_model_runs_is_refused(
    make_relay_config: MakeRelayConfig, disk_dir: Path
) -> None:
    model = offloadd.relay(_build(), config=make_relay_config(disk_dir))

    def unfreeze_next(module: nn.Module, args: Any) -> None:
        model.model.layers[2].requires_grad_(True)

    handle = model.model.layers[1].register_forward_pre_hook(unfreeze_next)
    with pytest.raises(RelayError, match="while the model runs; unfreeze relayed weights between"):
        llama_loss(model, IDS)
    handle.remove()
    assert relay_stats(model).groups == 4  # nothing released
    train_llama(model, 1)
    offloadd.unrelay(model)


class _Adapter(nn.Module):
    """A LoRA-like adapter around a frozen projection (as PEFT adds them, after the load)."""

    def __init__(self, base: nn.Linear) -> None:
        super().__init__()
        self.base = base
        self.a = nn.Linear(base.in_features, 4, bias=False)
        self.b = nn.Linear(4, base.out_features, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.b(self.a(x))


def _adapt(model: nn.Module) -> nn.Module:
    torch.manual_seed(1)
    for layer in model.model.layers:  # type: ignore[union-attr]
        layer.self_attn.v_proj = _Adapter(layer.self_attn.v_proj)
    return model


def test_adapters_added_after_relay_are_trained_and_never_relayed(
    make_relay_config: MakeRelayConfig, disk_dir: Path
) -> None:
    want = train_llama(_adapt(_build()))
    model = offloadd.relay(_build(), config=make_relay_config(disk_dir))
    st = relay_stats(model)
    _adapt(model)
    got = train_llama(model)
    assert all(same(a, b) for a, b in zip(want, got, strict=True))
    assert relay_stats(model).relayed_bytes == st.relayed_bytes  # the adapters stay in memory
    adapters = [p for n, p in model.named_parameters() if ".a." in n or ".b." in n]
    assert len(adapters) == 8 and all(type(p) is nn.Parameter for p in adapters)
    offloadd.unrelay(model)


def test_every_placeholder_of_a_group_unfreezes(
    make_relay_config: MakeRelayConfig, disk_dir: Path
) -> None:
    """The first placeholder releases the group; its siblings, held in the same list, answer
    with their own weights (not a RelayError)."""
    plain = _build()
    plain.model.layers[2].requires_grad_(True)
    want = train_llama(plain)
    model = offloadd.relay(_build(), config=make_relay_config(disk_dir))
    held = list(model.model.layers[2].parameters())  # placeholders, before the release
    got_back = [p.requires_grad_(True) for p in held]
    assert all(type(p) is nn.Parameter and p.requires_grad for p in got_back)
    got = train_llama(model)
    assert all(same(a, b) for a, b in zip(want, got, strict=True))
    offloadd.unrelay(model)


def test_unfrozen_between_forward_and_backward_raises_as_pytorch_would(
    make_relay_config: MakeRelayConfig, disk_dir: Path
) -> None:
    model = offloadd.relay(_build(), config=make_relay_config(disk_dir))
    loss = llama_loss(model, IDS)
    model.model.layers[0].requires_grad_(True)
    with pytest.raises(RelayError, match="replaced after forward saved them"):
        loss.backward()
    train_llama(model, 1)  # and the model goes on
    offloadd.unrelay(model)


def test_changes_made_within_resident_survive_a_release(
    make_relay_config: MakeRelayConfig, disk_dir: Path
) -> None:
    """A weight loaded with assign=True and unfrozen in the block keeps the loaded values; a
    placeholder held from before the block unfreezes its group there too."""
    model = offloadd.relay(_build(), config=make_relay_config(disk_dir))
    held = model.model.layers[0].mlp.gate_proj.weight  # a placeholder
    new = torch.full(tuple(model.model.layers[1].mlp.up_proj.weight.shape), 0.5)
    with offloadd.resident(model):
        layer = model.model.layers[1].mlp.up_proj
        layer.load_state_dict({"weight": new.clone()}, assign=True)
        layer.weight.requires_grad_(True)
        held.requires_grad_(True)
    assert relay_stats(model).groups == 2
    assert torch.equal(model.model.layers[1].mlp.up_proj.weight.detach(), new)
    assert model.model.layers[0].mlp.gate_proj.weight.requires_grad
    train_llama(model, 1)
    offloadd.unrelay(model)


def test_a_parameter_held_from_before_relay_is_taken_at_its_next_forward(
    make_relay_config: MakeRelayConfig, disk_dir: Path
) -> None:
    """The real parameter object, unfrozen itself (not its placeholder), with an optimizer over
    the objects held from before relay: its group is released where it is next swapped in."""

    def train(model: nn.Module, held: list[nn.Parameter]) -> list[Any]:
        opt = torch.optim.AdamW(held, lr=1e-2)
        out = []
        for _ in range(2):
            out.append(step(model, IDS, llama_loss))
            opt.step()
        return out

    def held(model: nn.Module) -> list[nn.Parameter]:
        return [model.model.layers[2].mlp.down_proj.weight, model.lm_head.weight]

    plain = _build()
    want_held = held(plain)
    want_held[0].requires_grad_(True)
    want = train(plain, want_held)
    model = _build()
    weights = held(model)
    offloadd.relay(model, config=make_relay_config(disk_dir))
    weights[0].requires_grad_(True)
    assert relay_stats(model).groups == 4  # nothing seen yet
    got = train(model, weights)
    assert all(same(a, b) for a, b in zip(want, got, strict=True))
    assert relay_stats(model).groups == 3
    assert model.model.layers[2].mlp.down_proj.weight is weights[0]
    offloadd.unrelay(model)
