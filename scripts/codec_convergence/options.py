"""The options of ``python -m scripts.codec_convergence``, checked, and what a run records about
its code and machine."""

from __future__ import annotations

import argparse
import datetime
import os
from pathlib import Path

import torch

from offloadd.codec import CODECS

from . import __doc__ as USAGE

ROOT = Path(__file__).resolve().parents[2]
TARGETS: dict[str, float] = {"int8": 0.01, "fp8-e4m3": 0.01, "fp8-e5m2": 0.01, "int4": 0.03}
"""The accepted bound on |final loss / none's - 1|; codecs not listed (int2) are reported only."""


# -- arguments ---------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m scripts.codec_convergence",
        description=USAGE,
        formatter_class=argparse.RawTextHelpFormatter,
    )
    p.add_argument(
        "--codecs",
        default="none,int8,fp8-e4m3,fp8-e5m2,int4,int2",
        help="comma-separated codecs; none is always run (default: %(default)s)",
    )
    p.add_argument("--steps", type=int, default=None, help="training steps (default: 300)")
    p.add_argument("--seed", type=int, default=0, help="init and batch-order seed (default: 0)")
    p.add_argument(
        "--extra-seeds",
        default="",
        help="comma-separated further seeds for none alone: its run-to-run spread (default: none)",
    )
    p.add_argument(
        "--perturb-runs",
        type=int,
        default=0,
        help="further runs of none, same seed, initial weights times (1 + eps * N(0, 1)), "
        "a different draw each (default: 0)",
    )
    p.add_argument("--perturb-eps", type=float, default=1e-6, help="(default: %(default)g)")
    p.add_argument(
        "--noise-runs",
        type=int,
        default=0,
        help="further runs of none, same seed, each gradient plus eps * its RMS * N(0, 1) at "
        "every step, a different stream each (default: 0)",
    )
    p.add_argument("--noise-eps", type=float, default=1e-2, help="(default: %(default)g)")
    p.add_argument("--tier", choices=("keep", "cpu", "ssd"), default="keep")
    p.add_argument("--ssd-dir", type=Path, default=None, help="offload directory (tier ssd)")
    p.add_argument(
        "--codec-min-bytes",
        type=int,
        default=64 << 10,
        help="codec.min_bytes (default: %(default)s, the config's default)",
    )
    p.add_argument("--layers", type=int, default=None, help="default: 4 (quick: 2)")
    p.add_argument("--d-model", type=int, default=None, help="default: 256 (quick: 64)")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=None, help="default: 128 (quick: 64)")
    p.add_argument("--batch", type=int, default=None, help="default: 16 (quick: 4)")
    p.add_argument("--dropout", type=float, default=0.0)
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (AdamW)")
    p.add_argument("--warmup", type=int, default=None, help="warm-up steps (default: steps/15)")
    p.add_argument("--window", type=int, default=50, help="final loss: mean of the last N steps")
    p.add_argument("--eval-batches", type=int, default=None, help="held-out batches (default 32)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument(
        "--max-minutes",
        type=float,
        default=0.0,
        help="skip the control runs (--perturb-runs, --noise-runs, --extra-seeds) that would "
        "end past this "
        "many minutes (0: never)",
    )
    p.add_argument("--print-every", type=int, default=None, help="progress every N steps")
    p.add_argument(
        "--out", type=Path, default=None, help="output folder (default: docs/benchmarks)"
    )
    p.add_argument(
        "--name", default=None, help="file stem (default: codec_convergence_<machine>_<date>)"
    )
    p.add_argument("--note", action="append", default=[], help="a note for the markdown (repeat)")
    p.add_argument("--quick", action="store_true", help="smoke run: tiny model, 20 steps")
    args = p.parse_args(argv)

    quick = args.quick
    defaults = {
        "steps": 20 if quick else 300,
        "layers": 2 if quick else 4,
        "d_model": 64 if quick else 256,
        "seq": 64 if quick else 128,
        "batch": 4 if quick else 16,
        "eval_batches": 4 if quick else 32,
        "print_every": 5 if quick else 25,
    }
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.warmup is None:
        args.warmup = max(1, args.steps // 15)
    args.window = min(args.window, max(1, args.steps // 2))
    codecs = [c.strip() for c in args.codecs.split(",") if c.strip()]
    for c in codecs:
        if c not in CODECS:
            p.error(f"--codecs: {c!r} is not one of {', '.join(CODECS)}")
    args.codecs = ["none", *[c for c in dict.fromkeys(codecs) if c != "none"]]
    args.extra_seeds = [int(s) for s in args.extra_seeds.split(",") if s.strip()]
    if args.tier == "ssd" and args.ssd_dir is None:
        p.error("--tier ssd needs --ssd-dir")
    if args.out is None:
        args.out = Path("/tmp/codec_convergence") if quick else ROOT / "docs" / "benchmarks"
    if args.name is None:
        day = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d")
        args.name = f"codec_convergence_{machine_tag()}_{day}"
    return args


def codec_provenance() -> str:
    """Which codec code this process runs: the compiled kernels or the torch ops, and a short
    hash of each source and extension file of offloadd/codec as imported."""
    import hashlib

    import offloadd.codec.quant as quant

    native = getattr(quant, "native_available", lambda: False)()
    folder = Path(quant.__file__).parent
    files = sorted(
        [*folder.glob("*.py"), *folder.glob("*.so")], key=lambda f: (f.suffix != ".py", f.name)
    )
    digests = ", ".join(
        f"{f.name} {hashlib.sha256(f.read_bytes()).hexdigest()[:12]}" for f in files
    )
    path = (
        "compiled kernels (csrc/codec/codec.c) for host integer and fp8 codes"
        if native
        else "torch ops"
    )
    return f"{path}; sha256 at start: {digests}"


def machine_tag() -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0).split()[-1].lower()
    return f"cpu-{os.cpu_count()}core"
