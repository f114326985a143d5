#!/usr/bin/env python3
"""auto against the fastest single strategy that fits its budget, pooled over several ROK sweeps.

One round of one auto point is a ratio: auto's throughput over the same round's run of the single
strategy ``offloadd rok`` judges it against. On a machine whose rounds differ by several per cent,
one point's two or three rounds cannot resolve the 2 % that the planner's target (within 2 % of the fastest) needs; pooling the
ratios of every point of several sweeps narrows the interval (on this project's VM, 26 of them
still did not resolve 2 %). Prints each ratio, their geometric mean and a 95 % bootstrap interval
(``offloadd.tools.rok.summary.pooled``).

    python scripts/rok_pool.py docs/benchmarks/rok-race_hf-gpt2_cpu-2core_2026-11-26.csv /tmp/rok/rok.csv
"""

from __future__ import annotations

import argparse
import hashlib
from pathlib import Path

from offloadd.tools.rok.points import read_points
from offloadd.tools.rok.summary import auto_rounds, pooled


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("csv", type=Path, nargs="+", help="rok.csv files (or their copies in docs/)")
    ns = p.parse_args()
    ratios = []
    seen: dict[str, Path] = {}
    for path in ns.csv:
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        if digest in seen:
            print(f"{path}: the same file as {seen[digest]}, skipped")
            continue
        seen[digest] = path
        for r in auto_rounds(read_points(path)):
            print(
                f"{path.name}: {r['strategy']} batch {r['batch_size']} round {r['round']}: "
                f"{r['ratio']:.3f}"
            )
            ratios.append(r["ratio"])
    if len(ratios) < 2:
        raise SystemExit(
            f"rok_pool: {len(ratios)} auto point-rounds with a single strategy to "
            "compare; pooling needs two or more"
        )
    mean, lo, hi = pooled(ratios)
    below = sum(x < 0.98 for x in ratios)
    print(
        f"{len(ratios)} point-rounds: geometric mean {mean:.3f}x, 95 % bootstrap interval "
        f"{lo:.3f}-{hi:.3f}x; {below} below 0.98x, lowest {min(ratios):.3f}x"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
