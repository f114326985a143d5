"""``python -m scripts.codec_error``: the options, the run of its three parts, the JSON and the
markdown written (see the package's docstring)."""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch

from offloadd.codec import CODECS

from . import __doc__ as USAGE
from .common import LOSSY_DEFAULT, QUICK_OPS, ROOT, log
from .models import model_errors
from .ops import SMALL_GROUP, dump_json, op_corpus
from .probes import probes
from .report import markdown

# -- main -------------------------------------------------------------------------------------


CODE = (
    "offloadd/codec/*.py",
    "offloadd/offloader.py",
    "offloadd/runtime/runtime.py",
    "offloadd/config/schema.py",
)


def code_hashes() -> dict[str, str]:
    """sha256 (first 12 hex digits) of the files whose code is measured, to tell versions apart
    (other work may change them while the script runs: start and end are both recorded)."""
    files = sorted(f for pattern in CODE for f in ROOT.glob(pattern))
    return {
        str(f.relative_to(ROOT)): hashlib.sha256(f.read_bytes()).hexdigest()[:12] for f in files
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m scripts.codec_error",
        description=USAGE,
        formatter_class=argparse.RawTextHelpFormatter,
    )
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks", help="output folder")
    p.add_argument(
        "--name",
        default=f"codec_error_cpu-{os.cpu_count()}core_{datetime.date.today().isoformat()}",
        help="file name without extension (default: %(default)s)",
    )
    p.add_argument(
        "--codecs",
        default=",".join(LOSSY_DEFAULT),
        help="comma-separated codecs (default: %(default)s)",
    )
    p.add_argument("--max-samples", type=int, default=3, help="float32 samples per op (default 3)")
    p.add_argument("--only", default="", help="comma-separated op_db names (default: all)")
    p.add_argument("--skip-ops", action="store_true", help="leave out the op corpus")
    p.add_argument(
        "--no-small-group",
        action="store_true",
        help=f"op corpus: leave out the mode forced-g16 (codec_group={SMALL_GROUP})",
    )
    p.add_argument("--skip-models", action="store_true", help="leave out the models")
    p.add_argument(
        "--notes",
        type=Path,
        default=None,
        help="markdown file whose text becomes the report's Conclusions section (kept in the JSON)",
    )
    p.add_argument(
        "--from-json",
        type=Path,
        default=None,
        help="render the markdown from this earlier JSON (and --notes) without running anything",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help=f"smoke mode: ops {', '.join(QUICK_OPS[:3])}… only, 1 sample, 1-layer short models",
    )
    args = p.parse_args(argv)
    args.codecs = [c.strip() for c in args.codecs.split(",") if c.strip()]
    bad = [c for c in args.codecs if c not in CODECS]
    if bad:
        p.error(f"unknown codec(s) {', '.join(bad)}; known: {', '.join(CODECS)}")
    args.only = [o for o in args.only.split(",") if o]
    if args.quick:
        args.max_samples = 1
        args.only = args.only or list(QUICK_OPS)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    notes = args.notes.read_text() if args.notes else ""
    if args.from_json is not None:
        res = json.loads(args.from_json.read_text())
        if args.notes:  # kept in the JSON, so that rendering it again gives the same report
            res["notes"] = notes
            args.from_json.write_text(dump_json(res))
        path = args.out / f"{args.name}.md"
        path.write_text(markdown(res, res.get("notes", "")))
        log(f"wrote {path} from {args.from_json}")
        return 0
    start = time.monotonic()
    import transformers

    meta = {
        "command": " ".join(["python -m", __package__ or "scripts.codec_error", *sys.argv[1:]]),
        "date": datetime.date.today().isoformat(),
        "machine_tag": f"cpu-{os.cpu_count()}core",
        "machine": f"{platform.machine()} {platform.system()}, no GPU used",
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "codecs": args.codecs,
        "max_samples": args.max_samples,
        "quick": args.quick,
        "threads": torch.get_num_threads(),
        "code_sha256_start": code_hashes(),
    }
    res: dict[str, Any] = {"meta": meta, "notes": notes}
    res["probes"] = probes(args.codecs, args.quick)
    res["models"] = [] if args.skip_models else model_errors(args.codecs, args.quick)
    if args.skip_ops:
        res["ops"] = {
            "ops_considered": 0,
            "cases": [],
            "skipped_ops": {},
            "skipped_samples_by_reason": {},
            "forced_codec_ops": {},
            "seconds": 0.0,
        }
    else:
        res["ops"] = op_corpus(args.codecs, args.max_samples, args.only, not args.no_small_group)
    meta["seconds"] = time.monotonic() - start
    meta["code_sha256_end"] = code_hashes()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.name}.json").write_text(dump_json(res))
    (args.out / f"{args.name}.md").write_text(markdown(res, notes))
    log(f"wrote {args.out / args.name}.md and .json in {meta['seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
