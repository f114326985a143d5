"""``offloadd bench``: benchmarks that print the ratio they exist for (see docs/benchmarks/)."""

from __future__ import annotations

import argparse

from offloadd.tools import bench_io

__all__ = ["add_arguments", "main"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="bench", required=True)
    bench_io.add_arguments(sub.add_parser("io", help=bench_io.HELP, description=bench_io.__doc__))


def main(ns: argparse.Namespace) -> int:
    status: int = bench_io.main(ns)  # the only benchmark so far
    return status
