"""``torch.compile(DistributedDataParallel(model))`` on one gloo rank, with DDP's optimizer
splitting the graph at its two buckets, trained two SGD steps without offloadd and then with
it (tests/runtime/test_compile_ddp.py runs this in a child process: a crash must fail the test,
not end pytest).

Usage: ``python compile_ddp.py DIR``, with ``TORCHINDUCTOR_CACHE_DIR`` set by the caller (cold
or warm); writes ``DIR/result.pt``: {"plain": [[loss, *grads] per step], "offloadd": [...],
"offloaded_bytes", "evicts", "unmatched", "live"}.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import offloadd
from offloadd.runtime import evicted, graph_ops


class Two(nn.Module):
    """Two linears; the second's weight alone fills a 1 MiB bucket, so DDP makes two."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(1024, 1024)
        self.b = nn.Linear(1024, 256)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)) * 2)


def train(off: offloadd.Offloader | None) -> list[list[torch.Tensor]]:
    torch.manual_seed(0)
    model = Two()
    run = torch.compile(DistributedDataParallel(model, bucket_cap_mb=1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(1)
    steps = []
    for _ in range(2):
        x = torch.randn(64, 1024, generator=gen)
        if off is None:
            loss = run(x).square().mean()
        else:
            with off:
                loss = run(x).square().mean()
        loss.backward()
        steps.append([loss.detach().clone()] + [p.grad.clone() for p in model.parameters()])
        opt.step()
        opt.zero_grad(set_to_none=True)
    return steps


def main() -> None:
    out = Path(sys.argv[1])
    store = out / "store"
    store.unlink(missing_ok=True)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    plain = train(None)  # first: offloadd's pass, once added, stays for the process
    torch._dynamo.reset()
    (out / "ssd").mkdir(exist_ok=True)
    off = offloadd.Offloader(tier="ssd", min_bytes=4096, ssd_dirs=[str(out / "ssd")])
    mine = train(off)
    result = {
        "plain": plain,
        "offloadd": mine,
        "offloaded_bytes": off.stats().offloaded_bytes,
        "evicts": graph_ops.ran[0],
        "unmatched": graph_ops.unmatched[0],
        "live": evicted.live(),
    }
    off.close()
    torch.save(result, out / "result.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
