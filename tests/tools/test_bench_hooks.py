"""offloadd bench hooks --relay: relay's cost per swap from the host store and from ssd."""

from __future__ import annotations

import argparse
from pathlib import Path

from offloadd.tools.bench.hooks import format_report, micro_model
from offloadd.tools.bench.hooks_arms import relay_cost


def test_relay_cost_counts_swaps_not_reads(tmp_path: Path) -> None:
    ns = argparse.Namespace(width=64, blocks=4, batch=2, rounds=1, steps=1)
    r = relay_cost(ns, tmp_path, micro_model)
    assert r["groups"] == 4
    for store in ("host", "ssd"):
        a = r[store]
        assert a["swaps_per_step"] == 8  # each group in for forward and for backward
        assert a["reads_per_step"] == 6  # the last window (2) carried from forward, not read
        assert a["relay_ms"] > 0 and "us_per_swap" in a
    doc = {"model": "micro", "saved_per_step": 1, "device": "cpu", "arms": {}, "relay": r}
    report = format_report(doc)
    assert "relay (host store): 8.0 group swaps a step" in report
    assert "relay (ssd store)" in report
