"""Bit-identical gradients (and RNG use: dropout is on) with and without offloadd."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

from offloadd.tools.models import GPT, GPTConfig
from tests._support.helpers import (
    MakeOffloader,
    SlowEngine,
    assert_bitwise_equal,
    train,
    train_and_compare,
)

pytestmark = pytest.mark.usefixtures("backend")


def mlp() -> nn.Module:
    return nn.Sequential(
        nn.Linear(64, 256),
        nn.ReLU(),
        nn.Dropout(0.1),
        nn.Linear(256, 256),
        nn.GELU(),
        nn.Linear(256, 8),
    )


def convnet() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1),
        nn.BatchNorm2d(16),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1),
        nn.ReLU(),
        nn.Dropout(0.1),
        nn.Flatten(),
        nn.Linear(32 * 8 * 8, 10),
    )


def encoder() -> nn.Module:
    layer = nn.TransformerEncoderLayer(64, 4, 128, dropout=0.1, batch_first=True)
    return nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)


class TinyGPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gpt = GPT(GPTConfig(vocab_size=128, seq_len=32, num_layers=2, d_model=64, num_heads=4))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.gpt(idx)


MODELS: dict[str, tuple[Callable[[], nn.Module], Callable[[torch.Generator], torch.Tensor]]] = {
    "mlp": (mlp, lambda g: torch.randn(128, 64, generator=g)),
    "convnet": (convnet, lambda g: torch.randn(8, 3, 16, 16, generator=g)),
    "encoder": (encoder, lambda g: torch.randn(4, 32, 64, generator=g)),
    "gpt": (TinyGPT, lambda g: torch.randint(0, 128, (4, 32), generator=g)),
}


@pytest.mark.every_engine
@pytest.mark.parametrize("dedup", [True, False], ids=["dedup", "nodedup"])
@pytest.mark.parametrize("tier", ["keep", "ssd", "cpu"])
@pytest.mark.parametrize("model", sorted(MODELS))
def test_gradients_bit_identical(
    make_offloader: MakeOffloader, model: str, tier: str, dedup: bool, disk_dir: Path
) -> None:
    off = make_offloader(disk_dir, tier=tier, dedup=dedup)
    # Settled first step: it writes and reads back whatever the timing (an engine that got no
    # CPU before backward would otherwise see every write forwarded and cancelled).
    st = train_and_compare(*MODELS[model], off, settle_first=True)
    assert st.saved_tensors > 0
    if tier == "ssd":
        assert st.offloaded_bytes > 0 and st.bytes_written > 0
        assert st.bytes_read + st.forwarded_bytes > 0
    else:
        assert st.bytes_written == 0
    assert st.resident_bytes == 0 and st.disk_bytes == 0  # everything released after backward


@pytest.mark.parametrize(
    ("chunk_kib", "in_place"),
    [(4, True), (64, True), (256, True), (4, False), (64, False), (1024, False)],
)
def test_chunk_and_pool_sizes(
    make_offloader: MakeOffloader, chunk_kib: int, in_place: bool, disk_dir: Path
) -> None:
    """Blocks larger than the staging pool stream through it; tiny pools force backpressure
    (in-place writes: holding more than ``staging_bytes`` of sources)."""
    make_model, make_input = MODELS["gpt"]
    reference = train(make_model, make_input, None)
    off = make_offloader(
        disk_dir,
        chunk_bytes=chunk_kib << 10,
        staging_bytes=chunk_kib << (10 if in_place else 11),
        prefetch_bytes=0,
        # slower per write as chunks grow (fewer writes): forward must outrun the writes even
        # on a loaded machine (256 KiB in place once finished every write in time: no wait)
        io_engine=SlowEngine(0.005 * max(1, chunk_kib // 64), pages=in_place),
    )
    assert (off.runtime.writer.in_place is not None) == in_place
    try:
        got = train(make_model, make_input, off)
        st = off.stats()
    finally:
        off.close()
    assert_bitwise_equal(reference, got)
    assert st.backpressure_waits > 0
