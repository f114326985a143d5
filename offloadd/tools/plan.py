"""``offloadd plan``: the plan a budget gives, for a model and config, without training.

It builds the model with random weights, runs forward and backward (no optimizer step) until the
planner has profiled it (a warm-up step, a profile step, one planned step), and prints the plan:
block, saved bytes, times, decision and predicted cost. ``--json`` also writes it. That is the
profile's plan: in training, the next steps race it against offloading every block, which may
change it ([race] in auto/race.py); the command says so.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from offloadd.auto import InfeasibleBudget, plan_dict, plan_table
from offloadd.auto.race import RACE_STEPS_MAX, RACE_STEPS_MIN
from offloadd.auto.solver import OFFLOAD
from offloadd.cli_dirs import ready_dir, ready_parent
from offloadd.config import Config
from offloadd.offloader import Offloader
from offloadd.tools.models.build import MODELS, build_model, default_vocab

__all__ = ["add_arguments", "main"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--budget", required=True, help="a size (6GiB) or a fraction of keep's (0.3x)")
    p.add_argument("--model", choices=MODELS, default="mini-gpt")
    # the model flags of rok and wall (--d-model: this command's old name for --hidden)
    p.add_argument("--layers", type=int, default=12, help="blocks (default 12)")
    p.add_argument(
        "--hidden", "--d-model", dest="hidden", type=int, default=768, help="model width (768)"
    )
    p.add_argument("--heads", type=int, default=12, help="attention heads (default 12)")
    p.add_argument("--seq", type=int, default=512, help="sequence length (default 512)")
    p.add_argument("--vocab", type=int, default=None, help="vocabulary (default: the model's)")
    p.add_argument("--batch", type=int, default=2, help="batch size (default 2)")
    p.add_argument("--config", help="a TOML config (the [offload] keys); OFFLOADD_* apply too")
    p.add_argument("--tier", choices=("ssd", "cpu", "keep"), help="overrides the config's tier")
    p.add_argument(
        "--ssd-dir",
        help="offload directory, created (mode 0700) if missing (default: the config's, else "
        "chosen)",
    )
    p.add_argument(
        "--json", help="also write the plan as JSON to this file (its directory created if missing)"
    )


def main(ns: argparse.Namespace) -> int:
    try:
        cfg = Config.load(ns.config)
        changes: dict[str, object] = {"budget": ns.budget}
        if ns.tier:
            changes["tier"] = ns.tier
        if ns.ssd_dir:
            changes["ssd_dirs"] = (ns.ssd_dir,)
        cfg = cfg.replace(**changes)
        # before the model is built (Note [directories of the command line] in cli_dirs.py)
        if ns.ssd_dir:
            ready_dir("--ssd-dir", ns.ssd_dir)
        if ns.json:
            ready_parent("--json", ns.json)
    except ValueError as e:
        print(f"offloadd plan: {e}", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    vocab = ns.vocab or default_vocab(ns.model)
    built = build_model(
        ns.model,
        num_layers=ns.layers,
        d_model=ns.hidden,
        num_heads=ns.heads,
        seq_len=ns.seq,
        vocab_size=vocab,
    )
    gen = torch.Generator().manual_seed(1)
    off = Offloader(cfg)
    try:
        for step in range(3):  # warm-up, profile, then the first planned forward plans
            x = torch.randint(0, vocab, (ns.batch, ns.seq + 1), generator=gen)
            print(f"offloadd plan: step {step + 1}/3", file=sys.stderr, flush=True)
            with off:
                loss = built.loss(x[:, :-1], x[:, 1:])
            loss.backward()
            del loss
            built.module.zero_grad(set_to_none=True)
        plan = off.plan()
    except InfeasibleBudget as e:
        print(f"offloadd plan: {e}", file=sys.stderr)
        return 1
    finally:
        off.close()
    if plan is None:
        print("offloadd plan: the model has no blocks to plan", file=sys.stderr)
        return 1
    print(plan_table(plan))
    if cfg.tier != "keep" and plan.count(OFFLOAD) < len(plan.decisions):
        print(
            "offloadd plan: the profile's plan; in training the next "
            f"{RACE_STEPS_MIN} to {RACE_STEPS_MAX} steps race it against offloading every "
            "block (where that fits), "
            "which may change it (docs/budget.md, Race)",
            file=sys.stderr,
        )
    if ns.json:
        with open(ns.json, "w", encoding="utf-8") as f:
            json.dump(plan_dict(plan), f, indent=2)
            f.write("\n")
    return 0


if __name__ == "__main__":  # pragma: no cover
    parser = argparse.ArgumentParser(prog="offloadd plan")
    add_arguments(parser)
    raise SystemExit(main(parser.parse_args()))
