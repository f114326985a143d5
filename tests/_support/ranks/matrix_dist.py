"""The distributed rows of the composition matrix, in one torchrun launch of two gloo ranks.

Each rank runs four rows in turn: FSDP2 (``fully_shard``), FSDP2 with ``CPUOffloadPolicy``,
DDP, and tensor parallel with sequence parallel (``parallelize_module``). A row builds its model
from a fixed seed and trains it ``STEPS`` steps (an optimizer step each, so later steps depend
on earlier ones) twice: without offloadd, then with an explicit ``offloadd.Offloader`` around
the forward. Losses, gradients (each rank's local shard of a DTensor's) and the final weights
must be bitwise equal, and offloadd must have moved bytes.

Every saved tensor the offloader packs is also classified here (``Audit``): a parameter, a view
of one, a DTensor, or a tensor sharing the storage of a parameter (an FSDP2 shard, an
all-gathered FSDP2 parameter, a DTensor's local shard) must come back from pack as a handle
that keeps it (offloadd's ``Held``, or a ``Ref`` holding the tensor), never as one to be moved.
offloadd passes every subclass through, so DTensor activations (the inputs of the tensor
parallel Linears and LayerNorms) are kept too; the local tensors between a ColwiseParallel and
a RowwiseParallel (attention, GELU) are plain and moved. Bytes are counted as held by the rank.

Usage: ``torchrun --nproc_per_node=2 matrix_dist.py DIR``; each rank offloads into
``DIR/rank-<N>`` (made and removed here) and prints one JSON line: {"rank", "rows": {row:
{"equal", "mismatch", "offloaded_bytes", "saved_bytes", "kept_bytes", ...}}}.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.nn.parallel import DistributedDataParallel

import offloadd
from offloadd.runtime.handles import Ref
from offloadd.runtime.held import Held

STEPS = 3
BATCH, SEQ, DIM, HEAD_DIM, BLOCKS = 4, 32, 64, 16, 3
MIN_BYTES = 8 << 10  # under it a saved tensor stays; the model's activations are 8-128 KiB


class Block(nn.Module):
    """Pre-norm attention and MLP. Heads are counted from the local width, so the same code
    runs on a column shard of q/k/v under tensor parallel."""

    def __init__(self) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(DIM)
        self.q = nn.Linear(DIM, DIM)
        self.k = nn.Linear(DIM, DIM)
        self.v = nn.Linear(DIM, DIM)
        self.o = nn.Linear(DIM, DIM)
        self.norm2 = nn.LayerNorm(DIM)
        self.up = nn.Linear(DIM, 4 * DIM)
        self.down = nn.Linear(4 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        q, k, v = self.q(h), self.k(h), self.v(h)
        b, s, width = q.shape
        n = width // HEAD_DIM

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(b, s, n, HEAD_DIM).transpose(1, 2)

        att = (heads(q) @ heads(k).transpose(-2, -1)) / math.sqrt(HEAD_DIM)
        y = (att.softmax(-1) @ heads(v)).transpose(1, 2).reshape(b, s, width)
        x = x + self.o(y)
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(BLOCKS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def build() -> Model:
    torch.manual_seed(0)
    return Model()


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def held(t: torch.Tensor) -> torch.Tensor:
    """What this rank holds for ``t`` (a DTensor's local shard), read without an autograd op:
    the audit runs inside pack."""
    return t._local_tensor if isinstance(t, DTensor) else t


class Audit:
    """Wraps the offloader's pack hook: classifies each saved tensor and what pack made of it.

    Wraps the Offloader's ``runtime.hooks.pair`` (the pair it installs at each ``__enter__``); the
    wrapper returns pack's own result, so unpack and everything after it are offloadd's alone."""

    def __init__(self, off: offloadd.Offloader, model: nn.Module) -> None:
        self.model = model
        self.counts: dict[str, int] = {}
        self.local_bytes: dict[str, int] = {}  # a DTensor's local shard, not its global size
        self.bad: list[str] = []
        hooks = off.runtime.hooks
        made = hooks.pair

        def pair(owner: Any) -> tuple[Any, Any]:
            pack, unpack = made(owner)
            return self._wrap(pack), unpack

        hooks.pair = pair  # type: ignore[method-assign]

    def _param_storages(self) -> set[int]:
        """Storages behind the parameters the modules hold now: FSDP2's shards outside its
        forward, its all-gathered parameters inside, DTensors' local shards."""
        found = set()
        for m in self.model.modules():
            for p in m._parameters.values():
                if p is not None:
                    found.add(held(p).untyped_storage().data_ptr())
        return found

    def _wrap(self, pack: Callable[[torch.Tensor], Any]) -> Callable[[torch.Tensor], Any]:
        def audited(t: torch.Tensor) -> Any:
            packed = pack(t)
            moving = type(packed) is Ref and packed.tensor is None
            param = isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter)
            if isinstance(t, DTensor):
                kind = "dtensor_parameter" if param else "dtensor"
            elif param:
                kind = "parameter"
            elif t.untyped_storage().data_ptr() in self._param_storages():
                kind = "parameter_storage"
            else:
                kind = "activation"
            key = f"{kind}_{'moved' if moving else 'kept'}"
            self.counts[key] = self.counts.get(key, 0) + 1
            self.local_bytes[key] = self.local_bytes.get(key, 0) + held(t).nbytes
            if moving and kind != "activation":
                self.bad.append(f"{kind} {type(t).__name__} {list(t.shape)} handed to the mover")
            assert moving or type(packed) in (Held, Ref), type(packed)
            return packed

        return audited


