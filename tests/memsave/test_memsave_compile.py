"""memsave under torch.compile: the compiled graph is the model's own, bit for bit."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import offloadd

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.act, self.drop = nn.Linear(64, 64), nn.ReLU(), nn.Dropout(0.25)
        self.up.requires_grad_(False)  # a frozen layer: memsave has something to skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.act(self.up(x)))


def _train(memsaved: bool, whole: bool) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), _Block(), _Block(), nn.Linear(64, 4))
    if memsaved:
        offloadd.memsave(model)
    if not whole:
        model[1].compile()
        model[2].compile()
    run = torch.compile(model) if whole else model
    torch.manual_seed(1)
    out = []
    for _ in range(2):
        loss = run(torch.randn(32, 16)).square().mean()
        loss.backward()
        out += [loss.detach(), *(p.grad.clone() for p in model.parameters() if p.grad is not None)]
    return out


@pytest.mark.parametrize(
    "whole", [pytest.param(True, marks=pytest.mark.slow), False], ids=["whole", "per-block"]
)  # per-block in the default run: the same dropout in inductor's graph, half the compile time
def test_dropout_draws_the_compiled_graphs_numbers(whole: bool) -> None:
    """Inductor draws a compiled graph's random numbers with its own generator: memsave's
    dropout, which draws as ATen's eager CPU dropout does, gave other masks there (the losses
    of the seams grid's memsave x compile cells differed from the first step)."""
    assert all(
        torch.equal(a, b) for a, b in zip(_train(False, whole), _train(True, whole), strict=True)
    )
