"""A torchrun + gloo DistributedDataParallel client that never imports offloadd.

Each rank writes a JSON file CLIENT_OUT/rank-<N>.json (ranks share stdout): its rank, losses, a digest of its gradients at every step, the
final weights, and the offload files it holds open (paths under OFFLOADD_SSD_DIRS, read from
/proc/self/fd) so the test can check the per-rank namespaces.

CLIENT_STARVE_GLOO=1 pins the rank to one CPU and gives gloo's worker threads SCHED_IDLE: they
run only while the rank's other threads wait, as on a loaded node. torch 2.13's teardown race
then happens every time (see Note [gloo's teardown] in tests/integrations/test_clients.py).
"""

import hashlib
import json
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel


def open_offload_files():
    roots = [d for d in os.environ.get("OFFLOADD_SSD_DIRS", "").split(",") if d]
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if any(target.startswith(r.rstrip("/") + "/") for r in roots):
            found.append(target)
    return sorted(found)


def starve_gloo():
    cpu = {min(os.sched_getaffinity(0))}
    for tid in map(int, os.listdir("/proc/self/task")):
        os.sched_setaffinity(tid, cpu)
        with open(f"/proc/self/task/{tid}/comm") as f:
            if f.read().startswith("pt_gloo_runloop"):
                os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 8)
    )
    ddp = DistributedDataParallel(model)
    if os.environ.get("CLIENT_STARVE_GLOO") == "1":
        starve_gloo()
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(100 + rank)  # each rank its own data
    losses, grads, files = [], [], []
    for _ in range(3):
        x = torch.randn(128, 64, generator=gen)
        loss = ddp(x).square().mean()
        loss.backward()
        files = open_offload_files() or files
        h = hashlib.sha256()
        for p in model.parameters():
            h.update(p.grad.contiguous().numpy().tobytes())
        grads.append(h.hexdigest())
        losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    w = hashlib.sha256()
    for p in model.parameters():
        w.update(p.detach().contiguous().numpy().tobytes())
    result = {
        "rank": rank,
        "losses": losses,
        "grads": grads,
        "weights": w.hexdigest(),
        "files": files,
    }
    with open(os.path.join(os.environ["CLIENT_OUT"], f"rank-{rank}.json"), "w") as f:
        json.dump(result, f)
    # Both ranks leave their last collective before either tears gloo down: a rank that
    # destroys its group while the other still runs one aborts ("terminate called without an
    # active exception") now and then on torch 2.13's CPU wheel, offloadd or not. The DDP model
    # is dropped when main() returns, after the group is destroyed, as most scripts do.
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