def train(
    model: nn.Module, inputs: list[torch.Tensor], off: offloadd.Offloader | None
) -> dict[str, list[torch.Tensor]]:
    """``STEPS`` SGD steps; the losses, each step's gradients and the final weights (local)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses, grads = [], []
    for x in inputs:
        if off is None:
            loss = model(x).square().mean()
        else:
            with off:
                loss = model(x).square().mean()
        loss.backward()
        losses.append(local(loss).detach().clone())
        grads.extend(local(p.grad).clone() for p in model.parameters())
        opt.step()
        opt.zero_grad()
    weights = [local(p.detach()).clone() for p in model.parameters()]
    return {"losses": losses, "grads": grads, "weights": weights}


def compare(a: dict[str, list[torch.Tensor]], b: dict[str, list[torch.Tensor]]) -> list[str]:
    """Which tensors differ in any bit (NaN counts as equal to the same NaN bits)."""
    bad = []
    for key in a:
        assert len(a[key]) == len(b[key]), key
        for i, (x, y) in enumerate(zip(a[key], b[key], strict=True)):
            same = x.dtype == y.dtype and x.shape == y.shape and x.stride() == y.stride()
            if not (same and torch.equal(x.view(torch.int32), y.view(torch.int32))):
                bad.append(f"{key}[{i}]")
    return bad


# -- the rows: each builds the parallel model and this rank's inputs ----------------------------


def fsdp2(mesh: DeviceMesh, **kw: Any) -> nn.Module:
    model = build()
    for block in model.blocks:
        fully_shard(block, mesh=mesh, **kw)
    fully_shard(model, mesh=mesh, **kw)
    return model


def fsdp2_cpu_offload(mesh: DeviceMesh) -> nn.Module:
    # pin_memory=False: pinning needs an accelerator ("Cannot access accelerator device when
    # none is available"). On a CPU mesh the shards already live on the host, so FSDP2's
    # host-to-device copies before the all-gather and of the gradients after the
    # reduce-scatter are ``.to("cpu")`` of CPU tensors: no bytes move.
    return fsdp2(mesh, offload_policy=CPUOffloadPolicy(pin_memory=False))


def ddp(mesh: DeviceMesh) -> nn.Module:
    return DistributedDataParallel(build())


def tp_sp(mesh: DeviceMesh) -> nn.Module:
    model = build()
    seq = Shard(1)
    plan = {
        "norm1": SequenceParallel(),
        "q": ColwiseParallel(input_layouts=seq),
        "k": ColwiseParallel(input_layouts=seq),
        "v": ColwiseParallel(input_layouts=seq),
        "o": RowwiseParallel(output_layouts=seq),
        "norm2": SequenceParallel(),
        "up": ColwiseParallel(input_layouts=seq),
        "down": RowwiseParallel(output_layouts=seq),
    }
    for block in model.blocks:
        parallelize_module(block, mesh, plan)
    return model


def data(rank: int, world: int, row: str) -> list[torch.Tensor]:
    """Data parallel rows: each rank its own batch. Tensor parallel: one batch for both ranks,
    each holding its half of the sequence (sequence parallel)."""
    if row == "tp_sp":
        gen = torch.Generator().manual_seed(100)
        full = [torch.randn(BATCH, SEQ, DIM, generator=gen) for _ in range(STEPS)]
        return [x.chunk(world, dim=1)[rank].contiguous() for x in full]
    gen = torch.Generator().manual_seed(100 + rank)
    return [torch.randn(BATCH, SEQ, DIM, generator=gen) for _ in range(STEPS)]


ROWS: dict[str, Callable[[DeviceMesh], nn.Module]] = {
    "fsdp2": fsdp2,
    "fsdp2_cpu_offload": fsdp2_cpu_offload,
    "ddp": ddp,
    "tp_sp": tp_sp,
}


def run_row(name: str, mesh: DeviceMesh, rank: int, world: int, ssd_dir: Path) -> dict[str, Any]:
    make = ROWS[name]
    inputs = data(rank, world, name)
    t0 = time.perf_counter()
    base = train(make(mesh), inputs, None)
    t1 = time.perf_counter()
    off = offloadd.Offloader(
        offloadd.Config(
            tier="ssd",
            ssd_dirs=[str(ssd_dir)],
            min_bytes=MIN_BYTES,
            chunk_bytes=256 << 10,
            staging_bytes=8 << 20,
        )
    )
    model = make(mesh)
    audit = Audit(off, model)
    got = train(model, inputs, off)
    off.synchronize()
    s = off.stats()
    off.close()
    t2 = time.perf_counter()
    mismatch = compare(base, got)
    return {
        "equal": not mismatch,
        "mismatch": mismatch[:8],
        "losses": [float(x) for x in got["losses"]],
        "offloaded_bytes": s.offloaded_bytes,
        "saved_bytes": s.saved_bytes,
        "kept_bytes": s.kept_bytes,
        "deduplicated_bytes": s.deduplicated_bytes,
        "saved_tensors": s.saved_tensors,
        "bytes_read": s.bytes_read,
        "forwarded_bytes": s.forwarded_bytes,
        "fallbacks": s.fallbacks,
        "steps": STEPS,
        "audit": audit.counts,
        "audit_local_bytes": audit.local_bytes,
        "moved_non_activation": audit.bad[:8],
        "seconds": [round(t1 - t0, 3), round(t2 - t1, 3)],
    }


def main() -> None:
    root = Path(sys.argv[1])
    rows = sys.argv[2].split(",") if len(sys.argv) > 2 else list(ROWS)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    ssd_dir = root / f"rank-{rank}"
    ssd_dir.mkdir()
    result: dict[str, Any] = {"rank": rank, "world_size": world, "rows": {}}
    try:
        for name in rows:
            try:
                result["rows"][name] = run_row(name, mesh, rank, world, ssd_dir)
            except Exception as e:  # reported per row; the other rows still run
                result["rows"][name] = {"equal": False, "error": repr(e)[:2000]}
                raise
            dist.barrier()
    finally:
        result["leftover_files"] = sorted(p.name for p in ssd_dir.iterdir())
        shutil.rmtree(ssd_dir, ignore_errors=True)
        os.write(1, (json.dumps(result) + "\n").encode())
    # Both ranks leave their last collective before either tears gloo down (a rank that
    # destroys its group while the other still runs one can abort in C++ on torch 2.13's CPU
    # wheel, offloadd or not).
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
