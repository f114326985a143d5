"""A plain PyTorch script tuning the head of a frozen residual stack; never imports offloadd.

Prints one JSON line: the losses, a SHA-256 of the final state_dict, and the class of one frozen
weight after training (``OFFLOADD_RELAY=frozen`` makes it offloadd's placeholder). Under
torchrun it trains DistributedDataParallel on gloo, each rank on its own data, and each rank
writes that JSON to CLIENT_OUT/rank-<N>.json instead (ranks share stdout). With ``nested`` as
its second argument the model is an ``nn.Sequential`` whose frozen trunk nests ``Sequential``s
(the model's own call is the one ``OFFLOADD_RELAY=frozen`` relays it in).
"""

import hashlib
import json
import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel


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
    ranked = "WORLD_SIZE" in os.environ
    rank = 0
    if ranked:
        dist.init_process_group("gloo")
        rank = dist.get_rank()
        torch.set_num_threads(1)
    torch.manual_seed(0)
    if sys.argv[2:] == ["nested"]:
        trunk = nn.Sequential(*(nn.Sequential(nn.Linear(256, 256), nn.GELU()) for _ in range(6)))
        model = nn.Sequential(nn.Linear(256, 256), trunk, nn.Linear(256, 10))
        model[1].requires_grad_(False)
        first = model[1][0][0]
    else:
        model = Stack(6, 256)
        model.layers.requires_grad_(False)
        first = model.layers[0][0]
    net = DistributedDataParallel(model) if ranked else model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)  # frozen ones included: they have no grad
    gen = torch.Generator().manual_seed(1 + rank)
    losses = []
    for _ in range(steps):
        x = torch.randn(16, 256, generator=gen)
        y = torch.randint(0, 10, (16,), generator=gen)
        loss = nn.functional.cross_entropy(net(x), y)
        loss.backward()
        losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    digest = hashlib.sha256()
    for k, t in model.state_dict().items():
        digest.update(k.encode())
        digest.update(t.contiguous().numpy().tobytes())
    kind = type(first.weight).__name__
    result = {"losses": losses, "weights": digest.hexdigest(), "frozen_weight": kind}
    if not ranked:
        print(json.dumps(result))
        return
    with open(os.path.join(os.environ["CLIENT_OUT"], f"rank-{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.barrier()  # both ranks leave their last collective before either tears gloo down
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
