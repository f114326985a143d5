"""The values a relayed model's ``state_dict()`` hands out behave as PyTorch's, which share the
weights' storage (Note [handed-out values] in relay/handed.py): a write into one reaches the
model, a load shows in one, a conversion parts them. Each case runs the same script on a plain
model and on a relayed one, and compares every loss and gradient bit for bit."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

import offloadd
from offloadd.relay.state import is_relayed, state_of
from tests.relay.cases import Layered, MakeRelayConfig, freeze_layers, same, square_loss, step

KEY = "layers.1.1.weight"


def _ema(m: nn.Module) -> None:
    """An EMA update through a state dict made for it and dropped (timm's ModelEmaV2)."""
    with torch.no_grad():
        for k, v in m.state_dict().items():
            if k.startswith("layers."):
                v.mul_(0.5)


def _held(m: nn.Module) -> None:
    """A state dict held across forwards, written into between them."""
    sd = m.state_dict()
    x = torch.randn(3, 16, generator=torch.Generator().manual_seed(5))
    square_loss(m, x).backward()
    with torch.no_grad():
        sd[KEY].add_(1.0)
    square_loss(m, x).backward()
    with torch.no_grad():
        sd[KEY].mul_(-1.0)
    m.__dict__["_kept_sd"] = sd  # alive for the steps after


def _load_shows(m: nn.Module) -> None:
    """A load into the model shows in a value held; a write after it adds to the loaded one."""
    sd = m.state_dict()
    new = {k: torch.full_like(v, 0.01) for k, v in sd.items()}
    m.load_state_dict(new)
    assert torch.equal(sd[KEY], new[KEY])
    with torch.no_grad():
        sd[KEY].add_(0.5)


def _converted(m: nn.Module) -> None:
    """After ``.to(float64)`` a value handed out before is no longer the model's."""
    sd = m.state_dict()
    m.double()
    with torch.no_grad():
        sd[KEY].fill_(3.0)
    m.float()


def _resident_shows(m: nn.Module) -> None:
    """A weight changed inside ``resident()`` (or a plain model's ``.data``) shows in a value
    held."""
    sd = m.state_dict()
    with offloadd.resident(m) if _relayed(m) else contextlib.nullcontext():
        m.layers[1][1].weight.data.mul_(2.0)  # type: ignore[index]
    assert torch.equal(sd[KEY], m.state_dict()[KEY])
    with torch.no_grad():
        sd[KEY].sub_(0.25)


def _relayed(m: nn.Module) -> bool:
    return is_relayed(m)


def _noop_to(m: nn.Module) -> None:
    """A conversion that changes nothing keeps the values the model's, as in PyTorch."""
    sd = m.state_dict()
    m.to("cpu").float()
    with torch.no_grad():
        sd[KEY].mul_(3.0)


def _assigned(m: nn.Module) -> None:
    """``load_state_dict(assign=True)`` puts new tensors in: the values held before stay as
    they were (PyTorch's alias the old parameters)."""
    sd = m.state_dict()
    kept = sd[KEY].clone()
    m.load_state_dict({k: v * 0.5 for k, v in sd.items()}, assign=True)
    assert torch.equal(sd[KEY], kept)


def _part_sees(m: nn.Module) -> None:
    """A state_dict() of a part of the model sees a write into a value of the model's."""
    sd = m.state_dict()
    with torch.no_grad():
        sd[KEY].fill_(0.125)
    assert torch.equal(m.layers[1].state_dict()["1.weight"], sd[KEY])  # type: ignore[index]


def _inference(m: nn.Module) -> None:
    """Under inference_mode (a validation loop's checkpoint) state_dict() works."""
    with torch.inference_mode():
        sd = m.state_dict()
    assert set(sd) == set(m.state_dict())


CASES: dict[str, Callable[[nn.Module], None]] = {
    "a no-op conversion keeps them": _noop_to,
    "assign=True parts them": _assigned,
    "a part's state_dict sees a write": _part_sees,
    "state_dict under inference_mode": _inference,
    "ema through a dropped state dict": _ema,
    "a state dict held and written": _held,
    "a load shows in a held value": _load_shows,
    "a conversion parts them": _converted,
    "resident() shows in a held value": _resident_shows,
}


@pytest.mark.parametrize("case", list(CASES))
def test_state_dict_values_behave_as_pytorchs(
    case: str, make_relay_config: MakeRelayConfig, disk_dir: Path
) -> None:
    def run(relayed: bool) -> list[object]:
        torch.manual_seed(0)
        m = freeze_layers(Layered())
        if relayed:
            offloadd.relay(m, config=make_relay_config(disk_dir))
        g = torch.Generator().manual_seed(1)
        out: list[object] = [step(m, torch.randn(3, 16, generator=g), square_loss)]
        CASES[case](m)
        out += [step(m, torch.randn(3, 16, generator=g), square_loss) for _ in range(2)]
        out.append({k: v.clone() for k, v in m.state_dict().items()})
        if relayed:
            offloadd.unrelay(m)
        return out

    plain, relayed = run(False), run(True)
    for a, b in zip(plain[:-1], relayed[:-1], strict=True):
        assert same(a, b)  # type: ignore[arg-type]
    sa, sb = plain[-1], relayed[-1]
    assert isinstance(sa, dict) and isinstance(sb, dict) and sa.keys() == sb.keys()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)


