"""What the budget planner holds: the model it plans, weakly (auto/planned.py), and itself, never
through a user's tensor; and when it says a model checkpoints its blocks itself."""

from __future__ import annotations

import gc
import logging
import weakref

import pytest
import torch
from torch import nn

from offloadd import Offloader


def _model() -> nn.Module:
    return nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.Tanh()) for _ in range(4)])


def _offloader() -> Offloader:
    return Offloader(tier="keep", min_bytes=1024, host_allocator="caching", budget="100x")


def _steps(off: Offloader, model: nn.Module, x: torch.Tensor, n: int) -> None:
    for _ in range(n):
        with off:
            loss = model(x).square().mean()
        loss.backward()


def test_a_dropped_model_goes_weights_and_all_and_the_next_is_planned() -> None:
    """A model the script drops is not kept by the planner (its blocks' weights included, which
    hold no reference to their parent), and the next model called in the scope is planned."""
    off = _offloader()
    model, x = _model(), torch.randn(32, 64)
    _steps(off, model, x, 3)
    assert off.planner is not None and off.planner.root is model
    weight = weakref.ref(model[1][0].weight)
    del model
    gc.collect()
    assert weight() is None, "the planner kept a dropped model's block"
    second = _model()
    _steps(off, second, x, 3)
    assert off.planner.root is second and off.plan() is not None
    off.close()


def test_a_leaf_kept_by_the_user_does_not_keep_the_planner() -> None:
    """A profile step whose backward never ran leaves its records on the first block's input; a
    leaf the user keeps must not keep the planner (or the model) alive once the Offloader is
    dropped, close() or not."""
    off = _offloader()
    model = _model()
    latents = nn.Parameter(torch.randn(32, 64))
    for _ in range(3):  # warm-up, profile: no backward
        with off:
            model(latents).square().mean()
    planner = weakref.ref(off.planner)
    del off
    gc.collect()
    assert planner() is None


def test_an_evaluation_of_a_leaf_is_not_taken_for_checkpointing(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """``no_grad`` in the scope with a leaf that requires grad as the input (learned latents) is
    an evaluation, not reentrant checkpointing: no warning."""
    off = _offloader()
    model = _model()
    latents = nn.Parameter(torch.randn(32, 64))
    with caplog.at_level(logging.WARNING, logger="offloadd"):
        _steps(off, model, latents, 2)
        with off, torch.no_grad():
            model(latents)
    assert not [r for r in caplog.records if "checkpoints its blocks" in r.getMessage()]
    off.close()


def test_models_replaced_one_after_another_leave_nothing_behind() -> None:
    """A search that trains a fresh model per trial under one Offloader: each model the planner
    let go leaves nothing of its plan behind (its block names, their index, a finalizer)."""
    from offloadd.auto.planned import PlannedModel

    def alive() -> int:
        gc.collect()
        return sum(isinstance(o, PlannedModel) for o in gc.get_objects())

    off = _offloader()
    x = torch.randn(32, 64)
    counts = []
    for _ in range(6):
        model = _model()
        _steps(off, model, x, 2)
        assert off.planner is not None and off.planner.root is model
        del model
        counts.append(alive())
    assert counts == [1] * 6, counts  # the one planned last, held until the next is called
    off.close()
