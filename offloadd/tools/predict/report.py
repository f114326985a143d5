"""``offloadd plan`` without ``--budget``: each strategy's peak for a batch and sequence, and its
largest batch under a memory limit, predicted without training (peak.py), and the config it
recommends.

The largest batch: the peak grows about linearly with the batch, so two traces give a first
guess, and traces either side of it settle the wall (a handful per strategy, not a search of
every size).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from offloadd.tools.predict.peak import (
    Prediction,
    cap_budget,
    predict_run,
)
from offloadd.tools.predict.trace import TraceSpec
from offloadd.units import format_bytes

__all__ = [
    "MOST",
    "ON_REQUEST",
    "PREDICTED",
    "Row",
    "largest_batch",
    "predict_rows",
    "recommend",
    "render",
    "rows_json",
]

MOST = 1 << 16
"""The largest batch searched: a strategy that fits it is said to fit "MOST or more"."""

PREDICTED = ("plain", "recompute", "sac", "offload-ssd", "auto")
"""The strategies ``offloadd plan`` predicts by default (auto inside a limit only)."""

ON_REQUEST = ("compile-budget",)
"""Predicted when named: compile-budget traces through torch.compile (seconds a size) and
measures what the compiler holds by compiling the model for real and training it two steps at
batch 1 and the asked sequence (a minute or more, once a sequence; the model and its optimizer
state must fit in memory)."""


@dataclass(frozen=True, slots=True)
class Row:
    strategy: str
    at: Prediction  # at the asked batch
    largest: int | None  # the largest batch under the limit (None: no limit; 0: not even 1)


def largest_batch(peak_of: Callable[[int], int], limit: int, *, most: int = MOST) -> int:
    """The largest batch up to ``most`` whose ``peak_of(batch)`` is within ``limit`` (0: not even
    batch 1), for a peak that grows with the batch."""
    one = peak_of(1)
    if one > limit:
        return 0
    two = peak_of(2)
    if two > limit:
        return 1
    guess = max(2, min(most, 1 + (limit - one) // max(two - one, 1)))
    if peak_of(guess) <= limit:
        lo, hi = guess, guess + 1
        while hi <= most and peak_of(hi) <= limit:  # the peak grew slower than guessed
            lo, hi = hi, min(most + 1, 2 * hi)
    else:
        lo, hi = 2, guess
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if peak_of(mid) <= limit else (lo, mid)
    return min(lo, most)


def predict_rows(
    spec: TraceSpec, names: list[str], batch: int, seq: int, limit: int | None, *, held: bool
) -> list[Row]:
    """Each strategy's prediction at ``batch``, and its largest batch within ``limit``."""
    rows = []
    for name in names:
        print(f"offloadd plan: tracing {name}", file=sys.stderr, flush=True)
        at = predict_run(spec, name, batch, seq, limit=limit, held=held)

        def peak_of(b: int, name: str = name) -> int:
            # room for the writes a slow disk holds (Note [writes behind a slow disk])
            run = predict_run(spec, name, b, seq, limit=limit, held=held)
            return run.slow_disk_peak_bytes

        rows.append(Row(name, at, largest_batch(peak_of, limit) if limit else None))
    return rows


def recommend(rows: list[Row], batch: int, limit: int | None) -> tuple[str, str]:
    """One line of advice and the TOML config it names (empty where none is needed)."""
    by = {r.strategy: r for r in rows}
    plain, ssd = by.get("plain"), by.get("offload-ssd")
    if limit is None:
        return "no --memory-limit given: nothing to fit", ""
    if plain is not None and plain.at.peak_bytes <= limit:
        on = "offloadd's host cache" if plain.at.allocator == "caching" else "glibc's heap"
        return (
            f"plain fits batch {batch} in {format_bytes(limit)}, as predicted on {on}: no "
            "offloading needed (glibc's heap, plain PyTorch's allocator, may keep more than "
            "the live bytes: docs/rok-and-benchmarks.md)",
            "",
        )
    if ssd is None:
        return "offload-ssd was not predicted: no config to recommend", ""
    budget = cap_budget(ssd.at, limit)
    if ssd.at.peak_bytes > limit or budget < 1 << 20:
        return (
            f"batch {batch} does not fit in {format_bytes(limit)} even with every activation "
            f"offloaded; offload-ssd's largest batch is {ssd.largest}",
            "",
        )
    toml = f'[offload]\ntier = "ssd"\nbudget = "{budget >> 20}MiB"\n'
    return (
        f"offloadd fits batch {batch} in {format_bytes(limit)}: tier ssd with a budget of "
        f"{format_bytes(budget >> 20 << 20)} (the one offloadd wall gives auto there) keeps "
        "what fits and offloads the rest",
        toml,
    )


def render(rows: list[Row], batch: int, seq: int, limit: int | None) -> str:
    """The table: per strategy, the peak at ``batch`` and the largest batch under ``limit``."""
    head = f"{'strategy':<12} {'peak at batch ' + str(batch):>20}"
    head += f" {'largest batch in ' + format_bytes(limit):>28}" if limit is not None else ""
    lines = [head]
    for r in rows:
        line = f"{r.strategy:<12} {format_bytes(r.at.peak_bytes):>20}"
        if limit is not None:
            most = f"{MOST} or more" if r.largest == MOST else str(r.largest or "none")
            line += f" {most:>28}"
        lines.append(line)
    at = next((r.at for r in rows if not r.at.compiler_bytes), rows[0].at)
    compiled = [r for r in rows if r.at.compiler_bytes]
    lines.append(
        f"(seq {seq}; each peak counts {format_bytes(at.base_bytes)} of interpreter and libraries, "
        f"{format_bytes(at.weights_bytes)} of weights and {format_bytes(at.state_bytes)} of "
        f"gradients and optimizer state; on "
        + ("offloadd's host cache" if at.allocator == "caching" else "glibc's heap")
        + ")"
    )
    lines += [
        f"({r.strategy} also counts {format_bytes(r.at.compiler_bytes)} that torch.compile holds)"
        for r in compiled
    ]
    lines += [
        f"({r.strategy}: up to {format_bytes(r.at.writes_bytes)} more while the disk falls "
        "behind its writes (staging_bytes)"
        + (", room its largest batch leaves" if limit is not None else "")
        + ")"
        for r in rows
        if r.at.writes_bytes
    ]
    return "\n".join(lines)


def rows_json(rows: list[Row], spec: TraceSpec, batch: int, seq: int, limit: int | None) -> str:
    doc: dict[str, Any] = {
        "spec": asdict(spec),
        "batch": batch,
        "seq": seq,
        "limit_bytes": limit,
        "strategies": {
            r.strategy: {
                **asdict(r.at),
                "slow_disk_peak_bytes": r.at.slow_disk_peak_bytes,
                "largest_batch": r.largest,
            }
            for r in rows
        },
    }
    advice, toml = recommend(rows, batch, limit)
    doc["recommendation"] = {"advice": advice, "toml": toml}
    return json.dumps(doc, indent=2) + "\n"
