"""Relay's step on a small HF GPT-2 against the same model plain, interleaved in one process.

``bench hooks --relay`` measures a swap on a micro model of 2 weights a group. A transformer's
layer has a dozen (GPT-2: 12 weights, 8 of them saved for backward), so what relay does for
each weight (install, uninstall, the write check, a ref a saved weight) weighs more there. This
builds ``bench hooks``' GPT-2 (12 layers, d=128, seq 64, batch 2), freezes its blocks, relays
them (window 2) from host memory (the cpu tier's store, as ``bench hooks --relay`` does:
relay's host work, no I/O), checks the two losses bit for bit, and steps plain and relayed in
turn as ``bench hooks`` does (``--rounds`` rounds of ``--steps`` steps after a warm-up). It
prints relay's step over plain's (medians) and µs a group and step above plain.

    python scripts/relay_gpt2.py --json relay-gpt2.json
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import statistics
from collections.abc import Callable

import torch
from torch import nn

from offloadd.tools.bench.hooks import _gpt2, _interleave
from offloadd.tools.bench.hooks_arms import _relay_from_host


def _step(loss_of: Callable[[nn.Module], torch.Tensor], model: nn.Module) -> None:
    loss_of(model).backward()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--json", help="write the figures here")
    ns = p.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    plain, loss_of = _gpt2("cpu")
    blocks: nn.ModuleList = plain.transformer.h  # type: ignore[assignment,union-attr]
    for block in blocks:
        block.requires_grad_(False)
    arms = {"plain": plain, "relay": _relay_from_host(copy.deepcopy(plain))}
    losses = {}
    for name, model in arms.items():
        torch.manual_seed(2)  # the same dropout masks
        losses[name] = loss_of(model)
    if not torch.equal(losses["plain"], losses["relay"]):
        raise SystemExit("relay's loss differs from the plain model's")
    steps: dict[str, Callable[[], None]] = {
        name: functools.partial(_step, loss_of, model) for name, model in arms.items()
    }
    med = {k: statistics.median(v) for k, v in _interleave(steps, ns.rounds, ns.steps).items()}
    out = {
        "groups": len(blocks),
        "plain_ms": med["plain"] * 1e3,
        "relay_ms": med["relay"] * 1e3,
        "x_plain": med["relay"] / med["plain"],
        "us_per_group_step": (med["relay"] - med["plain"]) / len(blocks) * 1e6,
    }
    print(
        f"plain {out['plain_ms']:.2f} ms, relay {out['relay_ms']:.2f} ms a step, "
        f"{out['x_plain']:.3f} x plain, {out['us_per_group_step']:.0f} µs a group and step above"
    )
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
