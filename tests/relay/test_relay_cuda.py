"""offloadd.relay on a GPU: the cpu tier's host-to-device relay (pinned records, copies on a side
stream; Note [host relay] in relay/store.py) and the ssd tier's reads copied to the device.
Losses and gradients bit-identical to the model without relay; device memory for the frozen
weights flat in depth. Skipped without a GPU."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

import offloadd
from offloadd.runtime.compiled import unseen
from tests._support.helpers import MakeOffloader
from tests.relay.cases import CASES as SHARED
from tests.relay.cases import (
    Case,
    Layered,
    MakeRelayConfig,
    freeze_layers,
    same,
    square_loss,
    step,
)
from tests.relay.cases import build as build_case
from tests.relay.cases import train as train_case

pytestmark = pytest.mark.cuda


@pytest.fixture(autouse=True)
def deterministic() -> Iterator[None]:
    """Kernels that give the same bits every run, with or without relay: cuDNN's deterministic
    convolutions, and the math attention (memory-efficient attention's backward adds with
    atomics)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    before = torch.backends.cudnn.deterministic
    torch.backends.cudnn.deterministic = True
    try:
        with sdpa_kernel([SDPBackend.MATH]):
            yield
    finally:
        torch.backends.cudnn.deterministic = before


CUDA = "cuda"
# the shared cases, the residual stack larger: a step of work on the GPU
CASES: dict[str, Case] = {
    **SHARED,
    "layered": (
        lambda: freeze_layers(Layered(layers=6, d=256)),
        lambda g: torch.randn(64, 16, generator=g),
        square_loss,
    ),
}


def build(case: str, device: str = CUDA) -> nn.Module:
    return build_case(case, CASES, device)


def train(model: nn.Module, case: str, steps: int = 3, device: str = CUDA) -> list[object]:
    return train_case(model, case, steps, CASES, device)


def assert_same(want: list[object], got: list[object]) -> None:
    for i, (a, b) in enumerate(zip(want, got, strict=True)):
        assert same(a, b), f"step {i}: losses or gradients differ"  # type: ignore[arg-type]


@pytest.mark.parametrize("window", [1, 2])
@pytest.mark.parametrize("tier", ["cpu", "ssd"])
@pytest.mark.parametrize("case", list(CASES))
def test_cuda_relay_bit_identical(
    make_relay_config: MakeRelayConfig, case: str, tier: str, window: int, disk_dir: Path
) -> None:
    want = train(build(case), case)
    model = offloadd.relay(
        build(case), window=window, config=make_relay_config(disk_dir, tier=tier)
    )
    assert all(p.is_cuda for p in model.parameters())  # placeholders say the real device
    got = train(model, case)
    st = offloadd.relay_stats(model)
    assert st.groups > 0 and st.read_bytes >= 3 * st.relayed_bytes
    assert_same(want, got)
    offloadd.unrelay(model)
    assert all(p.is_cuda and p.numel() > 0 for p in model.parameters())


@pytest.mark.parametrize("tier", ["cpu", "ssd"])
def test_cuda_device_memory_flat_in_depth(
    make_relay_config: MakeRelayConfig, tier: str, disk_dir: Path
) -> None:
    """The device holds a few groups of frozen weights, however deep the model: a step's peak of
    allocated device memory is the same at 4 and 16 layers, and far below the frozen bytes."""
    peaks = []
    frozen = 0
    for depth in (4, 16):
        torch.manual_seed(0)
        model = freeze_layers(Layered(layers=depth, d=512)).cuda()
        frozen = sum(p.nbytes for p in model.parameters() if not p.requires_grad)
        offloadd.relay(model, window=2, config=make_relay_config(disk_dir, tier=tier))
        x = torch.randn(4, 16, device=CUDA)
        step(model, x, square_loss)  # warm: the caching allocator's blocks, the side stream
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        for _ in range(2):
            step(model, x, square_loss)
        torch.cuda.synchronize()
        peaks.append(torch.cuda.max_memory_allocated() - base)
        offloadd.unrelay(model)
        del model
    group = frozen / 16
    assert peaks[1] <= 1.1 * peaks[0], peaks
    assert peaks[1] <= 6 * group, (peaks, group)  # window 2: a few groups, not 16


def test_cuda_with_activation_offload(
    make_offloader: MakeOffloader, make_relay_config: MakeRelayConfig, disk_dir: Path
) -> None:
    """Relay's hook above the Offloader's on a GPU: weights become refs, the activations go to
    the Offloader's cpu tier."""
    case = "layered"
    want = train(build(case), case)
    model = offloadd.relay(build(case), config=make_relay_config(disk_dir, tier="cpu"))
    off = make_offloader(disk_dir, tier="cpu")
    _, make_input, loss_of = CASES[case]
    g = torch.Generator().manual_seed(1)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.05)
    got = []
    for _ in range(3):
        got.append(step(model, make_input(g).to(CUDA), loss_of, off))  # type: ignore[arg-type]
        opt.step()
    assert off.stats().offloaded_bytes > 0
    off.close()
    assert_same(want, got)
    offloadd.unrelay(model)


def test_cuda_moved_after_relay(make_relay_config: MakeRelayConfig, disk_dir: Path) -> None:
    """Relayed on the CPU (ssd tier), then moved to the GPU: reads are copied to it. Relayed on
    the GPU (cpu tier), then moved to the CPU: each read is a slab copy of the pinned record."""
    case = "hf-llama"
    want = train(build(case), case)
    model = offloadd.relay(build(case, "cpu"), config=make_relay_config(disk_dir))
    model.to(CUDA)
    assert_same(want, train(model, case))
    offloadd.unrelay(model)

    want_cpu = train(build(case, "cpu"), case, device="cpu")
    model = offloadd.relay(build(case), config=make_relay_config(disk_dir, tier="cpu"))
    model.to("cpu")
    assert_same(want_cpu, train(model, case, device="cpu"))
    offloadd.unrelay(model)


def test_cuda_state_dict_and_resident(make_relay_config: MakeRelayConfig, disk_dir: Path) -> None:
    """state_dict() reads the weights back to the GPU; resident() swaps them all in, and a load
    inside it is written back to the pinned records."""
    case = "layered"
    plain = build(case)
    model = offloadd.relay(build(case), config=make_relay_config(disk_dir, tier="cpu"))
    want = plain.state_dict()
    got = model.state_dict()
    assert want.keys() == got.keys()
    for k in want:
        assert got[k].is_cuda and torch.equal(want[k], got[k]), k
    with torch.no_grad(), offloadd.resident(model):
        model.layers[0][1].weight.mul_(2)
        plain.layers[0][1].weight.mul_(2)
    assert_same(train(plain, case), train(model, case))
    offloadd.unrelay(model)


def test_cuda_compiled(make_relay_config: MakeRelayConfig, disk_dir: Path) -> None:
    """Inductor on the GPU, relay's hooks run eagerly between the compiled regions: the same
    bits as the same model compiled with a no-op hook at the same places."""
    noop = unseen(lambda *args: None)

    def reference() -> nn.Module:
        m = build("layered")
        m.register_forward_pre_hook(noop)
        for layer in m.layers:  # type: ignore[union-attr]
            layer.register_forward_pre_hook(noop)
            layer.register_forward_hook(noop, always_call=True)
        return m

    want = train(torch.compile(reference()), "layered")  # type: ignore[arg-type]
    model = offloadd.relay(build("layered"), config=make_relay_config(disk_dir, tier="cpu"))
    assert_same(want, train(torch.compile(model), "layered"))  # type: ignore[arg-type]
    offloadd.unrelay(model)
