"""``offloadd plan`` without ``--budget``: each strategy's peak for a batch and sequence, and its
largest batch under a memory limit, predicted without training (peak.py), and the config it
recommends.

The largest batch: the peak grows about linearly with the batch, so two traces give a first
guess, and traces either side of it settle the wall (a handful per strategy, not a search of
every size).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any

from offloadd.runtime.host_allocator import SLACK
from offloadd.tools.predict.peak import Prediction, predict
from offloadd.tools.predict.trace import TraceSpec
from offloadd.units import format_bytes

__all__ = ["PREDICTED", "Row", "largest_batch", "recommend", "render", "rows_json"]

PREDICTED = ("plain", "recompute", "sac", "offload-ssd", "auto")
"""The strategies ``offloadd plan`` predicts by default (auto inside a limit only)."""


@dataclass(frozen=True, slots=True)
class Row:
    strategy: str
    at: Prediction  # at the asked batch
    largest: int | None  # the largest batch under the limit (None: no limit, or not even 1)


def largest_batch(
    spec: TraceSpec, strategy: str, seq: int, limit: int, *, allocator: str, most: int = 1 << 16
) -> int:
    """The largest batch whose predicted peak is within ``limit`` (0: not even batch 1)."""

    def fits(batch: int) -> bool:
        return predict(spec, strategy, batch, seq, allocator=allocator).peak_bytes <= limit

    one = predict(spec, strategy, 1, seq, allocator=allocator).peak_bytes
    if one > limit:
        return 0
    two = predict(spec, strategy, 2, seq, allocator=allocator).peak_bytes
    if two > limit:
        return 1
    slope = max(two - one, 1)
    guess = max(2, min(most, 1 + (limit - one) // slope))
    if fits(guess):
        lo, hi = guess, guess + 1
        while hi <= most and fits(hi):  # the peak grew slower than the guess assumed
            lo, hi = hi, min(most + 1, 2 * hi)
    else:
        lo, hi = 2, guess
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return min(lo, most)


def recommend(rows: list[Row], batch: int, limit: int | None) -> tuple[str, str]:
    """One line of advice and the TOML config it names (empty where none is needed)."""
    by = {r.strategy: r for r in rows}
    plain, ssd = by.get("plain"), by.get("offload-ssd")
    if limit is None:
        return "no --memory-limit given: nothing to fit", ""
    if plain is not None and plain.at.peak_bytes <= limit:
        return (
            f"plain PyTorch fits batch {batch} in {format_bytes(limit)}: no offloading needed",
            "",
        )
    if ssd is None:
        return "offload-ssd was not predicted: no config to recommend", ""
    if ssd.at.peak_bytes > limit:
        return (
            f"batch {batch} does not fit in {format_bytes(limit)} even with every activation "
            f"offloaded; offload-ssd's largest batch is {ssd.largest}",
            "",
        )
    # auto's budget under a cap, as offloadd wall gives it: a share of what the model and its
    # state leave, since the host cache may keep up to (1 + SLACK) x the live bytes
    held = ssd.at.base_bytes + ssd.at.weights_bytes + ssd.at.state_bytes
    budget = int((limit - held) / (1 + SLACK))
    toml = f'[offload]\ntier = "ssd"\nbudget = "{budget >> 20}MiB"\n'
    return (
        f"offloadd fits batch {batch} in {format_bytes(limit)}: tier ssd with a budget of "
        f"{format_bytes(budget >> 20 << 20)} keeps what fits and offloads the rest",
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
            line += f" {r.largest if r.largest else 'none':>28}"
        lines.append(line)
    at = rows[0].at
    lines.append(
        f"(seq {seq}; each peak counts {format_bytes(at.base_bytes)} of interpreter and libraries, "
        f"{format_bytes(at.weights_bytes)} of weights and {format_bytes(at.state_bytes)} of "
        f"gradients and optimizer state; on "
        + ("offloadd's host cache" if at.allocator == "caching" else "glibc's heap")
        + ")"
    )
    return "\n".join(lines)


def rows_json(rows: list[Row], spec: TraceSpec, batch: int, seq: int, limit: int | None) -> str:
    doc: dict[str, Any] = {
        "spec": asdict(spec),
        "batch": batch,
        "seq": seq,
        "limit_bytes": limit,
        "strategies": {r.strategy: {**asdict(r.at), "largest_batch": r.largest} for r in rows},
    }
    advice, toml = recommend(rows, batch, limit)
    doc["recommendation"] = {"advice": advice, "toml": toml}
    return json.dumps(doc, indent=2) + "\n"
