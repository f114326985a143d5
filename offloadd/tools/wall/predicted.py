"""The wall's predictions: each point's peak as ``offloadd plan`` predicts it, without training
(tools/predict/), beside the measured one, and how far apart they are over the ok points."""

from __future__ import annotations

import sys
from typing import Any

from offloadd.config import Config
from offloadd.tools.predict.peak import UNPREDICTED, Prediction, predict_run, traced_as
from offloadd.tools.predict.trace import TraceSpec
from offloadd.tools.wall.points import WallSpec

__all__ = ["TARGET", "Predictor", "behind_a_slow_disk", "columns", "error_lines"]

TARGET = 0.15
"""The issue's bound on a prediction's error, as a share of the measured peak."""


class Predictor:
    """``predictor(strategy, batch, seq)``: the prediction, or None where the strategy is not
    predicted (said once per strategy), on a GPU (device memory is not), or where ``on`` is
    false."""

    def __init__(self, w: WallSpec, *, on: bool = True) -> None:
        self.on = on and w.device == "cpu"
        self.limit = w.limit
        self.held = w.allocator == "caching"  # every strategy on the host cache
        config = Config.from_env()
        self.spec = TraceSpec(
            model=w.model,
            layers=w.layers,
            hidden=w.hidden,
            heads=w.heads,
            vocab=w.vocab,
            hf_config=w.hf_config,
            dtype=w.dtype,
            steps=min(3, w.warmup + w.steps),
            min_bytes=config.min_bytes,  # as the points' Offloaders take them
            staging_bytes=config.staging_bytes,
        )
        self._said: set[str] = set()
        self._failed: set[str] = set()  # a trace or a measurement that failed is not retried

    def __call__(self, strategy: str, batch: int, seq: int) -> Prediction | None:
        if not self.on or strategy in self._failed:
            return None
        if strategy != "auto" and traced_as(strategy) is None:
            self._say(strategy, UNPREDICTED.get(strategy, "not traced"))
            return None
        try:
            run = predict_run(self.spec, strategy, batch, seq, limit=self.limit, held=self.held)
        except Exception as e:  # a model the trace cannot run: measured all the same
            self._failed.add(strategy)
            self._say(strategy, f"the prediction failed: {type(e).__name__}: {e}"[:400])
            return None
        return run

    def _say(self, strategy: str, why: str) -> None:
        if strategy not in self._said:
            self._said.add(strategy)
            print(f"offloadd wall: {strategy} has no prediction: {why}", file=sys.stderr)


def columns(p: Prediction | None) -> dict[str, int | None]:
    """A point's prediction columns in wall.csv: the peak, and where writes may be held behind a
    slow disk, the peak then (Note [writes behind a slow disk] in tools/predict/peak.py)."""
    if p is None:
        return {"predicted_peak_bytes": None, "predicted_slow_disk_peak_bytes": None}
    slow = p.slow_disk_peak_bytes if p.writes_bytes else None
    return {"predicted_peak_bytes": p.peak_bytes, "predicted_slow_disk_peak_bytes": slow}


def behind_a_slow_disk(r: dict[str, Any], share: float = TARGET) -> bool:
    """Whether point ``r`` measured above its predicted peak by more than ``share``, and not
    above its slow-disk peak by more than ``share``: writes held behind the disk."""
    slow = int(r.get("predicted_slow_disk_peak_bytes") or 0)  # a CSV's row: strings
    if not slow:
        return False
    peak, predicted = int(r["peak_bytes"]), int(r["predicted_peak_bytes"])
    return predicted * (1 + share) < peak <= slow * (1 + share)


def error_lines(rows: list[dict[str, Any]]) -> list[str]:
    """The predictions' error over the search's ok points (a later round runs what the first
    left cached, such as compiled kernels, which the prediction does not count on): the
    largest, each point past TARGET, and those above it within their slow-disk peak."""
    errs = [
        (r["predicted_peak_bytes"] / r["peak_bytes"] - 1, r)
        for r in rows
        if r["status"] == "ok"
        and r.get("predicted_peak_bytes")
        and r.get("peak_bytes")
        and not r.get("round")
    ]
    slow: list[tuple[float, dict[str, Any]]] = []
    missed: list[tuple[float, dict[str, Any]]] = []
    for e, r in errs:
        (slow if behind_a_slow_disk(r) else missed).append((e, r))
    errs, lines = missed, []
    if slow and not errs:
        lines.append(f"prediction: all {len(slow)} ok point(s) predicted within the slow-disk peak")
    if errs:
        worst = max(errs, key=lambda e: abs(e[0]))
        lines.append(
            f"prediction: within {abs(worst[0]):.1%} of the measured peak at all {len(errs)} ok "
            f"point(s) predicted (worst: {worst[1]['strategy']} at batch "
            f"{worst[1]['batch_size']}, seq {worst[1]['seq_len']})"
            + (f", {len(slow)} more within the slow-disk peak" if slow else "")
        )
    lines += [
        f"  {r['strategy']} batch {r['batch_size']} seq {r['seq_len']}: predicted {e:+.1%} off, "
        f"past the {TARGET:.0%} target"
        for e, r in errs
        if abs(e) > TARGET
    ]
    lines += [
        f"  {r['strategy']} batch {r['batch_size']} seq {r['seq_len']}: predicted {e:+.1%} off, "
        f"within the slow-disk peak ({r['predicted_slow_disk_peak_bytes'] / r['peak_bytes'] - 1:+.1%}): "
        "writes were held behind the disk"
        for e, r in slow
    ]
    return lines
