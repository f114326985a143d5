#!/usr/bin/env python3
"""Same as ``offloadd bench step``: keep, recompute and ssd offload on one model, as ratios.

Examples (the two points benchmarked in docs/benchmarks):
    flock /work/bench.lock python scripts/bench_step.py --rounds 3 --ssd-dir /var/tmp/offloadd
    flock /work/bench.lock python scripts/bench_step.py --model gpt --layers 8 --d-model 512 \\
        --heads 8 --seq 512 --batch 4 --rounds 3 --deep-layers 0
"""

import sys

from offloadd.cli import main

if __name__ == "__main__":
    raise SystemExit(main(["bench", "step", *sys.argv[1:]]))
