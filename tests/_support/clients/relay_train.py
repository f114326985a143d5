"""A plain PyTorch script tuning the head of a frozen residual stack; never imports offloadd.

Prints one JSON line: the losses, a SHA-256 of the final state_dict, and the class of one frozen
weight after training (``OFFLOADD_RELAY=frozen`` makes it offloadd's placeholder).
"""

import hashlib
import json
import sys

import torch
from torch import nn


class Stack(nn.Module):
    def __init__(self, depth: int, d: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d)) for _ in range(depth)
        )
        self.head = nn.Linear(d, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + layer(x)
        return self.head(x)


def main() -> None:
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    torch.manual_seed(0)
    model = Stack(6, 256)
    model.layers.requires_grad_(False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)  # frozen ones included: they have no grad
    gen = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        x = torch.randn(16, 256, generator=gen)
        y = torch.randint(0, 10, (16,), generator=gen)
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    digest = hashlib.sha256()
    for k, t in model.state_dict().items():
        digest.update(k.encode())
        digest.update(t.contiguous().numpy().tobytes())
    kind = type(model.layers[0][0].weight).__name__
    print(json.dumps({"losses": losses, "weights": digest.hexdigest(), "frozen_weight": kind}))


if __name__ == "__main__":
    main()
