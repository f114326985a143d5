"""A block's write side and read side (Note [a block's two sides] in blocks.py): every move
asserted against one table, and the stages a real offload goes through."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from offloadd import Offloader
from offloadd.runtime import blocks as blocks_mod
from offloadd.runtime.blocks import Back, Block, Out

pytestmark = pytest.mark.unit

ENGINE_PARAMS = ("native-threads",)


def _block() -> Block:
    return Block(1, 8192, torch.device("cpu"), 4096)


def test_moves_follow_the_table() -> None:
    b = _block()
    assert b.out is Out.PENDING and b.back is Back.ABSENT
    for new in (Out.CAPTURING, Out.CAPTURED):
        b.move_out(new)
    for new in (Back.LOADING, Back.RESIDENT, Back.UPLOADING, Back.RESIDENT, Back.ABSENT):
        b.move_back(new)
    with pytest.raises(AssertionError, match="out CAPTURED->PENDING"):
        b.move_out(Out.PENDING)  # final
    with pytest.raises(AssertionError, match="back ABSENT->UPLOADING"):
        b.move_back(Back.UPLOADING)
    held = _block()
    held.move_out(Out.HELD)
    with pytest.raises(AssertionError):
        held.move_out(Out.CAPTURED)  # held for good: only dropped when freed
    held.move_out(Out.DROPPED)


def test_every_stage_has_its_moves() -> None:
    assert set(blocks_mod._OUT_MOVES) == set(Out)
    assert set(blocks_mod._BACK_MOVES) == set(Back)


def test_an_offloaded_block_goes_out_and_back(
    disk_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Tier ssd: each block moves PENDING -> CAPTURING -> CAPTURED, and back ABSENT -> (LOADING)
    -> RESIDENT -> ABSENT; nothing else, and gradients as without offloadd."""
    seen: list[tuple[str, str, str]] = []
    move_out, move_back = Block.move_out, Block.move_back

    def out(self: Block, new: Out) -> None:
        seen.append(("out", self.out.name, new.name))
        move_out(self, new)

    def back(self: Block, new: Back) -> None:
        seen.append(("back", self.back.name, new.name))
        move_back(self, new)

    monkeypatch.setattr(Block, "move_out", out)
    monkeypatch.setattr(Block, "move_back", back)
    torch.manual_seed(0)
    lin = torch.nn.Linear(256, 256)
    x = torch.randn(64, 256, requires_grad=True)
    plain = torch.autograd.grad(lin(x).relu().square().sum(), [x, lin.weight])
    off = Offloader(tier="ssd", ssd_dirs=[str(disk_dir)], min_bytes=0)
    with off:
        loss = lin(x).relu().square().sum()
    got = torch.autograd.grad(loss, [x, lin.weight])
    off.close()
    assert all(torch.equal(a, b) for a, b in zip(plain, got, strict=True))
    outs = {m for m in seen if m[0] == "out"}
    backs = {m for m in seen if m[0] == "back"}
    assert ("out", "PENDING", "CAPTURING") in outs and ("out", "CAPTURING", "CAPTURED") in outs
    assert outs <= {("out", "PENDING", "CAPTURING"), ("out", "CAPTURING", "CAPTURED")}, outs
    assert ("back", "RESIDENT", "ABSENT") in backs, backs
    assert backs <= {
        ("back", "ABSENT", "LOADING"),
        ("back", "LOADING", "RESIDENT"),
        ("back", "ABSENT", "RESIDENT"),
        ("back", "RESIDENT", "ABSENT"),
    }, backs
