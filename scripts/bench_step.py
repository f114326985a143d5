#!/usr/bin/env python3
"""Step time and memory of keep / recompute / ssd offload on the built-in GPT, as ratios.

Each configuration runs in its own process (clean peak RSS), the strategies interleaved round by
round so drift hits all of them alike; medians over rounds are reported with the ratios the core
issue sets targets for. A second part measures the hook cost per small kept tensor and how the
resident bytes scale with depth.

    python scripts/bench_step.py --layers 12 --d-model 768 --seq 512 --batch 2 --rounds 3 \
        --out docs/benchmarks/core_cpu_$(date +%F).md
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import psutil
import torch

from offloadd import Offloader
from offloadd.runtime.stats import format_bytes
from offloadd.tools.train import RunSpec, add_model_arguments, model_kwargs, run_in_subprocess


def hook_cost_us(ops: int = 5000, pairs: int = 15) -> dict[str, float]:
    """Microseconds added per saved small tensor (pack + unpack + release), over identity hooks.

    Runs alternate (identity, offloadd) ``pairs`` times; the minimum of each is compared, which
    filters out the noise of a shared 2-core machine."""
    x = torch.randn(16, requires_grad=True)
    off = Offloader(tier="keep")
    identity = torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)

    def timed(ctx: object) -> float:
        with ctx:  # type: ignore[attr-defined]
            t0 = time.perf_counter()
            for _ in range(ops // 100):
                y = x
                for _ in range(100):
                    y = y.sin()  # saves one small tensor each
                y.sum().backward()
            return time.perf_counter() - t0

    base, ours = [], []
    for _ in range(pairs):
        base.append(timed(identity))
        ours.append(timed(off))
    off.close()
    b, o = min(base) / ops * 1e6, min(ours) / ops * 1e6
    return {"identity_us": b, "offloadd_us": o, "added_us": o - b}


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_model_arguments(p, layers=12, d_model=768, heads=12, seq=512, batch=2, steps=3)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument(
        "--deep-layers", type=int, default=48, help="depth for the scaling check (0: skip)"
    )
    p.add_argument("--strategies", default="keep,recompute,ssd")
    p.add_argument("--out", default=None, help="write a markdown report here")
    p.add_argument(
        "--malloc-mmap-threshold",
        type=int,
        default=None,
        help="set MALLOC_MMAP_THRESHOLD_ for every run (same for all strategies)",
    )
    ns = p.parse_args()

    if ns.malloc_mmap_threshold is not None:
        os.environ["MALLOC_MMAP_THRESHOLD_"] = str(ns.malloc_mmap_threshold)
    common = model_kwargs(ns)
    strategies = ns.strategies.split(",")
    results: dict[str, list[dict]] = {s: [] for s in strategies}
    for r in range(ns.rounds):
        for s in strategies:
            print(f"round {r + 1}/{ns.rounds}: {s}", file=sys.stderr, flush=True)
            results[s].append(run_in_subprocess(RunSpec(strategy=s, **common)))  # type: ignore[arg-type]

    def med(s: str, key: str) -> float:
        return statistics.median(x[key] for x in results[s])

    def med_stat(s: str, key: str) -> float:
        return statistics.median(x["stats"][key] for x in results[s])

    lines = []
    cpu = platform.processor() or platform.machine()
    lines.append("# Core benchmark: keep vs recompute vs ssd offload (CPU)\n")
    lines.append(f"- date: {time.strftime('%Y-%m-%d')}")
    lines.append(
        f"- machine: {os.cpu_count()} cores ({cpu}), "
        f"{format_bytes(psutil.virtual_memory().total)} RAM, torch {torch.__version__}"
    )
    lines.append(f"- command: `python {' '.join(sys.argv)}`")
    lines.append(
        f"- MALLOC_MMAP_THRESHOLD_: {os.environ.get('MALLOC_MMAP_THRESHOLD_', 'unset (glibc default)')}"
    )
    lines.append(
        f"- model: built-in GPT, {ns.layers} layers, d={ns.d_model}, seq {ns.seq}, "
        f"batch {ns.batch}; {ns.steps} timed steps after 1 warm-up, {ns.rounds} rounds "
        "interleaved, one process per run; medians over rounds\n"
    )
    lines.append(
        "| strategy | step time (s) | peak RSS above model | peak saved bytes held "
        "(offloadd accounting) | written | read | io wait (s) |"
    )
    lines.append("|---|---|---|---|---|---|---|")
    for s in strategies:
        held = format_bytes(med_stat(s, "peak_resident_bytes")) if "stats" in results[s][0] else "-"
        wr = format_bytes(med_stat(s, "bytes_written")) if "stats" in results[s][0] else "-"
        rd = format_bytes(med_stat(s, "bytes_read")) if "stats" in results[s][0] else "-"
        io = f"{med_stat(s, 'io_wait_s'):.3f}" if "stats" in results[s][0] else "-"
        lines.append(
            f"| {s} | {med(s, 'step_time_s'):.3f} | "
            f"{format_bytes(med(s, 'peak_rss_above_base'))} | {held} | {wr} | {rd} | {io} |"
        )
    lines.append("")
    if "keep" in results and "ssd" in results:
        per_round = [
            o["step_time_s"] / k["step_time_s"]
            for o, k in zip(results["ssd"], results["keep"], strict=True)
        ]
        lines.append("| ratio | value | target |")
        lines.append("|---|---|---|")
        lines.append(
            f"| ssd step time / keep (median of per-round ratios; min..max) | "
            f"{statistics.median(per_round):.3f} ({min(per_round):.3f}..{max(per_round):.3f}) | <= 1.05 |"
        )
        if "recompute" in results:
            rr = [
                o["step_time_s"] / k["step_time_s"]
                for o, k in zip(results["ssd"], results["recompute"], strict=True)
            ]
            lines.append(f"| ssd step time / recompute | {statistics.median(rr):.3f} | < 1 |")
        lines.append(
            f"| ssd peak_resident_bytes / keep | "
            f"{med_stat('ssd', 'peak_resident_bytes') / med_stat('keep', 'peak_resident_bytes'):.3f} | <= 0.25 |"
        )
        lines.append(
            f"| ssd peak RSS above model / keep | "
            f"{med('ssd', 'peak_rss_above_base') / med('keep', 'peak_rss_above_base'):.3f} | <= 0.5 |"
        )
        same = len({x["weights_sha256"] for s in ("keep", "ssd") for x in results[s]}) == 1
        lines.append(
            f"\nFinal weights bit-identical across keep and ssd runs: {'yes' if same else 'NO'}\n"
        )
    hc = hook_cost_us()
    lines.append(
        f"Hook cost per small kept tensor (pack + unpack, added over identity hooks): "
        f"{hc['added_us']:.2f} µs (identity hooks {hc['identity_us']:.2f} µs per op, "
        f"offloadd {hc['offloadd_us']:.2f} µs); target <= 3 µs\n"
    )
    if ns.deep_layers:
        deep = dict(common, num_layers=ns.deep_layers, steps=1)
        shallow = dict(common, steps=1)
        a = run_in_subprocess(RunSpec(strategy="ssd", **shallow))  # type: ignore[arg-type]
        b = run_in_subprocess(RunSpec(strategy="ssd", **deep))  # type: ignore[arg-type]
        ra, rb = a["stats"]["peak_resident_bytes"], b["stats"]["peak_resident_bytes"]
        lines.append(
            f"Depth scaling (ssd): peak_resident_bytes {format_bytes(ra)} at {ns.layers} "
            f"layers, {format_bytes(rb)} at {ns.deep_layers} layers: ratio {rb / ra:.3f} "
            f"(target <= 1.2); saved bytes {format_bytes(a['stats']['saved_bytes'])} vs "
            f"{format_bytes(b['stats']['saved_bytes'])}\n"
        )
    report = "\n".join(lines)
    print(report)
    if ns.out:
        Path(ns.out).parent.mkdir(parents=True, exist_ok=True)
        Path(ns.out).write_text(report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
