#!/usr/bin/env python3
"""The full corpus sweep: every sample of op_db and module_db, with and without offloadd.

Runs the harness of the test suite (tests/_support/corpus.py: the comparison rule is in its docstring)
over every entry, dtype, sample and configuration, with a progress line on stderr, and writes
docs/corpus.md (counts per configuration and dtype, every failure, every skip grouped by its
reason) and the same as JSON next to it. Exits 1 if any case failed.

    python scripts/corpus_sweep.py                                   # the full sweep
    python scripts/corpus_sweep.py --only sin,nn.Linear --max-samples 2 --out /tmp/corpus.md
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import tempfile
import time
from collections import Counter, defaultdict
from dataclasses import asdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the harness lives in the test suite: tests/_support/corpus.py

import torch  # noqa: E402

from tests._support import corpus  # noqa: E402
from tests._support.daemon_proc import DaemonProc  # noqa: E402
from tests.conftest import _disk_root  # noqa: E402

REASONS_SHOWN = 12  # distinct failure reasons listed per entry in the markdown; the JSON has all


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--only", default="", help="comma-separated entry names (default: all)")
    p.add_argument(
        "--configs",
        default=",".join(str(c) for c in corpus.CONFIGS),
        help="comma-separated configurations (default: %(default)s)",
    )
    p.add_argument(
        "--dtypes",
        default=",".join(corpus.dtype_name(d) for d in corpus.DTYPES),
        help="comma-separated dtypes (default: %(default)s)",
    )
    p.add_argument("--max-samples", type=int, default=None, help="samples per entry and dtype")
    p.add_argument(
        "--shard", default="0/1", help="K/N: entries K, K+N, K+2N, ... only (default: %(default)s)"
    )
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "corpus.md")
    p.add_argument("--dir", type=Path, default=None, help="offload directory (on disk, not tmpfs)")
    args = p.parse_args(argv)
    by_name = {str(c): c for c in corpus.CONFIGS}
    dtypes = {corpus.dtype_name(d): d for d in corpus.DTYPES}
    entries = {e.name: e for e in corpus.entries()}
    try:
        args.configs = [by_name[c] for c in args.configs.split(",")]
        args.dtypes = tuple(dtypes[d] for d in args.dtypes.split(","))
        args.entries = (
            [entries[n] for n in args.only.split(",")] if args.only else list(entries.values())
        )
    except KeyError as e:
        p.error(f"unknown name {e}")
    k, _, n = args.shard.partition("/")
    if not (k.isdigit() and n.isdigit() and int(k) < int(n)):
        p.error(f"--shard {args.shard}: expected K/N with 0 <= K < N")
    args.entries = args.entries[int(k) :: int(n)]
    return args


def _clock(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


class Progress:
    """One status line on stderr: rewritten in place on a terminal, a line per entry otherwise."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.start = time.monotonic()
        self.counts: Counter[str] = Counter()
        self.tty = sys.stderr.isatty()

    def update(self, done: int, name: str, records: list[corpus.Record]) -> None:
        self.counts.update(r.status for r in records)
        elapsed = time.monotonic() - self.start
        eta = elapsed / done * (self.total - done)
        c = self.counts
        line = (
            f"[{done}/{self.total}] {name:<40.40} passed {c['passed']} failed {c['failed']} "
            f"skipped {c['skipped']}  {_clock(elapsed)} elapsed, ~{_clock(eta)} left"
        )
        print(
            ("\r" + line + "\x1b[K") if self.tty else line,
            end="" if self.tty else "\n",
            file=sys.stderr,
            flush=True,
        )

    def close(self) -> None:
        if self.tty:
            print(file=sys.stderr)


def sweep(args: argparse.Namespace, offload_dir: Path) -> list[corpus.Record]:
    daemon = None
    if any(c.daemon for c in args.configs):
        daemon = DaemonProc(
            Path(tempfile.mkdtemp(prefix="offloadd-corpus-daemon-", dir=offload_dir))
        ).start()
    pool = corpus.OffloaderPool(offload_dir, lambda: daemon.socket if daemon else "")
    progress = Progress(len(args.entries))
    records: list[corpus.Record] = []
    try:
        for done, entry in enumerate(args.entries, 1):
            got = corpus.sweep_entry(entry, pool, args.configs, args.dtypes, args.max_samples)
            records += got
            progress.update(done, entry.name, got)
    finally:
        progress.close()
        pool.close()
        if daemon is not None:
            daemon.stop()
    return records


