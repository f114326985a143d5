"""offloadd bench hooks: its arms and their floors; --relay: relay's cost per swap from the
host store and from ssd."""

from __future__ import annotations

import argparse
import gc
import json
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch

from offloadd.tools.bench.hooks import add_arguments, format_report, main, micro_model
from offloadd.tools.bench.hooks_arms import _detached, _same, relay_cost


def test_relay_cost_counts_swaps_not_reads(tmp_path: Path) -> None:
    ns = argparse.Namespace(width=64, blocks=4, batch=2, rounds=1, steps=1)
    r = relay_cost(ns, tmp_path, micro_model)
    assert r["groups"] == 4
    for store in ("host", "ssd"):
        a = r[store]
        assert a["swaps_per_step"] == 8  # each group in for forward and for backward
        assert a["reads_per_step"] == 6  # the last window (2) carried from forward, not read
        assert a["relay_ms"] > 0 and "us_per_swap" in a and "floor_us_per_swap" in a
    assert r["floor_ms"] > 0
    doc = {"model": "micro", "saved_per_step": 1, "device": "cpu", "arms": {}, "relay": r}
    report = format_report(doc)
    assert "relay (host store): 8.0 group swaps a step" in report
    assert "relay's hooks alone" in report
    assert "relay (ssd store)" in report


def test_arms_report_the_safe_floor(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    p = argparse.ArgumentParser()
    add_arguments(p)
    out = tmp_path / "hooks.json"
    args = ["--arms", "none,noop,safe,keep,ssd", "--blocks", "2", "--rounds", "1", "--steps", "1"]
    ns = p.parse_args([*args, "--dir", str(tmp_path), "--json", str(out)])
    assert main(ns) == 0
    doc = json.loads(out.read_text())
    assert set(doc["arms"]) == {"none", "noop", "safe", "keep", "ssd"}
    assert "x safe" in capsys.readouterr().out


@pytest.mark.parametrize(("arm", "leaks"), [(_same, True), (_detached, False)])
def test_safe_is_the_least_that_does_not_leak(arm: Any, leaks: bool) -> None:
    """Why ``safe`` and not ``noop`` is the floor: an op's output saved by that op and returned
    as it is holds its own graph, which a dropped graph never frees."""
    a = torch.randn(16, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(arm, _same):
        y = a.exp()  # exp saves its output
    ref = weakref.ref(y)
    del y
    gc.collect()
    assert (ref() is not None) is leaks
