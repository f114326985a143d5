"""Figures with their spread: a throughput ratio and the range its timed steps allow.

A ratio of medians says nothing of how sure it is. Each measured point keeps its fastest and
slowest timed step (``step_time_min_s``, ``step_time_max_s``), so a ratio of two points'
throughputs has a range: the slowest of one against the fastest of the other, and the other way
round. Where that range holds a ratio of one, the run does not resolve which is faster, and the tools say
so beside the figure (``~``) and once below it. A point measured in several rounds is summed
up by ``aggregate``: its medians, and the fastest and slowest step of any round.
"""

from __future__ import annotations

import statistics
from typing import Any

__all__ = ["UNRESOLVED", "aggregate", "fmt_ratio", "quotient_range", "ratio_range", "unresolved"]

_MEDIAN_KEYS = (
    "step_time_s",
    "samples_per_s",
    "tokens_per_s",
    "model_tflops",
    "activation_peak_bytes",
    "peak_rss_above_base",
    "peak_device_above_base",
    "peak_live_above_base",
    "peak_resident_bytes",
    "io_wait_s",
    "steal_s",
)


def aggregate(rows: list[dict[str, Any]], key: str = "batch_size") -> list[dict[str, Any]]:
    """One row per (strategy, ``key``: the size that grew): medians over the rounds that ran
    (status ok), the fastest and slowest step of any round, the range of throughput over rounds
    (``samples_per_s_lo``/``_hi``) and ``rounds``/``ok_rounds``. A point none of whose rounds
    succeeded keeps its first round's status and error."""
    groups: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["strategy"], r[key]), []).append(r)
    out = []
    for group in groups.values():
        ok = [r for r in group if r["status"] == "ok"]
        agg = dict(ok[0] if ok else group[0])
        agg["rounds"], agg["ok_rounds"] = len(group), len(ok)
        if ok:
            for name in _MEDIAN_KEYS:
                values = [r[name] for r in ok if r.get(name) is not None]
                agg[name] = type(values[0])(statistics.median(values)) if values else None
            agg["step_time_min_s"] = min(r["step_time_min_s"] for r in ok)
            highs = [r["step_time_max_s"] for r in ok if r.get("step_time_max_s") is not None]
            agg["step_time_max_s"] = max(highs) if len(highs) == len(ok) else None
            thr = [r["samples_per_s"] for r in ok]
            agg["samples_per_s_lo"], agg["samples_per_s_hi"] = min(thr), max(thr)
        out.append(agg)
    return out


UNRESOLVED = (
    "~: the range the timed steps allow holds a ratio of one, wider than the difference: this run "
    "does not resolve it (more steps, or a quieter machine)"
)


def ratio_range(a: dict[str, Any], b: dict[str, Any]) -> tuple[float, float] | None:
    """``a``'s throughput over ``b``'s (samples a second) as their timed steps bound it, or None
    where a point lacks its fastest and slowest step."""
    try:
        a_lo, a_hi = a["step_time_min_s"], a["step_time_max_s"]
        b_lo, b_hi = b["step_time_min_s"], b["step_time_max_s"]
    except KeyError:
        return None
    if not (a_lo and a_hi and b_lo and b_hi):
        return None
    scale = a["batch_size"] / b["batch_size"]  # samples a step
    lo, hi = quotient_range((b_lo, b_hi), (a_lo, a_hi))
    return scale * lo, scale * hi


def quotient_range(a: tuple[float, float], b: tuple[float, float]) -> tuple[float, float]:
    """What ``a / b`` can be for ``a`` and ``b`` each in its (lowest, highest) range."""
    return a[0] / b[1], a[1] / b[0]


def unresolved(rng: tuple[float, float] | None) -> bool:
    return rng is not None and rng[0] <= 1.0 <= rng[1]


def fmt_ratio(
    ratio: float, rng: tuple[float, float] | None, *, unit: str = "x", mark: bool = True
) -> str:
    """The ratio and its range (``R.RRx (L.LL-H.HH)``), marked ``~`` where the range holds a
    ratio of one (``mark``: where the caller says so in words instead)."""
    if rng is None:
        return f"{ratio:.2f}{unit}"
    marked = "~" if mark and unresolved(rng) else ""
    return f"{ratio:.2f}{unit} ({rng[0]:.2f}-{rng[1]:.2f}){marked}"
