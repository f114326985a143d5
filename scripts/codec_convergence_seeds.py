"""Codec convergence over several seeds: one table from the CSVs of several
``python -m scripts.codec_convergence`` runs, each with its own ``--seed`` (other initial
weights, other batches).

One run resolves a final-loss gap of about +-0.7 % (its control runs say so); whether a codec's
gap is its own or that run's luck shows only over seeds. For every CSV (one seed) and codec, the
final loss (mean of the last ``--window`` steps) is divided by that CSV's ``none``; the table
gives each seed's gap, their mean with its standard error, the range and the verdict against the
accepted bounds (1 % for int8 and fp8, 3 % for int4; int2 reported only) for the mean and for the
worst seed.

    python scripts/codec_convergence_seeds.py --seed-csv 0=docs/benchmarks/codec_convergence_X.csv \\
        --seed-csv 1=/tmp/conv/seed1.csv ... --out docs/benchmarks/codec_convergence_seeds_X.md
"""

from __future__ import annotations

import argparse
import csv
import statistics
import sys
from pathlib import Path

BOUNDS = {"int8": 0.01, "fp8-e4m3": 0.01, "fp8-e5m2": 0.01, "int4": 0.03}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--seed-csv",
        action="append",
        required=True,
        metavar="SEED=PATH",
        help="a run's per-step CSV and the seed it ran with (repeat, one per seed)",
    )
    p.add_argument("--window", type=int, default=50, help="final loss: mean of the last N steps")
    p.add_argument("--out", type=Path, default=None, help="write the markdown here (else stdout)")
    p.add_argument("--note", action="append", default=[], help="a line for the markdown (repeat)")
    args = p.parse_args(argv)
    runs: list[tuple[int, Path]] = []
    for item in args.seed_csv:
        seed, sep, path = item.partition("=")
        if not sep or not seed.strip().lstrip("-").isdigit():
            p.error(f"--seed-csv: expected SEED=PATH, got {item!r}")
        if not Path(path).is_file():
            p.error(f"--seed-csv: {path} is not a file")
        runs.append((int(seed), Path(path)))
    args.runs = sorted(runs)
    return args


def final_losses(path: Path, window: int) -> dict[str, float]:
    """The mean of the last ``window`` losses of every column of a codec_convergence CSV."""
    with path.open(newline="") as f:
        rows = list(csv.DictReader(f))
    if not rows or "none" not in rows[0]:
        raise SystemExit(f"{path}: not a codec_convergence CSV (no 'none' column)")
    tail = rows[-window:]
    return {k: statistics.fmean(float(r[k]) for r in tail) for k in rows[0] if k != "step"}


def verdict(codec: str, gap: float) -> str:
    bound = BOUNDS.get(codec)
    if bound is None:
        return "reported only"
    return "pass" if abs(gap) <= bound else "FAIL"


def render(args: argparse.Namespace) -> str:
    finals = {seed: final_losses(path, args.window) for seed, path in args.runs}
    codecs = [
        c for c in next(iter(finals.values())) if c != "none" and "~" not in c and "@" not in c
    ]
    codecs = [c for c in codecs if all(c in f for f in finals.values())]
    seeds = [seed for seed, _ in args.runs]
    lines = [
        "| codec | " + " | ".join(f"seed {s}" for s in seeds) + " | mean ± s.e. | range | bound "
        "| mean verdict | worst-seed verdict |",
        "|---|" + "---|" * len(seeds) + "---|---|---|---|---|",
    ]
    for codec in codecs:
        gaps = [finals[s][codec] / finals[s]["none"] - 1 for s in seeds]
        mean = statistics.fmean(gaps)
        se = statistics.stdev(gaps) / len(gaps) ** 0.5 if len(gaps) > 1 else float("nan")
        worst = max(gaps, key=abs)
        bound = BOUNDS.get(codec)
        lines.append(
            f"| {codec} | "
            + " | ".join(f"{100 * g:+.2f} %" for g in gaps)
            + f" | {100 * mean:+.2f} ± {100 * se:.2f} % | {100 * min(gaps):+.2f} .. {100 * max(gaps):+.2f} % "
            f"| {'-' if bound is None else f'±{100 * bound:g} %'} | {verdict(codec, mean)} "
            f"| {verdict(codec, worst)} |"
        )
    none_row = " | ".join(f"{finals[s]['none']:.4f}" for s in seeds)
    lines.append(f"| none (final loss) | {none_row} | | | | | |")
    head = [
        "Final-loss gap to `none` (mean of the last "
        f"{args.window} training losses, codec over none minus 1) per seed:",
        "",
        *[f"- seed {s}: `{p}`" for s, p in args.runs],
        *[f"- {n}" for n in args.note],
        "",
    ]
    return "\n".join(head + lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    text = render(args)
    if args.out is None:
        sys.stdout.write(text)
    else:
        args.out.write_text(text)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
