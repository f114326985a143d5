from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ENGINE_PARAMS = ("default",)  # the demo runs the default engine (auto)


def test_demo_runs_and_reports(disk_dir: Path) -> None:
    cmd = [
        sys.executable,
        "-m",
        "offloadd",
        "demo",
        "--layers",
        "2",
        "--d-model",
        "64",
        "--heads",
        "2",
        "--seq",
        "64",
        "--batch",
        "4",
        "--steps",
        "1",
        "--ssd-dir",
        str(disk_dir),
        "--device",
        "cpu",
    ]
    env = {**os.environ, "OFFLOADD_MIN_BYTES": "16k"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "bit-identical: yes" in out
    for label in ("median step time", "peak saved activations held", "bytes written"):
        assert label in out
    assert "step 1/1" in proc.stderr  # progress


def test_demo_bad_arguments() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "offloadd", "demo", "--layers", "0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and "--layers must be positive" in proc.stderr
