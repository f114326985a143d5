"""offloadd.relay: losses and gradients bit-identical to the model without relay; what a user
can do with a relayed model, and the clear errors for what they cannot."""

from __future__ import annotations

import copy
import gc
import importlib
import io
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

import offloadd
from offloadd.relay import RelayError
from offloadd.runtime.identity import storage_of
from tests.relay.cases import (
    CASES,
    Layered,
    MakeRelayConfig,
    build,
    freeze_layers,
    llama,
    same,
    square_loss,
    step,
    train,
)


@pytest.mark.parametrize("window", [1, 2, 64])
@pytest.mark.parametrize("case", list(CASES))
def test_gradients_bit_identical(
    make_relay_config: MakeRelayConfig, case: str, window: int, disk_dir: Path, backend: str
) -> None:
    want = train(build(case), case)
    model = offloadd.relay(build(case), window=window, config=make_relay_config(disk_dir))
    got = train(model, case)
    st = offloadd.relay_stats(model)
    assert st.groups > 0 and st.written_bytes >= st.relayed_bytes  # records are whole pages
    assert st.read_bytes >= 3 * st.relayed_bytes  # read back every step, forward at least
    for i, (a, b) in enumerate(zip(want, got, strict=True)):
        assert same(a, b), f"step {i}: losses or gradients differ"  # type: ignore[arg-type]
    offloadd.unrelay(model)


def test_held_weights_flat_in_depth(make_relay_config: MakeRelayConfig, disk_dir: Path) -> None:
    """What relay holds is a few groups, however deep the model: 4 and 16 layers alike."""
    peaks = []
    for depth in (4, 16):
        torch.manual_seed(0)
        model = freeze_layers(Layered(layers=depth, d=256))
        offloadd.relay(model, window=2, config=make_relay_config(disk_dir))
        for _ in range(3):
            step(model, torch.randn(4, 16), square_loss)
        st = offloadd.relay_stats(model)
        group = st.relayed_bytes // st.groups
        assert st.peak_resident_bytes <= 6 * group, (depth, st)
        peaks.append(st.peak_resident_bytes)
        offloadd.unrelay(model)
    assert peaks[1] <= 1.1 * peaks[0], peaks


@pytest.mark.parametrize("window", [1, 2, 3])
def test_forward_carries_its_last_groups_into_backward(
    make_relay_config: MakeRelayConfig, window: int, disk_dir: Path
) -> None:
    """A step reads each group twice but the last ``window`` once: forward keeps them for
    backward, which needs them first. What is held stays ``window`` groups."""
    torch.manual_seed(0)
    model = offloadd.relay(
        freeze_layers(Layered(layers=8)), window=window, config=make_relay_config(disk_dir)
    )
    x = torch.randn(3, 16)
    step(model, x, square_loss)
    before = offloadd.relay_stats(model, reset_peak=True)
    step(model, x, square_loss)
    after = offloadd.relay_stats(model)
    group = (after.read_bytes - before.read_bytes) / (2 * 8 - window)
    assert group == before.written_bytes / 8  # every group pads to the same size here
    assert after.peak_resident_bytes <= window * group, (after, group)
    assert after.swaps - before.swaps == 2 * 8  # carried or read, each group comes in twice
    offloadd.unrelay(model)


def test_tied_weights_stay_resident(make_relay_config: MakeRelayConfig, disk_dir: Path) -> None:
    want = train(build_tied := (lambda: (torch.manual_seed(0), llama(tied=True))[1])(), "hf-llama")
    model = offloadd.relay(build_tied, config=make_relay_config(disk_dir))
    st = offloadd.relay_stats(model)
    assert "model.embed_tokens.weight" in st.kept and "lm_head.weight" in st.kept
    assert type(model.lm_head.weight) is nn.Parameter  # tied: never a placeholder
    offloadd.unrelay(model)
    torch.manual_seed(0)
    model = offloadd.relay(llama(tied=True), config=make_relay_config(disk_dir))
    got = train(model, "hf-llama")
    assert all(same(a, b) for a, b in zip(want, got, strict=True))  # type: ignore[arg-type]


