"""What a ROK sweep says: offload against recompute and keep, at equal batch and equal memory.

Works on the typed point rows of ``offloadd rok`` (see ``offloadd.tools.rok.points.FIELDS``).
"""

from __future__ import annotations

import itertools
import math
import random
import statistics
from typing import Any

from offloadd.tools.harness.spread import UNRESOLVED, aggregate, fmt_ratio, ratio_range

__all__ = [
    "OFFLOAD",
    "POOL_MIN",
    "SINGLE",
    "aggregate",
    "auto_rounds",
    "compare",
    "compare_auto",
    "interpolate",
    "pooled",
    "summary_lines",
]

OFFLOAD = ("offload-ssd", "offload-cpu")
SINGLE = ("keep", "recompute", *OFFLOAD)
"""The single strategies an auto point is judged against."""

Row = dict[str, Any]


def _ok(rows: list[Row], strategy: str) -> dict[int, Row]:
    return {r["batch_size"]: r for r in rows if r["strategy"] == strategy and r["status"] == "ok"}


def interpolate(points: list[tuple[float, float]], x: float) -> float | None:
    """Piecewise-linear y at ``x`` through ``points`` sorted by x; None outside their range."""
    pts = sorted(points)
    if not pts or x < pts[0][0] or x > pts[-1][0]:
        return None
    for (x0, y0), (x1, y1) in itertools.pairwise(pts):
        if x0 <= x <= x1:
            return y0 if x1 == x0 else y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return pts[0][1]  # a single point, equal to x


def compare(rows: list[Row], offload: str) -> list[Row]:
    """Per batch size: ``offload``'s memory and throughput as ratios of keep's and recompute's,
    recompute's throughput interpolated at offload's memory, and the same throughput ratios
    from the fastest step of each point (``fastest_vs_*``), which other load on a shared
    machine disturbs less than the median."""
    keep, rec, off = _ok(rows, "keep"), _ok(rows, "recompute"), _ok(rows, offload)
    rec_curve = [(r["activation_peak_bytes"], r["samples_per_s"]) for r in rec.values()]
    out = []
    for b in sorted(off):
        o = off[b]
        c: Row = {"batch_size": b, "strategy": offload}
        if b in keep:
            k = keep[b]
            c["mem_vs_keep"] = o["activation_peak_bytes"] / max(1, k["activation_peak_bytes"])
            c["thr_vs_keep"] = o["samples_per_s"] / k["samples_per_s"]
            c["thr_vs_keep_range"] = ratio_range(o, k)
            c["keep_target"] = c["thr_vs_keep"] >= 0.95 and c["mem_vs_keep"] <= 0.5
            if o.get("step_time_min_s") and k.get("step_time_min_s"):
                c["fastest_vs_keep"] = k["step_time_min_s"] / o["step_time_min_s"]
            if o.get("steal_s") is not None and k.get("steal_s") is not None:
                # on a VM, I/O the host serves with the CPUs training runs on (see train._stolen_s)
                c["extra_s"] = o["step_time_s"] - k["step_time_s"]
                c["extra_steal_s"] = o["steal_s"] - k["steal_s"]
        if b in rec:
            r = rec[b]
            c["mem_vs_recompute"] = o["activation_peak_bytes"] / max(1, r["activation_peak_bytes"])
            c["thr_vs_recompute"] = o["samples_per_s"] / r["samples_per_s"]
            c["thr_vs_recompute_range"] = ratio_range(o, r)
            c["dominates_recompute"] = c["mem_vs_recompute"] <= 1.10 and c["thr_vs_recompute"] > 1
            if o.get("step_time_min_s") and r.get("step_time_min_s"):
                c["fastest_vs_recompute"] = r["step_time_min_s"] / o["step_time_min_s"]
        at_mem = interpolate(rec_curve, o["activation_peak_bytes"])
        if at_mem is not None:
            c["thr_vs_recompute_at_equal_memory"] = o["samples_per_s"] / at_mem
        out.append(c)
    return out


