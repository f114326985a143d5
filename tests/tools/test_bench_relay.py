"""``offloadd bench relay``: a ``--quick`` run end to end on a real ext4 directory (figures are
never asserted, only their presence, and relay's exactness), its ratios on made-up runs, its
option errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from offloadd.tools.bench import relay as bench_relay
from tests._support.cli import offloadd_cli

pytest.importorskip("transformers")

ENGINE_PARAMS = ("default",)  # the benchmark runs the default engine (auto)

RUN_KEYS = {
    "layers",
    "relay",
    "frozen_bytes",
    "peak_rss_above_base",
    "step_time_s",
    "step_times_s",
    "losses",
    "trainable_sha256",
    "peak_resident_bytes",
}
RELAY_KEYS = {"relay_stats", "read_bytes_per_step", "wait_s_per_step"}


def _bench(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "offloadd", "bench", "relay", *args],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


@pytest.mark.slow  # three training processes, ~45 s of two cores: the default run keeps to 8 min
def test_bench_relay_quick_end_to_end(disk_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "relay.json"
    proc = _bench("--quick", "--ssd-dir", str(disk_dir), "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(out.read_text())
    assert set(doc) >= {"command", "machine", "sizes", "ratios", "exact", "runs"}
    assert doc["sizes"]["layers"] == 4 and doc["sizes"]["rounds"] == 1
    assert list(doc["runs"]) == ["plain", "relay", "relay-shallow"]  # plain-shallow: opt-in
    for label, runs in doc["runs"].items():
        (run,) = runs  # one round
        relayed = bench_relay.CONFIGS[label][0]
        assert run["relay"] is relayed
        assert run.keys() >= RUN_KEYS | (RELAY_KEYS if relayed else set())
        assert len(run["step_times_s"]) == 2 and len(run["losses"]) == 3
        assert run["frozen_bytes"] > 0 and run["peak_rss_above_base"] > 0
    relayed_run = doc["runs"]["relay"][0]
    stats = relayed_run["relay_stats"]
    assert stats["relayed_bytes"] == relayed_run["frozen_bytes"]
    assert stats["read_bytes"] > 0 and stats["groups"] == 4
    # exact: the same losses and trained weights with and without relay
    assert doc["exact"] == {"plain vs relay": {"losses_identical": True, "weights_identical": True}}
    assert doc["runs"]["plain"][0]["losses"] == relayed_run["losses"]
    for label, *_ in bench_relay.RATIOS:
        r = doc["ratios"][label]
        assert set(r) == {"per_round", "median", "min", "max", "target", "met"}
        assert len(r["per_round"]) == 1 and r["median"] == r["per_round"][0]
        assert f"| {label} |" in proc.stdout
    assert "plain vs relay: losses bit-identical: yes" in proc.stdout


def _run(layers: int, relay: bool, rss: int, resident: int, step: float) -> dict[str, Any]:
    return {
        "layers": layers,
        "relay": relay,
        "frozen_bytes": 100 * layers,
        "peak_rss_above_base": rss,
        "peak_resident_bytes": resident,
        "step_time_s": step,
        "losses": [1.0, 0.5],
        "trainable_sha256": "ab",
    }


def test_ratios_and_exactness_on_made_up_runs() -> None:
    runs = {
        "plain": [_run(32, False, 4000, 3200, 1.0), _run(32, False, 4100, 3200, 2.0)],
        "relay": [_run(32, True, 1000, 220, 1.1), _run(32, True, 1500, 230, 2.5)],
        "relay-shallow": [_run(8, True, 900, 200, 0.3), _run(8, True, 900, 0, 0.3)],
    }
    r = bench_relay.ratios(runs)
    saved = r["peak RSS saved by relay / frozen weight bytes"]
    assert saved["per_round"] == [3000 / 3200, 2600 / 3200]
    assert saved["target"] == ">= 0.8" and saved["met"] is True
    flat = r["peak resident weight bytes, deep / shallow (relay)"]
    assert flat["per_round"] == [220 / 200]  # a zero denominator skips its round
    assert flat["met"] is True
    speed = r["step time, relay / no relay"]
    assert speed["min"] == pytest.approx(1.1) and speed["max"] == pytest.approx(1.25)
    assert speed["met"] is False and speed["target"] == "<= 1.15"
    assert bench_relay.exactness(runs) == {
        "plain vs relay": {"losses_identical": True, "weights_identical": True}
    }
    runs["relay"][1] = dict(runs["relay"][1], losses=[1.0, 0.5000001])
    assert bench_relay.exactness(runs)["plain vs relay"]["losses_identical"] is False


def test_bench_relay_option_errors(tmp_path: Path) -> None:
    where = tmp_path / "never-made"
    code, _, err = offloadd_cli(
        "bench", "relay", "--quick", "--heads", "3", "--ssd-dir", str(where)
    )
    assert code == 2 and "--heads (3) must divide --hidden (64)" in err
    assert not where.exists()  # a bad option creates nothing
    code, _, err = offloadd_cli(
        "bench", "relay", "--quick", "--steps", "0", "--ssd-dir", str(where)
    )
    assert code == 2 and "--steps must be at least 1, got 0" in err
    code, out, _ = offloadd_cli("bench", "--help")
    assert code == 0 and "relay" in out