class Bumping(nn.Linear):
    """A layer that may change its own frozen weight in place in its forward."""

    bump = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.bump:
            with torch.no_grad():
                self.weight.mul_(2)
        return super().forward(x)


class InPlace(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Bumping(256, 256) for _ in range(2)]).requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def test_misuse_raises_naming_the_weight(
    make_relay_config: MakeRelayConfig, disk_dir: Path
) -> None:
    model = offloadd.relay(InPlace(), config=make_relay_config(disk_dir, chunk_bytes=4096))
    w = model.layers[0].weight
    assert w.shape == (256, 256) and w.dtype == torch.float32 and w.device.type == "cpu"
    assert w.is_cpu and not w.is_meta and not w.is_cuda  # the real device's answers
    assert storage_of(w) is None  # the Offloader's parameter notes never ask for its bytes
    assert sum(p.numel() for p in model.parameters()) == 2 * (256 * 256 + 256)
    for misuse in (
        lambda: w.sum(),
        lambda: w + 1,
        lambda: w.mul_(2),
        lambda: w.data.zero_(),
        lambda: torch.nn.functional.linear(torch.ones(256), w),
        lambda: torch.save(model, io.BytesIO()),
        lambda: copy.deepcopy(model),
        lambda: model.layers[0].to(torch.float64),
    ):
        with pytest.raises(
            RelayError, match=r"layers\.0\.weight|as a whole|pickled or deep-copied"
        ):
            misuse()
    model.layers[1].bump = True
    with pytest.raises(RelayError, match=r"changed in place during forward: layers\.1\.weight"):
        model(torch.ones(3, 256))
    model.layers[1].bump = False
    assert type(model.layers[1].weight).__name__ == "RelayedWeight"  # swapped back
    with pytest.raises(RelayError, match="relayed already"):
        offloadd.relay(model, config=make_relay_config(disk_dir))
    offloadd.unrelay(model)
    with pytest.raises(RelayError, match="relay_window"):
        offloadd.relay(InPlace(), window=0, config=make_relay_config(disk_dir))
    with pytest.raises(RelayError, match=r"tier: relay keeps .* not 'keep'"):
        offloadd.relay(InPlace(), config=make_relay_config(disk_dir, tier="keep"))


def test_exception_in_forward_leaves_it_usable(
    make_relay_config: MakeRelayConfig, disk_dir: Path
) -> None:
    torch.manual_seed(0)
    model = offloadd.relay(freeze_layers(Layered()), config=make_relay_config(disk_dir))
    with pytest.raises(RuntimeError):
        model(torch.randn(3, 17))  # wrong width: the first layer raises
    torch.manual_seed(0)
    ref = freeze_layers(Layered())
    x = torch.randn(3, 16)
    assert same(step(ref, x, square_loss), step(model, x, square_loss))
    offloadd.unrelay(model)


def test_state_dict_load_and_to(make_relay_config: MakeRelayConfig, disk_dir: Path) -> None:
    torch.manual_seed(0)
    ref = freeze_layers(Layered())
    torch.manual_seed(0)
    model = offloadd.relay(freeze_layers(Layered()), config=make_relay_config(disk_dir))
    sd = model.state_dict()
    assert sd.keys() == ref.state_dict().keys()
    assert all(torch.equal(sd[k], v) for k, v in ref.state_dict().items())
    buf = io.BytesIO()
    torch.save(sd, buf)  # own storage per weight: savers that refuse shared storage work too
    assert len({v.untyped_storage().data_ptr() for v in sd.values()}) == len(sd)

    torch.manual_seed(5)
    other = freeze_layers(Layered())
    model.load_state_dict(other.state_dict())
    x = torch.randn(4, 16)
    assert same(step(other, x, square_loss), step(model, x, square_loss))
    model.load_state_dict(ref.state_dict(), assign=True)
    assert same(step(ref, x, square_loss), step(model, x, square_loss))

    loss = square_loss(model, x)
    model.layers.load_state_dict(
        other.layers.state_dict()
    )  # frozen ones, between forward and backward
    with pytest.raises(RelayError, match="replaced after forward"):
        loss.backward()

    ref.load_state_dict(model.state_dict())
    model.to(torch.float64)
    ref.to(torch.float64)
    assert same(step(ref, x.double(), square_loss), step(model, x.double(), square_loss))
    assert offloadd.relay_stats(model).groups == 4
    offloadd.unrelay(model)


