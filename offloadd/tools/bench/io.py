"""``offloadd bench io``: the I/O engines against fio, on the same directory, in the same run.

For each request size, it first finds fio's best configuration over a small grid
({libaio, io_uring} x iodepth {8, 32} x numjobs {1, 4}, O_DIRECT, same request size), which is
the device's practical peak here. Then it alternates pairs (engine, fio-best) ``--pairs`` times,
writing then reading back ``--total-bytes``, and reports medians, spreads and the ratios
engine / fio. fio is timed like the engines, from the first request issued to the last
completed (its latency log), not by its own ``--group_reporting`` figure, which divides by the
longest single job's run time (see [fio's wall span] in io_fio). Both sides write over
blocks written before (the engine's first pass lays its file out, an untimed fio pass lays out
fio's files), so neither pays for allocating blocks in the timed runs. Content is verified
once per engine (write, read back, compare) outside the timed runs. CPU cost is CPU-seconds per
GB moved: the process's CPU time for the engines (every thread), fio's own usr+sys for fio.

The engines' buffers are backed by huge pages, as offloadd's staging slots are (see
[huge-page buffers] in offloadd/io/hugepages.py); fio's are not (it cannot ask for them), which
on a virtual disk is worth a large factor (docs/benchmarks/native-io_cpu-2core_2026-11-23.md).
``--small-pages`` measures the engines on 4 KiB pages, like for like with fio.

``--gil`` adds the mode that made csrc/ necessary: the same engine runs while the main thread
spins in a pure-Python loop (holding the GIL, as a training loop does), and the ratio to its
idle throughput is reported.
"""

# The docstring above is also the command's --help description (see bench.py). The command's
# modules: this one (options, the summary table), io_run (the measurement),
# io_engines (a timed pass through an engine) and io_fio (one fio run).

from __future__ import annotations

import argparse
import json
import shutil
import sys
from typing import Any

from offloadd.cli_dirs import ready_dir, ready_parent
from offloadd.config import parse_size
from offloadd.io.files import default_offload_dir
from offloadd.tools.bench.io_engines import ENGINES
from offloadd.tools.bench.io_run import run_bench

__all__ = ["HELP", "add_arguments", "format_summary", "main"]

HELP = "measure the I/O engines against fio on the same directory"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--dir",
        action="append",
        default=None,
        help="directory (repeat to stripe), created (mode 0700) if missing",
    )
    p.add_argument("--total-bytes", default="1GiB", help="bytes written and read per run")
    p.add_argument(
        "--request-bytes", default="4MiB,16MiB,64MiB", help="request sizes (comma-separated)"
    )
    p.add_argument(
        "--engine",
        default=",".join(ENGINES),
        help=f"engines to measure (comma-separated from {', '.join(ENGINES)})",
    )
    p.add_argument("--threads", type=int, default=4, help="engine threads / requests in flight")
    p.add_argument("--pairs", type=int, default=5, help="alternating (engine, fio) pairs")
    p.add_argument("--gil", action="store_true", help="also measure under a GIL-holding loop")
    p.add_argument("--no-fio", action="store_true", help="skip fio (engines only)")
    p.add_argument(
        "--small-pages",
        action="store_true",
        help="engine buffers on 4 KiB pages (default: huge pages, as offloadd's staging slots)",
    )
    p.add_argument(
        "--json",
        metavar="PATH",
        help="write the results as JSON to PATH ('-': stdout; its directory created if missing)",
    )


def main(ns: argparse.Namespace) -> int:
    try:
        opts = _options(ns)
    except ValueError as e:
        print(f"offloadd bench io: {e}", file=sys.stderr)
        return 2
    result = run_bench(**opts)
    print(format_summary(result))
    if ns.json == "-":
        json.dump(result, sys.stdout, indent=2)
        print()
    elif ns.json:
        with open(ns.json, "w") as f:
            json.dump(result, f, indent=2)
        print(f"results written to {ns.json}", file=sys.stderr)
    return 0


def _options(ns: argparse.Namespace) -> dict[str, Any]:
    total = parse_size("--total-bytes", ns.total_bytes)
    sizes = [parse_size("--request-bytes", s) for s in ns.request_bytes.split(",") if s]
    if not sizes:
        raise ValueError("--request-bytes: give at least one size")
    for s in sizes:
        if s <= 0 or s % 4096:
            raise ValueError(f"--request-bytes: {s} is not a positive multiple of 4096")
        if 4 * s > total:  # fio's grid runs 4 jobs, each moving total / 4
            raise ValueError(
                f"--total-bytes {total} must be at least 4 x --request-bytes ({s}): "
                "fio runs up to 4 jobs and each must move whole requests"
            )
    engines = [e for e in ns.engine.split(",") if e]
    for e in engines:
        if e not in ENGINES:
            raise ValueError(f"--engine: unknown engine {e!r}; known: {', '.join(ENGINES)}")
    if ns.pairs < 1:
        raise ValueError(f"--pairs must be at least 1, got {ns.pairs}")
    if not 1 <= ns.threads <= 256:
        raise ValueError(f"--threads must be in 1..256, got {ns.threads}")
    # last, so that a bad option creates nothing (Note [directories of the command line])
    dirs = [str(ready_dir("--dir", d)) for d in ns.dir] if ns.dir else [default_offload_dir()]
    if ns.json and ns.json != "-":
        ready_parent("--json", ns.json)
    fio = None if ns.no_fio else shutil.which("fio")
    if not ns.no_fio and fio is None:
        print(
            "offloadd bench io: fio not found (Debian: apt-get install fio); engines only",
            file=sys.stderr,
        )
    return dict(
        dirs=dirs,
        total_bytes=total,
        request_sizes=sizes,
        engines=engines,
        threads=ns.threads,
        pairs=ns.pairs,
        gil=ns.gil,
        fio=fio,
        huge_pages=not ns.small_pages,
    )


def format_summary(result: dict[str, Any]) -> str:
    """A table: one line per (request size, engine) with GB/s, ratios to fio and CPU cost."""
    lines = [
        f"{'request':>8} {'engine':<15} {'write':>7} {'read':>7} {'w/fio':>6} {'r/fio':>6} "
        f"{'fio w':>6} {'fio r':>6} {'CPU-s/GB w':>10} {'r':>5} {'GIL w':>6} {'GIL r':>6}"
    ]

    def f(v: Any, spec: str = ".2f") -> str:
        return format(v, spec) if isinstance(v, float) else "-"

    for entry in result["sizes"]:
        for name in ENGINES:
            e = entry.get(name)
            if e is None:
                continue
            lines.append(
                f"{entry['request_bytes'] >> 20:>5}MiB {name:<15} {f(e.get('write_GBps')):>7} "
                f"{f(e.get('read_GBps')):>7} {f(e.get('write_vs_fio')):>6} "
                f"{f(e.get('read_vs_fio')):>6} {f(e.get('fio_write_GBps')):>6} "
                f"{f(e.get('fio_read_GBps')):>6} {f(e.get('write_cpu_s_per_GB'), '.3f'):>10} "
                f"{f(e.get('read_cpu_s_per_GB'), '.3f'):>5} {f(e.get('gil_write_vs_idle')):>6} "
                f"{f(e.get('gil_read_vs_idle')):>6}"
            )
    lines.append(
        "GB/s = 1e9 bytes/s, medians over the pairs; w/fio, r/fio: engine / fio-best per pair"
    )
    lines.append(
        "CPU-s/GB: the engine's whole process (io_uring's kernel workers included); "
        "fio reports its job threads only"
    )
    return "\n".join(lines)
