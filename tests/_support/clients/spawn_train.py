"""Two workers started with ``torch.multiprocessing.spawn`` that learn their rank after
``import torch`` (a client of OFFLOADD=1 that never imports offloadd).

Usage: ``spawn_train.py MODE PORT``. MODE ``env``: each worker sets ``RANK``/``WORLD_SIZE``
(and the rendezvous variables) itself, then calls ``init_process_group("gloo")``; MODE
``explicit``: no rank variable at all, ``init_process_group("gloo", rank=..., world_size=...)``
over a TCP rendezvous. Each worker then trains a small model two steps, destroys its process
group and writes one JSON line to stdout: its rank and losses.
"""

import json
import os
import sys

import torch
import torch.distributed as dist
from torch import nn

WORLD = 2


def worker(rank: int, mode: str, port: str) -> None:
    if mode == "env":
        os.environ.update(
            RANK=str(rank), WORLD_SIZE=str(WORLD), MASTER_ADDR="127.0.0.1", MASTER_PORT=port
        )
        dist.init_process_group("gloo")
    else:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD
        )
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 8))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(100 + rank)
    losses = []
    for _ in range(2):
        loss = model(torch.randn(128, 64, generator=gen)).square().mean()
        loss.backward()
        for p in model.parameters():  # the average of the ranks' gradients, as DDP takes it
            dist.all_reduce(p.grad)
            p.grad /= WORLD
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    # Both ranks leave their last collective before either tears gloo down: one that destroys
    # its group while the other still runs one aborts now and then on torch 2.13's CPU wheel
    # ("terminate called without an active exception"), as ddp_train.py says.
    dist.barrier()
    dist.destroy_process_group()
    line = json.dumps({"rank": rank, "losses": losses}) + "\n"
    os.write(1, line.encode())  # one write: the two workers share stdout


if __name__ == "__main__":
    torch.multiprocessing.spawn(worker, args=(sys.argv[1], sys.argv[2]), nprocs=WORLD)
