#!/usr/bin/env python3
"""Same as ``offloadd bench io``: the I/O engines against fio on the same directory.

Example (the run in docs/benchmarks/):
    flock /work/bench.lock python scripts/bench_io.py --dir /var/tmp --gil --json io.json
"""

import sys

from offloadd.cli import main

if __name__ == "__main__":
    raise SystemExit(main(["bench", "io", *sys.argv[1:]]))