def test_values_dropped_unwritten_cost_nothing(
    make_relay_config: MakeRelayConfig, disk_dir: Path
) -> None:
    m = offloadd.relay(freeze_layers(Layered()), config=make_relay_config(disk_dir))
    state = state_of(m)
    written = offloadd.relay_stats(m).written_bytes
    sd = m.state_dict()
    assert sum(len(v) for v in state.handed.values()) == 4 * 6  # a LayerNorm, 2 Linear a layer
    del sd
    gc.collect()
    assert all(h.alias is None for v in state.handed.values() for h in v)  # their memory went
    step(m, torch.randn(3, 16), square_loss)
    assert not state.handed  # forgotten at the check
    assert offloadd.relay_stats(m).written_bytes == written  # nothing written back
    offloadd.unrelay(m)


def test_a_layer_listed_twice_gives_one_value(
    make_relay_config: MakeRelayConfig, disk_dir: Path
) -> None:
    """``ModuleList([a, b, a])``: its state dict holds one tensor for both names, as PyTorch's,
    so an EMA loop over it scales the shared weight once per name."""

    def run(relayed: bool) -> torch.Tensor:
        torch.manual_seed(0)
        m = Layered(layers=2)
        m.layers = nn.ModuleList([*m.layers, m.layers[0]])
        freeze_layers(m)
        if relayed:
            offloadd.relay(m, config=make_relay_config(disk_dir))
        sd = m.state_dict()
        assert sd["layers.0.1.weight"] is sd["layers.2.1.weight"] or not relayed
        _ema(m)
        w = m.state_dict()["layers.0.1.weight"].clone()
        if relayed:
            offloadd.unrelay(m)
        return w

    assert torch.equal(run(False), run(True))


def test_a_write_through_that_fails_is_tried_again(
    make_relay_config: MakeRelayConfig, disk_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The store refuses the write (a full disk): RelayError naming the weight, the model keeps
    its old weights, and the next check writes it; the value freed meanwhile or not."""
    from offloadd.relay import RelayError, handed

    m = offloadd.relay(freeze_layers(Layered()), config=make_relay_config(disk_dir))
    state = state_of(m)
    sd = m.state_dict()
    with torch.no_grad():
        sd[KEY].fill_(0.25)
    want = sd[KEY].clone()
    del sd

    def full(*args: object) -> None:
        raise OSError(28, "No space left on device")

    with monkeypatch.context() as patched:
        patched.setattr(handed, "write_group", full)
        with pytest.raises(
            RelayError, match=r"values of layers\.1\.1\.weight failed .*tried again"
        ):
            handed.write_through(state)
    handed.write_through(state)
    assert torch.equal(m.state_dict()[KEY], want)
    offloadd.unrelay(m)
