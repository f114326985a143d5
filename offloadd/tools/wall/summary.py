"""What ``offloadd wall`` says at the end: each strategy's wall, and auto against the fastest
other strategy at each size both train.

A size measured again in rounds (``--rounds``) is summed up by those rounds, without the
search's point: the median of their throughputs, and the fastest and slowest timed step of any
of them as its spread. Rounds run the strategies in turn at each size, so a comparison there is
between points measured minutes apart, not the search's, which may be an hour apart on a
machine whose speed moves.
"""

from __future__ import annotations

import statistics
from typing import Any

from offloadd.tools.harness.spread import UNRESOLVED, fmt_ratio, ratio_range
from offloadd.tools.wall.search import Wall

__all__ = ["contested", "points", "summary"]

_SAID = {"oom": "out of memory", "infeasible": "no plan fits its budget"}


def points(rows: list[dict[str, Any]], key: str) -> dict[tuple[str, int], dict[str, Any]]:
    """Each (strategy, size) that trained, summed up over its rounds (see above); a point
    measured again counts its rounds' ``runs`` and the statuses of those that did not train
    (``failed``)."""
    runs: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for r in rows:
        runs.setdefault((r["strategy"], r[key]), []).append(r)
    out = {}
    for point, all_runs in runs.items():
        again = [r for r in all_runs if r.get("round")]
        measured = again or all_runs
        done = [r for r in measured if r["status"] == "ok"]
        if not done:
            continue
        if len(measured) == 1:
            out[point] = done[0]
            continue
        lows = [r["step_time_min_s"] for r in done if r.get("step_time_min_s")]
        highs = [r["step_time_max_s"] for r in done if r.get("step_time_max_s")]
        rate = statistics.median(r["samples_per_s"] for r in done)
        out[point] = {
            **done[-1],
            "samples_per_s": rate,
            "step_time_s": done[-1]["batch_size"] / rate,
            "step_time_min_s": min(lows) if len(lows) == len(done) else None,
            "step_time_max_s": max(highs) if len(highs) == len(done) else None,
            "runs": len(done),
            "failed": [r["status"] for r in measured if r["status"] != "ok"],
        }
    return out


def contested(rows: list[dict[str, Any]], key: str) -> dict[int, list[str]]:
    """The sizes auto and another strategy trained (where auto was not run: any two), with
    those strategies in the order they ran: the sizes ``summary`` compares."""
    by_size: dict[int, list[str]] = {}
    for s, size in points(rows, key):
        by_size.setdefault(size, []).append(s)
    with_auto = any(r["strategy"] == "auto" for r in rows)
    return {
        size: names
        for size, names in sorted(by_size.items())
        if len(names) > 1 and ("auto" in names or not with_auto)
    }


def summary(walls: dict[str, Wall], rows: list[dict[str, Any]], grow: str) -> list[str]:
    key = "batch_size" if grow == "batch" else "seq_len"
    ok = points(rows, key)
    lines = []
    for s, w in walls.items():
        if w.largest is None:
            lines.append(
                f"{s:>12}: trains no {grow} tried ({grow} {w.smallest_failed}: {w.failed_as})"
            )
            continue
        at = ok.get((s, w.largest))
        speed = f", {at['samples_per_s']:.2f} samples/s there" if at is not None else ""
        stop = (
            f"; {grow} {w.smallest_failed}: {_SAID.get(w.failed_as or '', w.failed_as)}"
            if w.smallest_failed is not None
            else " (the largest tried)"
        )
        lines.append(f"{s:>12}: largest {grow} {w.largest}{speed}{stop}")
    base = walls.get("plain")
    if base is not None and base.largest:
        for s, w in walls.items():
            if s != "plain" and w.largest:
                lines.append(f"{s} trains {w.largest / base.largest:.2f}x plain's largest {grow}")
    for (s, size), p in ok.items():
        if p.get("failed"):
            lines.append(
                f"{s} at {grow} {size}: {len(p['failed'])} of {p['runs'] + len(p['failed'])} "
                f"rounds did not train ({', '.join(p['failed'])}): its wall is not sharp there"
            )
    return lines + _auto_against_best(ok, grow)


def _auto_against_best(ok: dict[tuple[str, int], dict[str, Any]], grow: str) -> list[str]:
    """Where auto and another strategy both train a size: auto's throughput against the fastest
    other's there, with the range the timed steps allow (tools/harness/spread.py)."""
    lines = []
    for (s, size), a in sorted(ok.items(), key=lambda kv: kv[0][1]):
        others = [r for (t, n), r in ok.items() if n == size and t != s]
        if s != "auto" or not others:
            continue
        best = max(others, key=lambda r: r["samples_per_s"])
        ratio = a["samples_per_s"] / best["samples_per_s"]
        rounds = min(a.get("runs", 1), best.get("runs", 1))
        lines.append(
            f"auto at {grow} {size}: {fmt_ratio(ratio, ratio_range(a, best))} the throughput of "
            f"{best['strategy']}, the fastest of the {len(others)} other(s) that train it"
            + (f" (medians of {rounds} rounds)" if rounds > 1 else "")
        )
    if any("~" in line for line in lines):
        lines.append(UNRESOLVED)
    return lines
