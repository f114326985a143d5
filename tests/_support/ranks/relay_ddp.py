"""DistributedDataParallel around a relayed model, on two gloo ranks whose frozen weights start
different (each rank seeds its own), so that DDP's first broadcast of every parameter matters.

Each rank trains the same model three ways, 3 SGD steps on its own data:

- ``plain``: no relay, ``DistributedDataParallel(model)``;
- ``relay``: relayed, then wrapped inside ``offloadd.resident(model)``: the broadcast writes rank
  0's values into the weights, and relay writes back what was written;
- ``relay_first``: relayed, then wrapped as usual: DDP's broadcast must raise ``RelayError``
  (it would skip the relayed weights silently), and the text is reported.

Usage: ``torchrun --nproc_per_node=2 relay_ddp.py DIR``; each rank relays into ``DIR/rank-<N>``
and writes ``DIR/rank-<N>.json``: {"rank", "plain": {"losses", "weights"}, "relay": {...},
"relay_first": error text or null}.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

import offloadd
from offloadd.config import Config
from tests.relay.cases import Layered, freeze_layers, square_loss


def build(rank: int) -> nn.Module:
    torch.manual_seed(rank)
    return freeze_layers(Layered(layers=4))


def train(model: nn.Module, net: nn.Module, rank: int) -> dict[str, Any]:
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    gen = torch.Generator().manual_seed(10 + rank)
    losses = []
    for _ in range(3):
        loss = square_loss(net, torch.randn(8, 16, generator=gen))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    digest = hashlib.sha256()
    for k, t in model.state_dict().items():
        digest.update(k.encode())
        digest.update(t.contiguous().numpy().tobytes())
    return {"losses": losses, "weights": digest.hexdigest()}


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.set_num_threads(1)
    cfg = Config().replace(tier="ssd", ssd_dirs=(str(Path(sys.argv[1]) / f"rank-{rank}"),))
    Path(cfg.ssd_dirs[0]).mkdir(parents=True, exist_ok=True)
    out: dict[str, Any] = {"rank": rank}
    model = build(rank)
    out["plain"] = train(model, DistributedDataParallel(model), rank)
    model = offloadd.relay(build(rank), config=cfg)
    with offloadd.resident(model):
        net = DistributedDataParallel(model)
    out["relay"] = train(model, net, rank)
    offloadd.unrelay(model)
    model = offloadd.relay(build(rank), config=cfg)
    try:
        DistributedDataParallel(model)
        out["relay_first"] = None
    except offloadd.RelayError as e:
        out["relay_first"] = str(e)
    offloadd.unrelay(model)
    (Path(sys.argv[1]) / f"rank-{rank}.json").write_text(json.dumps(out))  # ranks share stdout
    dist.barrier()  # both ranks leave their last collective before either tears gloo down
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
