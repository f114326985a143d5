"""``offloadd demo``'s default: the memory wall, plain PyTorch and offloadd side by side under one
memory limit, in about a minute and a half on two cores.

Each run trains the built-in GPT for a warm-up and two timed steps in its own process inside a
memory cgroup of ``--memory-limit`` (wall/points.py), so an out-of-memory is the kernel's. Plain's
batch doubles until it runs out of memory; offloadd (tier ssd) then trains four times plain's
largest batch (twice, if that does not fit); plain runs that batch once more without the limit,
to say what it would have needed and to check that offloadd's losses and final weights are
bit-identical to it. Where no memory cgroup can be made (not root, no delegated cgroup v2), it
says so in one line and shows the measured peaks at two batch sizes without a limit and the
wall they predict, a straight line through them. The exit status is 1 if offloadd's bits differ.
"""

from __future__ import annotations

import argparse
import math
from typing import Any

from offloadd.runtime.stats import Stats
from offloadd.tools.harness.cgroup import CgroupUnavailable, memory_cgroup
from offloadd.tools.harness.spread import fmt_ratio, ratio_range, unresolved
from offloadd.tools.wall.points import WallSpec, measure
from offloadd.tools.wall.search import find_wall
from offloadd.units import format_bytes

__all__ = ["MOST", "wall_demo"]

MOST = 256
"""The largest batch plain is tried at."""

Row = dict[str, Any]


def wall_demo(ns: argparse.Namespace, limit: int) -> int:
    spec = WallSpec(
        model="mini-gpt",
        layers=ns.layers,
        hidden=ns.d_model,
        heads=ns.heads,
        seq=ns.seq,
        vocab=ns.vocab,
        batch=1,
        limit=limit,
        steps=ns.steps,
        warmup=ns.warmup,
        ssd_dir=ns.ssd_dir,
        point_timeout=None,
    )
    print(
        f"offloadd demo: the built-in GPT ({ns.layers} layers, d={ns.d_model}, seq {ns.seq}) "
        f"under a memory limit of {format_bytes(limit)}, plain PyTorch against offloadd "
        "(ssd offload); each run in its own process",
        flush=True,
    )
    try:
        with memory_cgroup(limit, prefix="offloadd-demo"):
            pass
    except CgroupUnavailable as e:
        print(f"offloadd demo: {e}; measuring peaks without a limit and predicting the wall")
        return _predicted(spec)
    plain_rows: dict[int, Row] = {}  # plain's, inside the limit, by batch

    def point(strategy: str, batch: int, limited: bool = True) -> Row:
        row = measure(spec, strategy, batch, spec.seq, limited=limited)
        print("  " + _line(row, limited), flush=True)
        return row

    def plain_status(batch: int) -> str:
        plain_rows[batch] = point("plain", batch)
        return str(plain_rows[batch]["status"])

    plain = find_wall(plain_status, 1, MOST, tolerance=MOST)
    if plain.largest is None:
        print(
            f"\nplain PyTorch cannot train batch 1 in {format_bytes(limit)}: raise --memory-limit"
        )
        return 0
    if plain.smallest_failed is None:
        print(
            f"\nplain PyTorch trains every batch up to {MOST} in {format_bytes(limit)}: lower "
            "--memory-limit to see the wall"
        )
        return 0
    n = plain.largest
    best = plain_rows[n]
    for m in (4 * n, 2 * n):
        ours = point("offload-ssd", m)
        if ours["status"] == "ok":
            break
    else:
        print(f"\noffloadd does not train batch {2 * n} in {format_bytes(limit)} either")
        return 0
    ref = point("plain", m, limited=False)
    same = ref["status"] == "ok" and (ours["losses"], ours["weights_sha256"]) == (
        ref["losses"],
        ref["weights_sha256"],
    )
    print()
    print(
        f"plain PyTorch stops at batch {plain.smallest_failed} (out of memory at "
        f"{format_bytes(limit)}); its largest, batch {n}, trains at {best['samples_per_s']:.2f} "
        f"samples/s (steps {best['step_time_min_s']:.2f}-{best['step_time_max_s']:.2f} s)."
    )
    print(
        f"offloadd trains batch {m} at {ours['samples_per_s']:.2f} samples/s (steps "
        f"{ours['step_time_min_s']:.2f}-{ours['step_time_max_s']:.2f} s), {m / n:.0f}x plain's "
        f"batch, peaking at {format_bytes(ours['peak_bytes'])} where plain needs "
        + (
            f"{format_bytes(ref['peak_bytes'])} (measured without the limit)."
            if ref["status"] == "ok"
            else "more."
        )
    )
    print(
        "losses and final weights bit-identical to plain PyTorch at batch "
        f"{m}: {'yes' if same else 'NO'} (sha256 {ours['weights_sha256'][:16]})"
    )
    if ref["status"] == "ok":
        print(_cost(ours, ref))
    if ours.get("stats"):
        print("ssd offload: " + Stats(**ours["stats"]).summary())
    print("The full comparison (plain, keep, recompute, ssd at one batch): offloadd demo --full")
    return 0 if same else 1


