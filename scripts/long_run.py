"""Does offloading's cost stay put over a long run? Step times by tenth of a long run, per strategy.

``bench step`` and ``rok`` time 8 steps after 3 warm-ups; a user trains for thousands. This runs
each strategy for ``--steps`` timed steps, each in its own process (the training loop of
``offloadd bench step``: ``offloadd.tools.harness.train``), strategies in turn, and reports the median
step time of each tenth of the run, the last tenth over the first (drift), the ratio of each
strategy's tenth to keep's (runs one after the other: the machine's drift between them is in
it), and peak RSS above the model. A cost that grows with the process's age (files, pools, the host cache, fragmentation)
shows as a ratio that rises from the first tenth to the last.

    python scripts/long_run.py --steps 1000 --out docs/benchmarks/long-run_cpu-2core_DATE
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from offloadd.tools.harness.train import RunSpec, run_in_subprocess
from offloadd.units import format_bytes

TENTHS = 10


def tenths(times: list[float]) -> list[float]:
    """The median of each tenth of ``times`` (the last tenth takes the remainder)."""
    n = max(1, len(times) // TENTHS)
    return [
        statistics.median(times[i * n : (i + 1) * n if i < TENTHS - 1 else None])
        for i in range(min(TENTHS, len(times)))
    ]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--strategies", default="keep,ssd")
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--ssd-dir", default=None)
    p.add_argument("--out", type=Path, required=True, help="page path without suffix")
    ns = p.parse_args()
    strategies = ns.strategies.split(",")
    if "keep" not in strategies:
        p.error("--strategies must include keep (the ratios are against it)")
    if ns.steps < TENTHS:
        p.error(f"--steps must be at least {TENTHS} (a median per tenth), got {ns.steps}")
    results: dict[str, dict[str, Any]] = {}
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    for s in strategies:
        spec = RunSpec(
            strategy=s,
            num_layers=ns.layers,
            d_model=ns.d_model,
            num_heads=ns.heads,
            seq_len=ns.seq,
            batch_size=ns.batch,
            steps=ns.steps,
            warmup=ns.warmup,
            allocator="caching",
            ssd_dir=ns.ssd_dir,
        )
        t0 = time.perf_counter()
        res = run_in_subprocess(spec)
        if res["oom"]:
            raise SystemExit(f"long_run: {s} ran out of memory: {res['error']}")
        res.pop("trace", None)  # a record per step: kept as step times only
        results[s] = res
        print(f"{s}: {ns.steps} steps in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    keep = tenths(results["keep"]["step_times_s"])
    lines = [
        f"# Long run: step time by tenth of {ns.steps} steps",
        "",
        f"- command: `{' '.join(['python', *sys.argv])}`",
        f"- started: {started}; the built-in GPT, {ns.layers} layers, d={ns.d_model}, seq "
        f"{ns.seq}, batch {ns.batch}; {ns.warmup} untimed steps first; every strategy on the "
        "host cache, each in its own process, one after another",
        "",
        "| strategy | "
        + " | ".join(f"tenth {i + 1}" for i in range(len(keep)))
        + " | last / first | peak RSS above the model |",
        "|---|" + "---|" * (len(keep) + 2),
    ]
    for s, res in results.items():
        t = tenths(res["step_times_s"])
        lines.append(
            f"| {s} step (s) | "
            + " | ".join(f"{x:.3f}" for x in t)
            + f" | {t[-1] / t[0]:.3f} | {format_bytes(res['peak_rss_above_base'])} |"
        )
    for s, res in results.items():
        if s == "keep":
            continue
        t = tenths(res["step_times_s"])
        ratio = [a / b for a, b in zip(t, keep, strict=True)]
        lines.append(
            f"| {s} / keep | "
            + " | ".join(f"{x:.3f}" for x in ratio)
            + f" | {ratio[-1] / ratio[0]:.3f} | - |"
        )
    same = {s: r["weights_sha256"] == results["keep"]["weights_sha256"] for s, r in results.items()}
    lines += ["", f"Final weights bit-identical to keep's: {same}", ""]
    ns.out.parent.mkdir(parents=True, exist_ok=True)
    ns.out.parent.joinpath(ns.out.name + ".md").write_text("\n".join(lines))
    ns.out.parent.joinpath(ns.out.name + ".json").write_text(json.dumps(results, indent=1) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
