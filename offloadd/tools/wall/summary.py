"""What ``offloadd wall`` says at the end: each strategy's wall, and auto against the fastest
other strategy at each size both train.

A size measured again in rounds (``--rounds``) is summed up by those rounds, without the
search's point: the median of their throughputs, and the fastest and slowest timed step of any
of them as its spread. Rounds run the strategies in turn at each size, so a comparison there is
between points measured minutes apart, not the search's, which may be an hour apart on a
machine whose speed moves.
"""

from __future__ import annotations

from typing import Any

from offloadd.tools.harness.spread import UNRESOLVED, aggregate, fmt_ratio, ratio_range
from offloadd.tools.wall.search import Wall

__all__ = ["contested", "points", "summary"]

_SAID = {"oom": "out of memory", "infeasible": "no plan fits its budget"}


def _measured(rows: list[dict[str, Any]], key: str) -> list[dict[str, Any]]:
    """Each point's rows: its later rounds where it was measured again, else the search's."""
    again = {(r["strategy"], r[key]) for r in rows if r.get("round")}
    return [r for r in rows if r.get("round") or (r["strategy"], r[key]) not in again]


def points(rows: list[dict[str, Any]], key: str) -> dict[tuple[str, int], dict[str, Any]]:
    """Each (strategy, size) that trained, summed up over its rounds (see above; ``aggregate``
    in tools/harness/spread.py)."""
    return {
        (r["strategy"], r[key]): r
        for r in aggregate(_measured(rows, key), key)
        if r["status"] == "ok"
    }


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
        if p["ok_rounds"] < p["rounds"]:
            failed = [
                r["status"]
                for r in _measured(rows, key)
                if (r["strategy"], r[key]) == (s, size) and r["status"] != "ok"
            ]
            lines.append(
                f"{s} at {grow} {size}: {len(failed)} of {p['rounds']} rounds did not train "
                f"({', '.join(failed)}): its wall is not sharp there"
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
        rounds = min(a["ok_rounds"], best["ok_rounds"])
        lines.append(
            f"auto at {grow} {size}: {fmt_ratio(ratio, ratio_range(a, best))} the throughput of "
            f"{best['strategy']}, the fastest of the {len(others)} other(s) that train it"
            + (f" (medians of {rounds} rounds)" if rounds > 1 else "")
        )
    if any("~" in line for line in lines):
        lines.append(UNRESOLVED)
    return lines