def _cost(ours: Row, ref: Row) -> str:
    """What offloading cost: its throughput against plain's at the same batch, and whether the
    timed steps' spread resolves the difference."""
    ratio = ours["samples_per_s"] / ref["samples_per_s"]
    rng = ratio_range(ours, ref)
    said = f"{abs(1 - ratio) * 100:.0f} % {'less' if ratio < 1 else 'more'}"
    return (
        f"What it cost: at batch {ours['batch_size']}, offloadd's throughput is "
        f"{fmt_ratio(ratio, rng, mark=False)} plain's without the limit ({said}; in brackets, "
        "the range the timed steps allow)"
        + (
            "; the timed steps' spreads overlap, so this run does not resolve the difference"
            if unresolved(rng)
            else ""
        )
        + "."
    )


def _line(r: Row, limited: bool) -> str:
    what = "ssd offload" if r["strategy"] == "offload-ssd" else "plain"
    head = f"{what}, batch {r['batch_size']}" + ("" if limited else ", no limit") + ": "
    if r["status"] != "ok":
        return head + ("out of memory" if r["status"] == "oom" else f"{r['status']} ({r['error']})")
    return head + (f"{r['samples_per_s']:.2f} samples/s, peak {format_bytes(r['peak_bytes'])}")


def _predicted(spec: WallSpec) -> int:
    """No cgroup: peaks at two batch sizes without a limit, and the wall a line through them
    predicts for each; offloadd's bits against plain's at the larger."""
    lo, hi = 2, 8
    got: dict[str, list[Row]] = {}
    for strategy in ("plain", "offload-ssd"):
        got[strategy] = []
        for batch in (lo, hi):
            row = measure(spec, strategy, batch, spec.seq, limited=False)
            print("  " + _line(row, False), flush=True)
            got[strategy].append(row)
    if any(r["status"] != "ok" for rs in got.values() for r in rs):
        print("offloadd demo: a run failed; no prediction")
        return 1
    print()
    for strategy, (a, b) in got.items():
        slope = (b["peak_bytes"] - a["peak_bytes"]) / (hi - lo)
        base = a["peak_bytes"] - lo * slope
        wall = math.floor((spec.limit - base) / slope) if slope > 0 else None
        name = "plain PyTorch" if strategy == "plain" else "offloadd (ssd offload)"
        print(
            f"{name}: peak {format_bytes(a['peak_bytes'])} at batch {lo}, "
            f"{format_bytes(b['peak_bytes'])} at batch {hi}: "
            f"{format_bytes(max(0, int(slope)))} a sample; predicted wall in "
            f"{format_bytes(spec.limit)}: "
            + (f"batch {wall}" if wall is not None else "none (its peak does not grow)")
            + f"; {b['samples_per_s']:.2f} samples/s at batch {hi}"
        )
    ref, ours = got["plain"][1], got["offload-ssd"][1]
    same = (ref["losses"], ref["weights_sha256"]) == (ours["losses"], ours["weights_sha256"])
    print(
        f"losses and final weights bit-identical to plain PyTorch at batch {hi}: "
        f"{'yes' if same else 'NO'} (sha256 {ours['weights_sha256'][:16]})"
    )
    return 0 if same else 1
