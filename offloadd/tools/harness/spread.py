"""Figures with their spread: a throughput ratio and the range its timed steps allow.

A ratio of medians says nothing of how sure it is. Each measured point keeps its fastest and
slowest timed step (``step_time_min_s``, ``step_time_max_s``), so a ratio of two points'
throughputs has a range: the slowest of one against the fastest of the other, and the other way
round. Where that range holds a ratio of one, the run does not resolve which is faster, and the tools say
so beside the figure (``~``) and once below it.
"""

from __future__ import annotations

from typing import Any

__all__ = ["UNRESOLVED", "fmt_ratio", "quotient_range", "ratio_range", "unresolved"]

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
