"""A plain PyTorch script fine-tuning a CNN with frozen convolutions; never imports offloadd.

Prints one JSON line: the losses, a SHA-256 of the final weights and running statistics, and the
class names of the model's modules after training (``OFFLOADD_MEMSAVE=1`` swaps them).
"""

import hashlib
import json
import sys

import torch
from torch import nn


def main() -> None:
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1),
        nn.BatchNorm2d(16),
        nn.ReLU(inplace=True),
        nn.MaxPool2d(3, 2, 1),
        nn.Conv2d(16, 32, 3, padding=1),
        nn.BatchNorm2d(32),
        nn.ReLU(inplace=True),
        nn.Flatten(),
        nn.Dropout(0.1),
        nn.Linear(32 * 8 * 8, 10),
    )
    for m in model.modules():
        if isinstance(m, nn.Conv2d):
            m.weight.requires_grad_(False)  # BN tuning: frozen convolutions
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    gen = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        x = torch.randn(8, 3, 16, 16, generator=gen)
        y = torch.randint(0, 10, (8,), generator=gen)
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    digest = hashlib.sha256()
    for t in [*model.parameters(), *model.buffers()]:
        digest.update(t.detach().contiguous().numpy().tobytes())
    names = [type(m).__name__ for m in model]
    print(json.dumps({"losses": losses, "weights": digest.hexdigest(), "classes": names}))


if __name__ == "__main__":
    main()
