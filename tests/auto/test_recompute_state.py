"""A recomputed block computes what its forward did, or backward says so (Note [recomputed state]
in offloadd/auto/recompute.py): Python's and NumPy's RNG restored, blocks that change their own
attributes never recomputed, anything else caught by the outputs' fingerprints."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from offloadd import Offloader
from offloadd.auto.recompute import RecomputeMismatch, fingerprint
from offloadd.auto.solver import KEEP, RECOMPUTE, InfeasibleBudget
from tests._support.auto_train import set_plans

_TICKS = [0]  # a global the "global" block reads and moves: out of any check's sight


class _Block(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.fc1, self.fc2, self.kind = nn.Linear(32, 64), nn.Linear(64, 32), kind
        self.calls = 0
        self.stat = torch.zeros(())  # a tensor that is neither a parameter nor a buffer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = 1.0
        if self.kind == "random":  # host RNGs: restored for the recomputation
            scale = 1.0 + random.random() + float(np.random.rand())
        elif self.kind == "counter":
            self.calls += 1
            scale = 1.0 / self.calls
        elif self.kind == "tensor":
            with torch.no_grad():
                self.stat.mul_(0.5).add_(x.detach().abs().mean())
            scale = 1.0 / (1.0 + float(self.stat))
        elif self.kind == "global":
            _TICKS[0] += 1
            scale = 1.0 / _TICKS[0]
        h = torch.nn.functional.gelu(self.fc1(x))
        if self.kind == "kept":
            self.last = h.detach()  # a new tensor each call (a map kept to look at): recomputes
        elif self.kind == "branch" and torch._C._current_graph_task_id() != -1:
            h = h.sin()  # in backward, that is recomputing: one more tensor saved
        return x + self.fc2(h * scale)


class _Model(nn.Module):
    def __init__(self, kinds: list[str]) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Block(k) for k in kinds)
        self.head = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return self.head(x).square().mean()


def _train(
    kinds: list[str], off: Offloader | None, steps: int, force: tuple[str, ...] | None = None
) -> tuple[list[float], list[torch.Tensor], tuple[object, object]]:
    torch.manual_seed(0)
    random.seed(1)
    np.random.seed(2)
    model = _Model(kinds)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(3)
    losses = []
    for _ in range(steps):
        if force is not None:
            set_plans(off, lambda p: dataclasses.replace(p, decisions=force))
        x = torch.randn(16, 32, generator=g)
        with off if off is not None else contextlib.nullcontext():
            loss = model(x)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    drawn = (random.random(), float(np.random.rand()))  # where the script's own RNGs are
    return losses, [p.detach().clone() for p in model.parameters()], drawn


def _same(a: tuple[list[float], list[torch.Tensor], object], b: object) -> bool:
    la, wa, ra = a
    lb, wb, rb = b  # type: ignore[misc]
    return la == lb and ra == rb and all(torch.equal(x, y) for x, y in zip(wa, wb, strict=True))


def test_blocks_that_draw_from_pythons_and_numpys_rng_recompute_exactly(disk_dir: Path) -> None:
    kinds = ["random", "plain", "random"]
    force = (RECOMPUTE, RECOMPUTE, RECOMPUTE, KEEP)
    ref = _train(kinds, None, 6)
    off = Offloader(tier="ssd", ssd_dirs=[str(disk_dir)], min_bytes=1024, budget="100x")
    try:
        got = _train(kinds, off, 6, force=force)
        assert off.plan() is not None and off.plan().decisions == force  # type: ignore[union-attr]
    finally:
        off.close()
    assert _same(ref, got)  # and the script's own draws after training are where plain's are


@pytest.mark.parametrize("kind", ["counter", "tensor"])
def test_blocks_that_change_their_attributes_are_never_recomputed(
    kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    kinds = ["plain", kind, "plain"]
    ref = _train(kinds, None, 8)
    off = Offloader(tier="keep", min_bytes=1024, budget="0.8x")
    try:
        with caplog.at_level(logging.INFO, logger="offloadd"):
            got = _train(kinds, off, 8)
        plan = off.plan()
    finally:
        off.close()
    assert plan is not None
    assert [b.recomputable for b in plan.blocks] == [True, False, True, False]
    assert plan.decisions[1] == KEEP and RECOMPUTE in plan.decisions
    attr = "calls" if kind == "counter" else "stat"
    said = [r.getMessage() for r in caplog.records if "never recomputed" in r.getMessage()]
    assert said and all(f"changes {attr} in its forward" in m for m in said), said
    assert _same(ref, got)


def test_a_recomputation_that_differs_stops_backward_and_is_not_planned_again(
    disk_dir: Path,
) -> None:
    """A global read and moved by the forward: no check sees it before, the fingerprints do."""
    force = (KEEP, RECOMPUTE, KEEP, KEEP)
    off = Offloader(tier="ssd", ssd_dirs=[str(disk_dir)], min_bytes=1024, budget="100x")
    try:
        with pytest.raises(RecomputeMismatch, match=r"block blocks\.1 gave other outputs"):
            _train(["plain", "global", "plain"], off, 8, force=force)
        assert off.planner is not None and off.planner.shapes.never == {1}
        # the next steps: planned again without it, and no block is recomputed with it
        set_plans(off, None)
        off.planner.plan = None
        _train(["plain", "global", "plain"], off, 3)
        assert all(p.decisions[1] != RECOMPUTE for p in off.planner.plans.values())
    finally:
        off.close()


def test_fingerprints_see_every_bit() -> None:
    a = torch.tensor([1.0, float("nan"), -0.0, 3.0])
    assert all(
        torch.equal(x, y) for x, y in zip(fingerprint(a), fingerprint(a.clone()), strict=True)
    )
    b = a.clone()
    b[2] = 0.0  # -0 and 0: equal as floats, not as bits
    assert not torch.equal(fingerprint(a)[0], fingerprint(b)[0])
    nested = {"x": a, "y": (torch.ones(2, dtype=torch.bfloat16), torch.zeros(3, dtype=torch.bool))}
    assert len(fingerprint(nested)) == 3
    assert len(fingerprint(torch.zeros(2, dtype=torch.complex64))) == 1


def test_a_tensor_assigned_anew_each_call_still_recomputes() -> None:
    """``self.last = h.detach()`` (or weight_norm's ``weight``): made by the forward from what it
    was given, so recomputing does not change it; only a tensor changed in place counts."""
    kinds = ["plain", "kept", "plain"]
    ref = _train(kinds, None, 8)
    off = Offloader(tier="keep", min_bytes=1024, budget="0.8x")
    try:
        got = _train(kinds, off, 8)
        plan = off.plan()
    finally:
        off.close()
    assert plan is not None and [b.recomputable for b in plan.blocks] == [True] * 3 + [False]
    assert _same(ref, got)


def test_a_recomputation_saving_more_is_not_planned_again(disk_dir: Path) -> None:
    """torch's own check raises first (``CheckpointError``: more tensors saved than in forward):
    that block is not recomputed again either."""
    from torch.utils.checkpoint import CheckpointError

    force = (KEEP, RECOMPUTE, KEEP, KEEP)
    off = Offloader(tier="ssd", ssd_dirs=[str(disk_dir)], min_bytes=1024, budget="100x")
    try:
        with pytest.raises(CheckpointError, match="more tensors during recomputation"):
            _train(["plain", "branch", "plain"], off, 8, force=force)
        assert off.planner is not None and off.planner.shapes.never == {1}
    finally:
        off.close()


def test_a_budget_refused_names_the_blocks_never_recomputed() -> None:
    off = Offloader(tier="keep", min_bytes=1024, budget="0.6x")
    try:
        with pytest.raises(InfeasibleBudget, match=r"never recomputed .*: blocks\.0, blocks\.1$"):
            _train(["counter", "counter"], off, 6)
    finally:
        off.close()
