"""Training the budget planner's test models with plans the test sets (tests/auto/)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from offloadd import Offloader
from offloadd.auto.solver import Plan


def no_race(off: Offloader) -> None:
    """No race ([race] in auto/race.py): the plans as the test sets them, every step."""
    assert off.planner is not None
    off.planner.shapes.race = None
    off.planner.shapes.waiting.clear()


def set_plans(off: Offloader | None, change: Callable[[Plan], Plan] | None) -> None:
    """Once the planner has planned, each shape's plan replaced by ``change(plan)``, unraced."""
    if change is None or off is None or off.planner is None or not off.planner.plans:
        return
    no_race(off)
    plans = off.planner.plans
    for sig, plan in plans.items():
        plans[sig] = change(plan)


def train(
    model: nn.Module,
    off: Offloader | None,
    batches: list[torch.Tensor],
    change: Callable[[Plan], Plan] | None = None,
) -> tuple[list[torch.Tensor], list[float]]:
    """SGD steps of a language model on ``batches`` (inputs and next tokens), in ``off``'s
    scope if given, its plans set by ``change`` (:func:`set_plans`); the final weights and the
    losses."""
    torch.manual_seed(123)  # dropout masks
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for x in batches:
        set_plans(off, change)
        if off is None:
            loss = model(x[:, :-1], x[:, 1:])
        else:
            with off:
                loss = model(x[:, :-1], x[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        del loss
    return [p.detach().clone() for p in model.parameters()], losses
