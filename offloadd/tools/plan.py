"""``offloadd plan``: what a model needs, before a training run.

Without ``--budget``, it predicts without training (tools/predict/): per strategy, the peak for
a batch and sequence and the largest batch under ``--memory-limit``, from the model traced on fake
tensors, and the config it recommends (``--json`` too). ``--hf-config`` takes any causal LM's
config directory.

With ``--budget``, the plan that budget gives: it builds the model with random weights, runs forward and backward (no optimizer step) until the
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
from offloadd.config import Config, parse_size
from offloadd.offloader import Offloader
from offloadd.tools.models.build import MODELS, build_model, default_vocab
from offloadd.tools.predict.report import ON_REQUEST, PREDICTED
from offloadd.tools.predict.trace import OPTIMIZERS

__all__ = ["add_arguments", "main"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--budget",
        help="the budget planner's plan for this budget, a size (6GiB) or a fraction of keep's "
        "(0.3x), after profiling a few steps; without it: the peaks predicted without training",
    )
    p.add_argument(
        "--hf-config",
        metavar="DIR",
        help="instead of --model: the causal LM of a transformers config.json in DIR",
    )
    p.add_argument("--memory-limit", help="predict each strategy's largest batch within this size")
    p.add_argument(
        "--strategies",
        default=",".join(PREDICTED),
        help=f"predicted strategies, from {', '.join(PREDICTED + ON_REQUEST)} (default: "
        f"{', '.join(PREDICTED)}; compile-budget also compiles the model and trains it two "
        "real steps at batch 1 to measure what the compiler holds: a minute or more, and the "
        "model and its optimizer state must fit in memory)",
    )
    p.add_argument("--optimizer", choices=OPTIMIZERS, default="adamw", help="default adamw")
    p.add_argument(
        "--allocator",
        choices=("held", "system"),
        default="held",
        help="torch's CPU allocator the run trains on: held (offloadd's host cache, default, as "
        "offloadd wall runs) or system (glibc's heap: its retention is not predicted)",
    )
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
    if ns.budget is None:
        return _predicted(ns)
    if ns.hf_config is not None:
        print("offloadd plan: --budget plans the built-in models (--model)", file=sys.stderr)
        return 2
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


def _predicted(ns: argparse.Namespace) -> int:
    """The peaks predicted without training (tools/predict/report.py)."""
    from offloadd.tools.predict.report import predict_rows, recommend, render, rows_json
    from offloadd.tools.predict.trace import TraceSpec

    try:
        limit = parse_size("--memory-limit", ns.memory_limit) if ns.memory_limit else None
        names = list(dict.fromkeys(s.strip() for s in ns.strategies.split(",") if s.strip()))
        bad = [s for s in names if s not in PREDICTED + ON_REQUEST]
        if bad or not names:
            raise ValueError(
                f"--strategies must list names from {', '.join(PREDICTED + ON_REQUEST)}, got "
                f"{ns.strategies!r}"
            )
        if limit is None and "auto" in names:
            print("offloadd plan: auto is predicted inside a --memory-limit only", file=sys.stderr)
            names.remove("auto")
            if not names:
                raise ValueError("--strategies auto needs --memory-limit")
        for opt in ("layers", "hidden", "heads", "seq", "batch"):
            if getattr(ns, opt) <= 0:
                raise ValueError(f"--{opt} must be positive, got {getattr(ns, opt)}")
        if ns.hf_config is not None:
            from offloadd.tools.models.hf_config import check_seq, load_config

            check_seq(load_config(ns.hf_config), ns.seq)
        elif ns.hidden % ns.heads:
            raise ValueError(f"--heads ({ns.heads}) must divide --hidden ({ns.hidden})")
        config = Config.load(ns.config)
        if ns.json:
            ready_parent("--json", ns.json)
    except (ValueError, ImportError, OSError) as e:
        print(f"offloadd plan: {e}", file=sys.stderr)
        return 2
    spec = TraceSpec(
        model=ns.model,
        layers=ns.layers,
        hidden=ns.hidden,
        heads=ns.heads,
        vocab=ns.vocab,
        hf_config=ns.hf_config,
        optimizer=ns.optimizer,
        min_bytes=config.min_bytes,
        staging_bytes=config.staging_bytes,
    )
    try:
        rows = predict_rows(spec, names, ns.batch, ns.seq, limit, held=ns.allocator == "held")
    except Exception as e:  # a model the trace cannot run, or the base not measured
        print(f"offloadd plan: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    print(render(rows, ns.batch, ns.seq, limit))
    advice, toml = recommend(rows, ns.batch, limit)
    print(f"\nrecommended: {advice}")
    if toml:
        print(toml, end="")
    if ns.json:
        with open(ns.json, "w", encoding="utf-8") as f:
            f.write(rows_json(rows, spec, ns.batch, ns.seq, limit))
    return 0


if __name__ == "__main__":  # pragma: no cover
    parser = argparse.ArgumentParser(prog="offloadd plan")
    add_arguments(parser)
    raise SystemExit(main(parser.parse_args()))