def summarize(records: list[corpus.Record], args: argparse.Namespace, elapsed: float) -> dict:
    counts: dict[tuple[str, str], Counter[str]] = defaultdict(Counter)
    for r in records:
        counts[(r.config, r.dtype)][r.status] += 1
    names = [str(c) for c in args.configs] + [corpus.dtype_name(d) for d in args.dtypes] + ["none"]
    rank = {name: i for i, name in enumerate(names)}  # rows in the order of the arguments
    summary = [
        {"config": c, "dtype": d, **{s: counts[(c, d)][s] for s in ("passed", "failed", "skipped")}}
        for c, d in sorted(counts, key=lambda cd: (rank[cd[0]], rank[cd[1]]))
    ]
    command = "python scripts/corpus_sweep.py" + "".join(f" {a}" for a in sys.argv[1:])
    return {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": command,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "elapsed_s": round(elapsed, 1),
        "entries": {
            "ops": sum(e.kind == "op" for e in args.entries),
            "inplace_ops": sum(e.kind == "inplace" for e in args.entries),
            "modules": sum(e.kind == "module" for e in args.entries),
            "in_corpora": len(corpus.entries()),
        },
        "configs": [str(c) for c in args.configs],
        "dtypes": [corpus.dtype_name(d) for d in args.dtypes],
        "max_samples": args.max_samples,
        "totals": {s: sum(row[s] for row in summary) for s in ("passed", "failed", "skipped")},
        "summary": summary,
        "failed": [asdict(r) for r in records if r.status == "failed"],
        "skipped": [asdict(r) for r in records if r.status == "skipped"],
    }


def _ranges(numbers: list[int]) -> str:
    """``0-3, 7`` for [0, 1, 2, 3, 7]."""
    spans: list[list[int]] = []
    for n in sorted(set(numbers)):
        if spans and n == spans[-1][1] + 1:
            spans[-1][1] = n
        else:
            spans.append([n, n])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)


def _where(records: list[dict], num_configs: int) -> str:
    """Which cases ``records`` are, compactly: count, dtypes, configurations, sample indices."""
    dtypes = ", ".join(dict.fromkeys(r["dtype"] for r in records))
    configs = list(dict.fromkeys(r["config"] for r in records))
    where = "every configuration" if len(configs) == num_configs else ", ".join(configs)
    samples = sorted({r["sample"] for r in records if r["sample"] >= 0})
    which = f"; sample{'s' if len(samples) > 1 else ''} {_ranges(samples)}" if samples else ""
    n = len(records)
    return f"{n} case{'s' if n > 1 else ''} ({dtypes}; {where}{which})"


