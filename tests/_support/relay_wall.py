"""Fine-tune an HF Llama from a checkpoint, relayed from it or loaded whole, and say what it
held: the client of tests/relay/test_relay_wall.py and scripts/relay_wall.py.

    python -m tests._support.relay_wall CKPT OUT --mode relay|whole|whole-relay --train head|lora
        [--steps N] [--ssd-dir DIR]

``relay``: built on the meta device, ``offloadd.relay(model, checkpoint=CKPT)`` (tier ssd);
``whole``: ``from_pretrained``; ``whole-relay``: ``from_pretrained``, then ``offloadd.relay(model)``
(what ``OFFLOADD_RELAY=frozen`` does in a script that loads the model itself). ``head``: only the LM head trains; ``lora``: rank-8 adapters on
every q and v projection (made after the load, as PEFT does), the base frozen. Writes OUT (JSON):
the losses (hex), the load's and the steps' peaks (the cgroup's, from ``RELAY_WALL_CGROUP``
when set, else the peak RSS), each step's seconds, the bytes relay read a step, and the trained
tensors to OUT.pt.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import time
from pathlib import Path

import torch
from torch import nn


class LoRA(nn.Module):
    def __init__(self, base: nn.Linear, rank: int = 8) -> None:
        super().__init__()
        self.base = base
        dtype = base.weight.dtype
        self.a = nn.Linear(base.in_features, rank, bias=False, dtype=dtype)
        self.b = nn.Linear(rank, base.out_features, bias=False, dtype=dtype)
        nn.init.zeros_(self.b.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.b(self.a(x))


def save_checkpoint(path: Path, layers: int = 34, hidden: int = 768, ffn: int = 2048) -> int:
    """The wall's HF Llama (random, seeded) written by ``save_pretrained`` to ``path`` in 200 MB
    shards; its bytes of weights (all frozen in the fine-tunes here)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=ffn,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=8,
        vocab_size=512,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    model.save_pretrained(path, max_shard_size="200MB")
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _peak(reset: bool = False) -> int:
    cg = os.environ.get("RELAY_WALL_CGROUP")
    if not cg:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    path = Path(cg)
    v1 = (path / "memory.max_usage_in_bytes").exists()
    name = "memory.max_usage_in_bytes" if v1 else "memory.peak"
    peak = int((path / name).read_text())
    if reset:
        with contextlib.suppress(OSError):  # v1; v2 resets on a write from 6.12 on
            (path / name).write_text("0")
    return peak


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("checkpoint")
    p.add_argument("out")
    p.add_argument("--mode", choices=("relay", "whole", "whole-relay"), required=True)
    p.add_argument("--train", choices=("head", "lora"), required=True)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--ssd-dir", default="/var/tmp")
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--dtype", help="load in this dtype (from_pretrained's, relay's dtype=)")
    a = p.parse_args()
    torch.set_num_threads(int(os.environ.get("RELAY_WALL_THREADS", "2")))
    from transformers import AutoConfig, LlamaForCausalLM

    import offloadd
    from offloadd.relay import weights_on_meta

    cfg = AutoConfig.from_pretrained(a.checkpoint)
    t0 = time.perf_counter()
    if a.mode in ("whole", "whole-relay"):
        kw = {"dtype": getattr(torch, a.dtype)} if a.dtype else {}
        model = LlamaForCausalLM.from_pretrained(a.checkpoint, **kw)
        model.requires_grad_(False)
        model.lm_head.requires_grad_(a.train == "head")
        if a.mode == "whole-relay":  # what OFFLOADD_RELAY=frozen does, after the script's load
            offloadd.relay(model, tier="ssd", ssd_dirs=[a.ssd_dir])
    else:
        with weights_on_meta():
            model = LlamaForCausalLM(cfg)
        model.requires_grad_(False)
        model.lm_head.requires_grad_(a.train == "head")
        offloadd.relay(
            model, checkpoint=a.checkpoint, dtype=a.dtype, tier="ssd", ssd_dirs=[a.ssd_dir]
        )
    load_s = time.perf_counter() - t0
    if a.train == "lora":
        torch.manual_seed(1)
        for layer in model.model.layers:
            layer.self_attn.q_proj = LoRA(layer.self_attn.q_proj)
            layer.self_attn.v_proj = LoRA(layer.self_attn.v_proj)
    trained = {n: p for n, p in model.named_parameters() if p.requires_grad}
    opt = torch.optim.AdamW(trained.values(), lr=1e-3)
    ids = torch.randint(0, cfg.vocab_size, (1, a.seq), generator=torch.Generator().manual_seed(2))
    load_peak = _peak(reset=True)
    losses, step_s, read = [], [], []
    for _ in range(a.steps):
        before = offloadd.relay_stats(model).read_bytes if a.mode != "whole" else 0
        t0 = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        step_s.append(time.perf_counter() - t0)
        losses.append(loss.item().hex())
        if a.mode != "whole":
            read.append(offloadd.relay_stats(model).read_bytes - before)
    frozen = sum(p.numel() * p.element_size() for p in model.parameters() if not p.requires_grad)
    torch.save({n: p.detach() for n, p in trained.items()}, a.out + ".pt")
    doc = {
        "mode": a.mode,
        "train": a.train,
        "losses": losses,
        "load_s": load_s,
        "load_peak": load_peak,
        "steps_peak": _peak(),
        "step_s": step_s,
        "read_bytes_per_step": read,
        "frozen_bytes": frozen,
        "trained_bytes": sum(p.numel() * p.element_size() for p in trained.values()),
        "relay_peak_resident": (
            offloadd.relay_stats(model).peak_resident_bytes if a.mode != "whole" else 0
        ),
    }
    Path(a.out).write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
