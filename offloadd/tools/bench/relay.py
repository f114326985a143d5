"""``offloadd bench relay``: peak RSS, resident weight bytes and step time of a frozen-backbone
fine-tune with its frozen weights relayed from SSD (``offloadd.relay``) against resident.

The model is an HF Llama built from a config (random weights, nothing downloaded): hidden 512,
intermediate 1376, 8 heads, vocabulary 2000; at 32 layers its decoder layers' Linear weights are
~390 MiB of fp32. Those are frozen; the norms, embeddings and ``lm_head`` train under AdamW
(batch 2 x 128 tokens, CPU). Configurations, each run in its own process (harness/child.py),
in rounds interleaved A B C, C B A, ...:

- ``plain``: no relay, ``--layers`` (32);
- ``relay``: relay (``--window`` 2, ``--tier`` ssd in ``--ssd-dir``), ``--layers``;
- ``relay-shallow``: relay, ``--shallow-layers`` (8);
- ``plain-shallow`` (with ``--plain-shallow``): no relay, ``--shallow-layers``.

Each run trains ``--warmup`` untimed steps, then ``--steps`` timed ones (their median; every
step's time is kept in the JSON). Peak RSS is above the process's RSS before the model was
built, the high-water mark reset once the model is set up (relay_run.py). The ratios, each per
round, then their median and spread over rounds:

- peak RSS saved by relay / frozen weight bytes (target >= 0.8);
- relay's peak resident weight bytes, ``--layers`` / ``--shallow-layers`` (target <= 1.1: flat
  in depth);
- step time, relay / no relay (target <= 1.15).

Relay is exact: the losses and the trained weights of ``plain`` and ``relay`` (same seed) are
compared bit for bit. The full benchmark (``--quick``: a smoke run of a tiny model):

    offloadd bench relay --rounds 3 --out relay.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from offloadd.cli_dirs import ready_dir, ready_parent
from offloadd.tools.bench.relay_run import MODULE, RelaySpec
from offloadd.tools.harness.child import RunFailed, run_module
from offloadd.tools.harness.machine import command_line, describe_machine, machine_line
from offloadd.tools.harness.step_trace import preload_env
from offloadd.tools.models.hf import require_transformers
from offloadd.units import format_bytes

__all__ = [
    "CONFIGS",
    "DEFAULT_DIR",
    "FULL",
    "HELP",
    "QUICK",
    "RATIOS",
    "add_arguments",
    "exactness",
    "format_report",
    "main",
    "ratios",
]

HELP = "peak RSS, resident weights and step time of a frozen-backbone fine-tune, relay vs none"

DEFAULT_DIR = "/var/tmp/offloadd-relay-bench"

CONFIGS: Mapping[str, tuple[bool, bool]] = {
    "plain": (False, True),
    "relay": (True, True),
    "relay-shallow": (True, False),
    "plain-shallow": (False, False),
}
"""label -> (relayed, at ``--layers`` rather than ``--shallow-layers``)."""

FULL = {
    "layers": 32,
    "shallow_layers": 8,
    "hidden": 512,
    "intermediate": 1376,
    "heads": 8,
    "vocab": 2000,
    "batch": 2,
    "seq": 128,
    "warmup": 3,
    "steps": 8,
    "rounds": 3,
}
"""The issue's sizes: the options' defaults."""

QUICK = {
    **FULL,
    "layers": 4,
    "shallow_layers": 2,
    "hidden": 64,
    "intermediate": 172,
    "heads": 4,
    "seq": 32,
    "warmup": 1,
    "steps": 2,
    "rounds": 1,
}
"""``--quick``'s defaults: a smoke run (an option given still wins)."""

Runs = Mapping[str, Sequence[Mapping[str, Any]]]
"""Each configuration's results, one per round, rounds in the same order."""


def _saved_over_frozen(a: Mapping[str, Any], b: Mapping[str, Any]) -> float | None:
    frozen = b["frozen_bytes"]
    return (a["peak_rss_above_base"] - b["peak_rss_above_base"]) / frozen if frozen else None


def _quotient(key: str) -> Callable[[Mapping[str, Any], Mapping[str, Any]], float | None]:
    def f(a: Mapping[str, Any], b: Mapping[str, Any]) -> float | None:
        return a[key] / b[key] if b[key] else None

    return f


