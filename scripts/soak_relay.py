"""Soak: a relayed model trained for thousands of steps beside a plain copy, with the graphs a
user drops between steps.

A model with a trainable input layer and head around six frozen layers (LayerNorm, Linear,
GELU, Linear, Sigmoid: ops that save their outputs) is trained with AdamW twice, step by step:
plain, and relayed (tier ssd). Both meet the same things between steps:

- every ``--eval-every`` steps, an evaluation with grad on: a forward whose graph is dropped
  without a backward;
- every ``--retain-every`` steps, a backward with ``retain_graph=True``, whose graph is then
  dropped;
- every ``--save-every`` steps, the model's state saved with ``torch.save`` and loaded back.

``--offloader``: the relayed model's steps run inside an Offloader (tier ssd) as well, whose
hooks are then below relay's. It prints, and writes with ``--json``: whether the trained
weights are bit-identical, RSS and the tensors alive with a grad_fn at step 100 and at the end
(both must stay flat), and what an Offloader still holds at the end. Exits 1 where the weights
differ or either figure grew.

    python scripts/soak_relay.py --steps 3000 --json soak.json
"""

from __future__ import annotations

import argparse
import copy
import gc
import io
import json
import sys
import tempfile
import time
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import psutil
import torch
from torch import nn

import offloadd

RSS_SLACK = 16 << 20  # the allocator's and the optimizer's settling, not a leak


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(128, 256)
        self.layers = nn.ModuleList(
            nn.Sequential(
                nn.LayerNorm(256),
                nn.Linear(256, 1024),
                nn.GELU(),
                nn.Linear(1024, 256),
                nn.Sigmoid(),
            )
            for _ in range(6)
        )
        self.head = nn.Linear(256, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for layer in self.layers:
            x = x + layer(x)
        return self.head(torch.relu(x))


def _linked() -> int:
    """Plain tensors alive with a grad_fn: what a dropped graph would leave."""
    gc.collect()
    return sum(1 for o in gc.get_objects() if type(o) is torch.Tensor and o.grad_fn is not None)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument("--retain-every", type=int, default=25)
    p.add_argument("--save-every", type=int, default=100)
    p.add_argument("--offloader", action="store_true", help="an Offloader below relay too")
    p.add_argument("--ssd-dir", default=None, help="the store's directory (on disk, not tmpfs)")
    p.add_argument("--json", help="write the figures here")
    ns = p.parse_args(argv)
    if ns.steps <= 100:
        p.error(f"--steps: more than 100 (figures are taken from step 100 on), got {ns.steps}")
    torch.manual_seed(0)
    torch.set_num_threads(1)
    base = _Model()
    for layer in base.layers:
        layer.requires_grad_(False)
    where = ns.ssd_dir or tempfile.mkdtemp(prefix="offloadd-soak-", dir="/var/tmp")
    models = [
        copy.deepcopy(base),
        offloadd.relay(copy.deepcopy(base), tier="ssd", ssd_dirs=[where]),
    ]
    off = (
        offloadd.Offloader(tier="ssd", ssd_dirs=[where], min_bytes=64 << 10)
        if ns.offloader
        else None
    )
    scopes: list[Any] = [nullcontext, (lambda: off) if off is not None else nullcontext]
    opts = [
        torch.optim.AdamW([q for q in m.parameters() if q.requires_grad], lr=1e-3) for m in models
    ]
    gen = torch.Generator().manual_seed(1)
    proc = psutil.Process()
    at: dict[str, tuple[int, int]] = {}
    t0 = time.perf_counter()
    for step in range(ns.steps):
        x = torch.randn(32, 128, generator=gen)
        for model, opt, scope in zip(models, opts, scopes, strict=True):
            ctx: AbstractContextManager[Any] = scope()
            with ctx:
                loss = model(x).square().mean()
            loss.backward(retain_graph=step % ns.retain_every == 0)
            del loss  # a retained graph dropped
            opt.step()
            opt.zero_grad(set_to_none=True)
            if step % ns.eval_every == 0:
                model(x).mean()  # an evaluation with grad on, its graph dropped
            if step % ns.save_every == ns.save_every - 1:
                buf = io.BytesIO()
                torch.save(model.state_dict(), buf)
                buf.seek(0)
                model.load_state_dict(torch.load(buf))
        if step in (100, ns.steps - 1):
            at["step 100" if step == 100 else "end"] = (proc.memory_info().rss, _linked())
        if step % 500 == 0:
            print(f"  step {step}/{ns.steps}", file=sys.stderr, flush=True)
    plain, relayed = (m.state_dict() for m in models)
    same = plain.keys() == relayed.keys() and all(torch.equal(plain[k], relayed[k]) for k in plain)
    held = (0, 0)
    if off is not None:
        off.synchronize()
        st = off.stats()
        held = (st.resident_bytes, st.disk_bytes)
        off.close()
    rss_grew = at["end"][0] - at["step 100"][0]
    out = {
        "steps": ns.steps,
        "offloader": ns.offloader,
        "seconds": time.perf_counter() - t0,
        "bit_identical": same,
        "rss_grew_bytes_from_step_100": rss_grew,
        "graph_tensors_alive": {"step 100": at["step 100"][1], "end": at["end"][1]},
        "offloader_holds_at_end": {"resident_bytes": held[0], "disk_bytes": held[1]},
    }
    print(
        f"{ns.steps} steps{' under an Offloader' if off else ''} in {out['seconds']:.0f} s: "
        f"bit-identical {same}; RSS {rss_grew / 2**20:+.1f} MiB from step 100; tensors with a "
        f"grad_fn alive {at['step 100'][1]} -> {at['end'][1]}; Offloader holds {held[0]} resident, "
        f"{held[1]} on disk bytes"
    )
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump(out, f, indent=1)
    grew = rss_grew > RSS_SLACK or at["end"][1] > at["step 100"][1] or any(held)
    return 0 if same and not grew else 1


if __name__ == "__main__":
    raise SystemExit(main())
