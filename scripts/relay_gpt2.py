"""Relay's step on a small HF GPT-2 against the same model plain, interleaved in one process.

``bench hooks --relay`` measures a swap on a micro model of 2 weights a group. A transformer's
layer has a dozen (GPT-2: 12 weights, 8 of them saved for backward), so what relay does for each
weight (install, uninstall, the write check, a ref a saved weight) weighs more there. This builds
``bench hooks``' GPT-2 (12 layers, d=128, seq 64), freezes its blocks, relays them (window 2)
from host memory (the cpu tier's store, as ``bench hooks --relay`` does: relay's host work, no
I/O) and steps plain and relayed in turn, ``--rounds`` rounds of ``--steps`` steps after three
of warm-up. It checks the two losses bit for bit first, and prints relay's step over plain's
(medians) and µs a group and step above plain.

    python scripts/relay_gpt2.py --batch 2 --json relay-gpt2.json
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time

import torch
from torch import nn

from offloadd.tools.bench.hooks_arms import _relay_from_host
from offloadd.tools.models.hf import build_hf


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--json", help="write the figures here")
    ns = p.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    plain = build_hf(
        "gpt", num_layers=12, d_model=128, num_heads=4, seq_len=64, vocab_size=2000, recompute=False
    ).train()
    blocks: nn.ModuleList = plain.transformer.h  # type: ignore[assignment,union-attr]
    for block in blocks:
        block.requires_grad_(False)
    relayed = _relay_from_host(copy.deepcopy(plain))
    ids = torch.randint(0, 2000, (ns.batch, 64), generator=torch.Generator().manual_seed(1))
    arms = {"plain": plain, "relay": relayed}
    losses = {}
    for k, m in arms.items():
        torch.manual_seed(2)  # the same dropout masks
        losses[k] = m(input_ids=ids, labels=ids).loss
    if not torch.equal(losses["plain"], losses["relay"]):
        raise SystemExit("relay's loss differs from the plain model's")
    times: dict[str, list[float]] = {k: [] for k in arms}
    for r in range(-3, ns.rounds):
        for name in arms if r % 2 == 0 else reversed(list(arms)):
            t0 = time.perf_counter()
            for _ in range(ns.steps):
                arms[name](input_ids=ids, labels=ids).loss.backward()
            if r >= 0:
                times[name].append((time.perf_counter() - t0) / ns.steps)
    med = {k: statistics.median(v) for k, v in times.items()}
    out = {
        "batch": ns.batch,
        "groups": len(blocks),
        "plain_ms": med["plain"] * 1e3,
        "relay_ms": med["relay"] * 1e3,
        "x_plain": med["relay"] / med["plain"],
        "us_per_group_step": (med["relay"] - med["plain"]) / len(blocks) * 1e6,
    }
    print(
        f"batch {ns.batch}: plain {out['plain_ms']:.2f} ms, relay {out['relay_ms']:.2f} ms a step, "
        f"{out['x_plain']:.3f} x plain, {out['us_per_group_step']:.0f} µs a group and step above"
    )
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