def markdown(doc: dict) -> str:
    full = doc["max_samples"] is None and len(doc["configs"]) == len(corpus.CONFIGS)
    full = full and len(doc["dtypes"]) == len(corpus.DTYPES)
    e = doc["entries"]
    full = full and e["ops"] + e["inplace_ops"] + e["modules"] == e["in_corpora"]
    t = doc["totals"]
    num_configs = len(doc["configs"])
    lines = [
        "# Corpus sweep: op_db and module_db with and without offloadd",
        "",
        "Every op of PyTorch's `op_db` that supports backward (and its in-place variant, as `op_`,",
        "where it has one with autograd) and every module of its `module_db`,",
        "run on their own sample inputs without offloadd and inside an Offloader with",
        "`min_bytes=0`; forward outputs and gradients (inputs and parameters) must be",
        "bit-identical (NaN equals NaN). The rule, skips included, is the docstring of",
        "[tests/_support/corpus.py](../tests/_support/corpus.py). The default test run checks a fixed subset",
        "(tests/properties/test_corpus.py); the full sweep is `python -m pytest -m slow tests/properties/test_corpus.py`",
        "or, with this record, the command below. Relay's saved-tensor pair, with no hooks below",
        "it, runs over the same corpora in tests/relay/test_relay_pass_corpus.py (every sample: its",
        "`slow` test).",
        "",
        "```sh",
        "python scripts/corpus_sweep.py               # the full sweep: docs/corpus.md and .json",
        "python scripts/corpus_sweep.py --shard 1/4   # entries 1, 5, 9, ...: a spread quarter",
        "python scripts/corpus_sweep.py --only sin,nn.Linear --configs ssd-dedup \\",
        "    --dtypes float64 --out /tmp/corpus.md    # a few entries, one configuration",
        "```",
        "",
        f"## Last run{'' if full else ' (partial)'}",
        "",
        f"- command: `{doc['command']}`",
        f"- date: {doc['date']}; torch {doc['torch']}, Python {doc['python']}, {doc['machine']}",
        f"- entries: {e['ops']} ops, {e['inplace_ops']} in-place variants, {e['modules']} modules "
        f"(of {e['in_corpora']}); "
        f"configurations: {', '.join(doc['configs'])}; dtypes: {', '.join(doc['dtypes'])}; "
        f"samples per entry and dtype: {doc['max_samples'] or 'all'}",
        f"- elapsed: {_clock(doc['elapsed_s'])}",
        f"- **{t['passed']} passed, {t['failed']} failed, {t['skipped']} skipped**",
        "",
        "| configuration | dtype | passed | failed | skipped |",
        "|---|---|---:|---:|---:|",
    ]
    lines += [
        f"| {r['config']} | {r['dtype']} | {r['passed']} | {r['failed']} | {r['skipped']} |"
        for r in doc["summary"]
    ]
    lines += ["", "## Failures", ""]
    by_entry: dict[str, dict[str, list[dict]]] = defaultdict(lambda: defaultdict(list))
    for r in doc["failed"]:
        by_entry[r["entry"]][r["reason"]].append(r)
    if not by_entry:
        lines += ["None.", ""]
    for name, per_reason in by_entry.items():
        total = sum(map(len, per_reason.values()))
        kind = next(iter(per_reason.values()))[0]["kind"]
        lines += [f"### `{name}` ({kind}): {total} failing cases", ""]
        groups = list(per_reason.items())
        lines += [f"- {_where(recs, num_configs)}: {why}" for why, recs in groups[:REASONS_SHOWN]]
        if len(groups) > REASONS_SHOWN:
            lines.append(f"- … {len(groups) - REASONS_SHOWN} more reasons in corpus.json")
        lines.append("")
    lines += ["## Skips, by reason", ""]
    by_reason: dict[str, dict[str, list[dict]]] = defaultdict(lambda: defaultdict(list))
    for r in doc["skipped"]:
        by_reason[r["reason"]][r["entry"]].append(r)
    if not by_reason:
        lines += ["None.", ""]
    for reason, per_entry in sorted(
        by_reason.items(), key=lambda kv: -sum(map(len, kv[1].values()))
    ):
        total = sum(map(len, per_entry.values()))
        lines += [f"### {reason} ({total} cases)", ""]
        lines += [
            f"- `{name}`: {_where(recs, len(doc['configs']))}" for name, recs in per_entry.items()
        ]
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    offload_dir = Path(tempfile.mkdtemp(prefix="offloadd-corpus-", dir=args.dir or _disk_root()))
    start = time.monotonic()
    try:
        records = sweep(args, offload_dir)
    finally:
        for p in sorted(offload_dir.rglob("*"), reverse=True):
            p.rmdir() if p.is_dir() else p.unlink()
        offload_dir.rmdir()
    doc = summarize(records, args, time.monotonic() - start)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(markdown(doc))
    args.out.with_suffix(".json").write_text(json.dumps(doc, indent=1) + "\n")
    t = doc["totals"]
    print(f"{t['passed']} passed, {t['failed']} failed, {t['skipped']} skipped; wrote {args.out}")
    return 1 if t["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
