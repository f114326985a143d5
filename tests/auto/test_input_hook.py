"""The planner's gradient hooks on the first block's input (Note [one hook per tensor])."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path

import torch
from torch import nn

from offloadd import Offloader
from offloadd.auto.planner import WARMUP_STEPS_MAX


def _hooks(t: torch.Tensor) -> int:
    return len(t._backward_hooks or {})


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.Tanh()) for _ in range(4)])


def _train(off: Offloader | None, steps: int) -> tuple[list[torch.Tensor], list[tuple[int, int]]]:
    """SGD on learned latents fed straight to the first block every step; the final weights and
    latents, and the planner's hooks on the latents after each forward and each backward."""
    model = _model()
    latents = nn.Parameter(torch.randn(128, 64, generator=torch.Generator().manual_seed(1)))
    opt = torch.optim.SGD([*model.parameters(), latents], lr=0.05)
    counts = []
    for _ in range(steps):
        if off is None:
            loss = model(latents).square().mean()
        else:
            with off:
                loss = model(latents).square().mean()
        during = _hooks(latents)
        loss.backward()
        counts.append((during, _hooks(latents)))
        if off is not None and off.planner is not None and off.planner._armed:
            assert off.planner._step_peak is not None  # the gradient at the input ended the window
        opt.step()
        opt.zero_grad()
        del loss
    return [p.detach().clone() for p in (*model.parameters(), latents)], counts


def test_a_leaf_fed_to_the_first_block_every_step_carries_one_hook(disk_dir: Path) -> None:
    """Learned latents passed to block 0 every step: the planner keeps one hook on them, not one
    more a step, through warm-up, profile, race and planned steps; the measured window still
    ends at the latents' gradient and training stays bit-identical."""
    steps = WARMUP_STEPS_MAX + 6
    ref, _ = _train(None, steps)
    off = Offloader(
        tier="ssd", ssd_dirs=[str(disk_dir)], min_bytes=1024, host_allocator="caching",
        budget="100x",
    )  # fmt: skip
    got, counts = _train(off, steps)
    # profiled and planned (settled too, on a quiet machine: a loaded one can race past the
    # steps, or see its steps drift and profile again at the end, its plan then dropped)
    assert off.planner is not None and off.planner.shapes.planned and off.planner.profiles >= 1
    assert max(max(c) for c in counts) <= 1, counts
    assert all(torch.equal(a, b) for a, b in zip(ref, got, strict=True))
    off.close()


def test_a_closed_offloaders_planner_is_not_kept_alive_by_its_hooks() -> None:
    """The hook on a leaf the user keeps holds the planner weakly, and close removes it."""
    model = _model()
    latents = nn.Parameter(torch.randn(128, 64))
    off = Offloader(tier="keep", min_bytes=1024, host_allocator="caching", budget="100x")
    for _ in range(4):
        with off:
            loss = model(latents).square().mean()
        assert _hooks(latents) <= 1  # the profile's hook and the window's mark: one between them
        del loss  # no backward: the hook stays on the leaf until close
    assert _hooks(latents) == 1
    planner = weakref.ref(off.planner)
    off.close()
    assert _hooks(latents) == 0
    del off
    gc.collect()
    assert planner() is None