def test_resident_and_unrelay(make_relay_config: MakeRelayConfig, disk_dir: Path) -> None:
    torch.manual_seed(0)
    model = freeze_layers(Layered())
    original = model.layers[2][1].weight
    values = original.detach().clone()
    offloadd.relay(model, config=make_relay_config(disk_dir))
    with offloadd.resident(model):
        assert torch.equal(model.layers[2][1].weight, values)
        with torch.no_grad():
            model.layers[2][1].weight.add_(1)
    assert type(model.layers[2][1].weight).__name__ == "RelayedWeight"
    offloadd.unrelay(model)
    assert model.layers[2][1].weight is original  # the same parameter object, values in place
    assert torch.equal(original, values + 1)


def test_dropped_model_stops_its_store(make_relay_config: MakeRelayConfig, disk_dir: Path) -> None:
    before = threading.active_count()
    torch.manual_seed(0)
    model = offloadd.relay(freeze_layers(Layered()), config=make_relay_config(disk_dir))
    step(model, torch.randn(2, 16), square_loss)
    del model
    gc.collect()
    assert threading.active_count() <= before
    assert not list(disk_dir.iterdir())


def test_host_store_round_trip() -> None:
    """The cpu tier's store (a GPU model's pinned host copies) hands out what it was given; to a
    model on the CPU (moved there after relay) as a copy, never its own record."""
    from offloadd.relay.slabs import Slabs
    from offloadd.relay.store import HostStore, open_store

    store = HostStore()
    data = torch.randint(0, 255, (10_000,), dtype=torch.uint8)
    rec = store.write("g", data)
    t = store.read(rec, Slabs(keep=1))
    t.wait()
    assert t.slab is not None and torch.equal(t.slab[: data.numel()], data)
    assert t.slab.data_ptr() != rec.places[0].data_ptr()  # type: ignore[attr-defined]
    cpu_tier = offloadd.Config(tier="cpu")
    assert isinstance(open_store(cpu_tier, torch.device("cuda")), HostStore)
    if torch.cuda.is_available():  # relayed on the host, then moved to the GPU
        assert isinstance(open_store(cpu_tier, torch.device("cpu")), HostStore)
    else:
        with pytest.raises(RelayError, match="CPU model's weights on a machine without a GPU"):
            open_store(cpu_tier, torch.device("cpu"))


def test_weights_on_several_devices_are_refused(
    make_relay_config: MakeRelayConfig, disk_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A model split across devices (device_map="auto") is refused before anything is written.
    This machine has one device: the groups found are made to say two."""
    surface = importlib.import_module("offloadd.relay.surface")

    def two_devices(
        model: nn.Module, min_bytes: int, meta: bool = False
    ) -> tuple[list[Any], list[str]]:
        on = [
            SimpleNamespace(param=SimpleNamespace(device=torch.device(d)))
            for d in ("cpu", "cuda:1")
        ]
        return [SimpleNamespace(entries=[e]) for e in on], []

    monkeypatch.setattr(surface, "find_groups", two_devices)
    with pytest.raises(RelayError, match=r"several devices \(cpu, cuda:1\)"):
        offloadd.relay(InPlace(), config=make_relay_config(disk_dir))