_VERDICTS = (
    (
        "dominates_recompute",
        "dominates recompute (memory <= 1.10x and higher throughput at equal batch)",
    ),
    ("keep_target", ">= 0.95x keep's throughput at <= 0.5x keep's memory"),
)
"""The yes/no columns of ``compare`` that the summary counts, and how it words them."""


def _fmt(c: Row, key: str) -> str:
    """A ratio of ``c``, with the range its timed steps allow where ``c`` has one."""
    return fmt_ratio(c[key], c.get(f"{key}_range")) if key in c else "-"


def compare_auto(rows: list[Row]) -> list[Row]:
    """Per auto point: the fastest single strategy at the same batch size whose measured
    activation peak fits the auto point's budget, and auto's throughput against it (target
    >= 0.98), and against keep's (at a budget of recompute's peak, target >= 0.95)."""
    out = []
    for a in rows:
        if not a["strategy"].startswith("auto@") or a["status"] != "ok":
            continue
        b, budget = a["batch_size"], a.get("budget_bytes")
        c: Row = {"strategy": a["strategy"], "batch_size": b, "budget_bytes": budget}
        c["plan"] = a.get("plan")
        if budget is not None:
            c["mem_vs_budget"] = a["activation_peak_bytes"] / max(1, budget)
        fits = [
            r
            for r in rows
            if r["strategy"] in SINGLE
            and r["batch_size"] == b
            and r["status"] == "ok"
            and budget is not None
            and r["activation_peak_bytes"] <= budget
        ]
        if fits:
            best = max(fits, key=lambda r: r["samples_per_s"])
            c["best_single"] = best["strategy"]
            c["thr_vs_best_single"] = a["samples_per_s"] / best["samples_per_s"]
            c["thr_vs_best_single_range"] = ratio_range(a, best)
            c["auto_target"] = c["thr_vs_best_single"] >= 0.98
        keep = _ok(rows, "keep").get(b)
        if keep is not None:
            c["thr_vs_keep"] = a["samples_per_s"] / keep["samples_per_s"]
            c["thr_vs_keep_range"] = ratio_range(a, keep)
            c["mem_vs_keep"] = a["activation_peak_bytes"] / max(1, keep["activation_peak_bytes"])
            if a["strategy"] == "auto@recompute":
                c["tba_target"] = c["thr_vs_keep"] >= 0.95
        out.append(c)
    return out


def auto_rounds(rounds: list[Row]) -> list[Row]:
    """Per auto point and round: auto's throughput over the same round's throughput of the single
    strategy ``compare_auto`` judges it against (picked from the medians over rounds). The two
    ran minutes apart in one round, so the ratio leaves out most of the drift between rounds."""
    best = {
        (c["strategy"], c["batch_size"]): c["best_single"]
        for c in compare_auto(aggregate(rounds))
        if "best_single" in c
    }
    ok = {(r["strategy"], r["batch_size"], r["round"]): r for r in rounds if r["status"] == "ok"}
    out = []
    for (strategy, b, n), r in sorted(ok.items()):
        single = best.get((strategy, b))
        ref = ok.get((single, b, n)) if single else None
        if ref is not None:
            ratio = r["samples_per_s"] / ref["samples_per_s"]
            out.append({"strategy": strategy, "batch_size": b, "round": n, "ratio": ratio})
    return out


def pooled(
    ratios: list[float], resamples: int = 10_000, seed: int = 0
) -> tuple[float, float, float]:
    """The geometric mean of ``ratios`` and a 95 % percentile-bootstrap interval of it (seeded,
    so a report is reproducible). Needs at least two ratios."""
    if len(ratios) < 2:
        raise ValueError(f"pooled: needs at least two ratios, got {len(ratios)}")
    logs = [math.log(x) for x in ratios]
    rng = random.Random(seed)
    means = sorted(statistics.fmean(rng.choices(logs, k=len(logs))) for _ in range(resamples))
    lo, hi = means[int(0.025 * resamples)], means[int(0.975 * resamples) - 1]
    return math.exp(statistics.fmean(logs)), math.exp(lo), math.exp(hi)


POOL_MIN = 10
"""Point-rounds below which the summary gives no bootstrap interval (it would be their range)."""


