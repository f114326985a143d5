"""A DeepSpeed client that never imports offloadd: deepspeed.initialize, engine.backward and
engine.step on CPU (DS_ACCELERATOR=cpu), started by the ``deepspeed`` launcher, or by torchrun
on 2 ranks with ``--stage 1`` or ``--stage 2`` (ZeRO: optimizer states, then gradients too,
partitioned over the ranks; gloo, as DeepSpeed picks on CPU without oneCCL).

It turns off DeepSpeed's shared-memory comm op, the one line here a user would not write: on
CPU each fresh machine JIT-builds it at the first launch (~1 min on 2 cores, and two ranks racing
the build hung CI once), and ZeRO's collectives go through torch.distributed without it.

Prints one JSON line per rank: losses and a digest of the final weights.
"""

import argparse
import hashlib
import json

import deepspeed
import torch
from torch import nn


def main():
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # DeepSpeed keeps the edit
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=0)
    parser.add_argument("--stage", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 8)
    )
    config = {
        "train_micro_batch_size_per_gpu": 64,
        "gradient_accumulation_steps": 2,
        "steps_per_print": 1000,
        "zero_optimization": {"stage": args.stage},
        "zero_allow_untested_optimizer": True,  # the client's own SGD under ZeRO
    }
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    gen = torch.Generator().manual_seed(1 + engine.global_rank)  # each rank its own batches
    losses = []
    for _ in range(4):  # 2 optimizer steps of 2 micro-batches
        x = torch.randn(64, 64, generator=gen)
        loss = engine(x).square().mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    w = hashlib.sha256()
    for p in model.parameters():
        w.update(p.detach().contiguous().numpy().tobytes())
    print(
        json.dumps({"rank": engine.global_rank, "losses": losses, "weights": w.hexdigest()}),
        flush=True,
    )


if __name__ == "__main__":
    main()