RATIOS: tuple[tuple[str, str, str, str, float, Callable[..., float | None]], ...] = (
    (
        "peak RSS saved by relay / frozen weight bytes",
        "plain",
        "relay",
        ">=",
        0.8,
        _saved_over_frozen,
    ),
    (
        "peak resident weight bytes, deep / shallow (relay)",
        "relay",
        "relay-shallow",
        "<=",
        1.1,
        _quotient("peak_resident_bytes"),
    ),
    ("step time, relay / no relay", "relay", "plain", "<=", 1.15, _quotient("step_time_s")),
)
"""(label, first configuration, second, comparison, target, f(first's run, second's run))."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    sizes = {
        "layers": "decoder layers of the deep configurations",
        "shallow_layers": "decoder layers of the shallow ones",
        "hidden": "hidden size",
        "intermediate": "MLP size",
        "heads": "attention heads",
        "vocab": "vocabulary",
        "batch": "batch size",
        "seq": "sequence length",
        "warmup": "untimed steps first (at least 3 for steady state)",
        "steps": "timed steps (their median)",
        "rounds": "interleaved rounds of every configuration",
    }
    for name, what in sizes.items():
        p.add_argument(
            f"--{name.replace('_', '-')}",
            type=int,
            default=None,
            help=f"{what} (default {FULL[name]}; --quick: {QUICK[name]})",
        )
    p.add_argument("--quick", action="store_true", help="a smoke run of a tiny model")
    p.add_argument("--window", type=int, default=2, help="relay's window (layers resident)")
    p.add_argument("--tier", default="ssd", choices=("ssd", "cpu"), help="where relay keeps them")
    p.add_argument(
        "--ssd-dir",
        default=DEFAULT_DIR,
        help=f"relay's directory, created (mode 0700) if missing (default {DEFAULT_DIR})",
    )
    p.add_argument(
        "--plain-shallow", action="store_true", help="also run no relay at --shallow-layers"
    )
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument(
        "--allocator",
        choices=("system", "caching", "jemalloc", "tcmalloc"),
        default="system",
        help="torch's CPU allocator in every run (held equal): glibc's heap, offloadd's host cache, "
        "or jemalloc/tcmalloc preloaded",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--progress", action="store_true", help="each run's steps on stderr")
    p.add_argument(
        "--out",
        default=None,
        help="also write every run and the ratios as JSON here (its directory created, mode "
        "0700, if missing)",
    )


def _options(ns: argparse.Namespace) -> tuple[dict[str, Any], int, list[str]]:
    """(the sizes, the rounds, the configurations); ValueError names a bad option."""
    given = QUICK if ns.quick else FULL
    sizes = {k: given[k] if getattr(ns, k) is None else getattr(ns, k) for k in FULL}
    for k, v in sizes.items():
        least = 0 if k == "warmup" else 1
        if v < least:
            raise ValueError(f"--{k.replace('_', '-')} must be at least {least}, got {v}")
    if sizes["hidden"] % sizes["heads"]:
        raise ValueError(f"--heads ({sizes['heads']}) must divide --hidden ({sizes['hidden']})")
    if ns.window < 1:
        raise ValueError(f"--window must be at least 1, got {ns.window}")
    if ns.threads < 0:
        raise ValueError(f"--threads must be 0 or more, got {ns.threads}")
    preload_env(ns.allocator, {})  # --allocator jemalloc/tcmalloc: ValueError naming the package
    require_transformers()
    # last, so that a bad option creates nothing (Note [directories of the command line])
    if ns.tier == "ssd":
        ready_dir("--ssd-dir", ns.ssd_dir)
    if ns.out:
        ready_parent("--out", ns.out)
    configs = [c for c in CONFIGS if ns.plain_shallow or c != "plain-shallow"]
    return sizes, sizes.pop("rounds"), configs


def _spec(label: str, sizes: Mapping[str, Any], ns: argparse.Namespace) -> RelaySpec:
    relayed, deep = CONFIGS[label]
    fields = {k: v for k, v in sizes.items() if k != "shallow_layers"}
    fields["layers"] = sizes["layers"] if deep else sizes["shallow_layers"]
    return RelaySpec(
        **fields,
        seed=ns.seed,
        relay=relayed,
        window=ns.window,
        tier=ns.tier,
        ssd_dir=ns.ssd_dir if ns.tier == "ssd" else None,
        threads=ns.threads,
        allocator=ns.allocator,
    )


def ratios(runs: Runs) -> dict[str, dict[str, Any]]:
    """Each ratio of RATIOS: per round, their median, min and max, the target and whether the
    median meets it."""
    out: dict[str, dict[str, Any]] = {}
    for label, first, second, cmp, target, f in RATIOS:
        values = [f(a, b) for a, b in zip(runs[first], runs[second], strict=True)]
        per_round = [v for v in values if v is not None]
        median = statistics.median(per_round) if per_round else None
        met = None if median is None else (median >= target if cmp == ">=" else median <= target)
        out[label] = {
            "per_round": per_round,
            "median": median,
            "min": min(per_round, default=None),
            "max": max(per_round, default=None),
            "target": f"{cmp} {target}",
            "met": met,
        }
    return out


def exactness(runs: Runs) -> dict[str, dict[str, bool]]:
    """Per pair (no relay, relay) of the same depth: whether every round's losses and trained
    weights are bit-identical."""
    out: dict[str, dict[str, bool]] = {}
    for plain, relayed in (("plain", "relay"), ("plain-shallow", "relay-shallow")):
        if plain in runs and relayed in runs:
            pairs = list(zip(runs[plain], runs[relayed], strict=True))
            out[f"{plain} vs {relayed}"] = {
                "losses_identical": all(a["losses"] == b["losses"] for a, b in pairs),
                "weights_identical": all(
                    a["trainable_sha256"] == b["trainable_sha256"] for a, b in pairs
                ),
            }
    return out


def _med(runs: Sequence[Mapping[str, Any]], key: str) -> float | None:
    values = [float(r[key]) for r in runs if r.get(key) is not None]
    return statistics.median(values) if values else None


def _bytes(v: float | None) -> str:
    return "-" if v is None else format_bytes(v)


def _num(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f}"


def format_report(
    runs: Runs, sizes: Mapping[str, Any], ns: argparse.Namespace, machine: dict[str, Any]
) -> str:
    n = len(next(iter(runs.values())))
    lines = [
        "## offloadd bench relay",
        "",
        f"- command: `{command_line()}`",
        f"- machine: {machine_line(machine)}",
        f"- model: HF Llama, hidden {sizes['hidden']}, intermediate {sizes['intermediate']}, "
        f"{sizes['heads']} heads, vocabulary {sizes['vocab']}; decoder Linear weights frozen, "
        f"the rest trained (AdamW); batch {sizes['batch']} x {sizes['seq']}",
        f"- allocator: {ns.allocator} (every run); relay: window {ns.window}, tier {ns.tier}"
        + (f" in {ns.ssd_dir}" if ns.tier == "ssd" else ""),
        f"- {sizes['steps']} timed steps (their median) after {sizes['warmup']} warm-up, "
        f"{n} round(s) interleaved, one process per run; medians over rounds",
        "",
        "| configuration | layers | step time | RSS above base after setup | peak RSS above base "
        "| frozen weights | peak resident weights | read per step | read wait per step |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for label, rs in runs.items():
        wait = _med(rs, "wait_s_per_step")
        lines.append(
            f"| {label} | {rs[0]['layers']} | {_num(_med(rs, 'step_time_s'))} s | "
            f"{_bytes(_med(rs, 'setup_rss_above_base'))} | "
            f"{_bytes(_med(rs, 'peak_rss_above_base'))} | {_bytes(rs[0]['frozen_bytes'])} | "
            f"{_bytes(_med(rs, 'peak_resident_bytes'))} | "
            f"{_bytes(_med(rs, 'read_bytes_per_step'))} | "
            + ("-" if wait is None else f"{wait:.3f} s")
            + " |"
        )
    lines += [
        "",
        f"| ratio | median | spread over {n} round(s) | target | met |",
        "|---|---|---|---|---|",
    ]
    for label, r in ratios(runs).items():
        met = "-" if r["met"] is None else "yes" if r["met"] else "NO"
        lines.append(
            f"| {label} | {_num(r['median'])} | {_num(r['min'])} - {_num(r['max'])} | "
            f"{r['target']} | {met} |"
        )
    lines.append("")
    for pair, same in exactness(runs).items():
        lines.append(
            f"- {pair}: losses bit-identical: {'yes' if same['losses_identical'] else 'NO'}; "
            f"trained weights bit-identical: {'yes' if same['weights_identical'] else 'NO'}"
        )
    return "\n".join(lines)


def main(ns: argparse.Namespace) -> int:
    try:
        sizes, rounds, configs = _options(ns)
    except (ValueError, ImportError) as e:
        print(f"offloadd bench relay: {e}", file=sys.stderr)
        return 2
    runs: dict[str, list[dict[str, Any]]] = {c: [] for c in configs}
    for r in range(rounds):
        for c in configs if r % 2 == 0 else configs[::-1]:
            print(f"round {r + 1}/{rounds}: {c}", file=sys.stderr, flush=True)
            spec = _spec(c, sizes, ns)
            try:
                runs[c].append(
                    run_module(
                        MODULE,
                        dataclasses.asdict(spec),
                        what=f"bench relay run {c}",
                        progress=ns.progress,
                        env=preload_env(ns.allocator, os.environ),
                    )
                )
            except RunFailed as e:
                print(f"offloadd bench relay: {e}", file=sys.stderr)
                return 1
    machine = describe_machine("cpu", ns.ssd_dir if ns.tier == "ssd" else None)
    print(format_report(runs, sizes, ns, machine))
    if ns.out:
        doc = {
            "command": command_line(),
            "machine": machine,
            "sizes": {**sizes, "rounds": rounds},
            "window": ns.window,
            "tier": ns.tier,
            "ssd_dir": ns.ssd_dir if ns.tier == "ssd" else None,
            "ratios": ratios(runs),
            "exact": exactness(runs),
            "runs": runs,
        }
        Path(ns.out).write_text(json.dumps(doc, indent=1) + "\n")
    return 0