def _pooled_lines(rounds: list[Row]) -> list[str]:
    per = auto_rounds(rounds)
    if len(per) < POOL_MIN:
        return []
    mean, lo, hi = pooled([p["ratio"] for p in per])
    return [
        f"  per round, against that round's run of the same single strategy: {len(per)} "
        f"point-rounds, geometric mean {mean:.3f}x, 95 % bootstrap interval {lo:.3f}-{hi:.3f}x, "
        f"lowest {min(p['ratio'] for p in per):.2f}x"
    ]


def _auto_lines(rows: list[Row]) -> list[str]:
    comps = compare_auto(rows)
    if not comps:
        return []
    lines = [
        "auto, per budget (on the memory axis) and batch size: memory used / budget, plan "
        "(keep/offload/recompute blocks) | throughput vs the fastest single strategy whose "
        "memory fits the budget | vs keep"
    ]
    for c in comps:
        best = (
            f"{c['thr_vs_best_single']:.2f}x {c['best_single']}"
            if "best_single" in c
            else "- (no single strategy fits)"
        )
        budget = c["budget_bytes"]
        lines.append(
            f"  {c['strategy']} batch {c['batch_size']:>4} (budget "
            f"{budget / 2**20:.0f} MiB, used {_fmt(c, 'mem_vs_budget')}, plan {c['plan']}): "
            f"{best} | {_fmt(c, 'thr_vs_keep')}"
            if budget is not None
            else f"  {c['strategy']} batch {c['batch_size']:>4}: no plan"
        )
    for key, verdict in (
        ("auto_target", ">= 0.98x the fastest single strategy within its budget"),
        ("tba_target", ">= 0.95x keep's throughput at recompute's memory as budget"),
    ):
        judged = [c for c in comps if key in c]
        if judged:
            yes = [f"{c['strategy']}/b{c['batch_size']}" for c in judged if c[key]]
            lines.append(f"  {verdict}: {len(yes)}/{len(judged)} {yes}")
    return lines


def summary_lines(rows: list[Row], rounds: list[Row] | None = None) -> list[str]:
    """A short text summary of the sweep (``rows``: ``aggregate``'s points), one line per offload
    point plus target verdicts; with ``rounds`` (the rows of every round), auto's per-round
    ratios pooled over its points."""
    lines = []
    for r in rows:
        if r["status"] != "ok":
            lines.append(f"{r['strategy']} batch {r['batch_size']}: {r['status']} ({r['error']})")
    for offload in OFFLOAD:
        comps = compare(rows, offload)
        if not comps:
            continue
        lines.append(
            f"{offload}, per batch size: memory and throughput vs keep | vs recompute | "
            "throughput vs recompute at equal memory | fastest-step throughput vs keep, recompute"
        )
        for c in comps:
            lines.append(
                f"  batch {c['batch_size']:>4}: mem {_fmt(c, 'mem_vs_keep')}, "
                f"thr {_fmt(c, 'thr_vs_keep')} | mem {_fmt(c, 'mem_vs_recompute')}, "
                f"thr {_fmt(c, 'thr_vs_recompute')} | {_fmt(c, 'thr_vs_recompute_at_equal_memory')}"
                f" | {_fmt(c, 'fastest_vs_keep')}, {_fmt(c, 'fastest_vs_recompute')}"
            )
        for key, verdict in _VERDICTS:
            judged = [c for c in comps if key in c]
            if judged:
                yes = [c["batch_size"] for c in judged if c[key]]
                lines.append(f"  {verdict}: {len(yes)}/{len(judged)} batch sizes {yes}")
        stolen = [c for c in comps if "extra_steal_s" in c]
        if stolen:
            lines.append(
                "  step time over keep's, and CPU time the hypervisor took per step beyond keep's "
                "(steal): "
                + ", ".join(
                    f"batch {c['batch_size']} {c['extra_s'] * 1e3:+.0f} ms, "
                    f"{c['extra_steal_s'] * 1e3:+.0f} ms"
                    for c in stolen
                )
            )
    lines += _auto_lines(rows) + _pooled_lines(rounds or [])
    if any("~" in line for line in lines):
        lines.append(UNRESOLVED)
    return lines
