"""``offloadd bench memsave`` smoke-runs at tiny sizes (figures are never asserted, only their
presence, the deterministic saved-bytes ratios excepted)."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from offloadd.tools.bench import memsave as bench_memsave
from tests._support.cli import offloadd_cli

pytest.importorskip("transformers")

ENGINE_PARAMS = ("default",)  # the benchmark runs the default engine (auto)
ROOT = Path(__file__).resolve().parents[2]
TINY = [
    "--resnet-depths", "1,1,1,1",
    "--image-size", "32",
    "--vit-layers", "1",
    "--vit-hidden", "64",
    "--vit-image-size", "32",
    "--batch", "2",
    "--steps", "1",
    "--warmup", "0",
]  # fmt: skip


def _ns(*args: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    bench_memsave.add_arguments(p)
    return p.parse_args(list(args))


def test_bench_memsave_tiny(disk_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "report.md"
    ns = _ns(*TINY, "--ssd-dir", str(disk_dir), "--out", str(out))
    assert bench_memsave.main(ns) == 0
    text = out.read_text()
    for scenario in bench_memsave.SCENARIOS:
        assert f"### {scenario}" in text
    assert text.count("| memsave+offload |") == len(bench_memsave.SCENARIOS)
    assert "target saved bytes <= 0.1: met" in text  # saliency: deterministic


def test_bench_memsave_ratios_are_deterministic() -> None:
    ns = _ns(*TINY, "--scenarios", "saliency,full", "--no-offload")
    a = bench_memsave.run_scenario("saliency", ns)
    b = bench_memsave.run_scenario("saliency", ns)
    assert a["plain"]["saved_bytes"] == b["plain"]["saved_bytes"]
    assert a["memsave"]["saved_bytes"] == b["memsave"]["saved_bytes"]
    assert a["memsave"]["saved_bytes"] <= 0.1 * a["plain"]["saved_bytes"]
    assert "memsave+offload" not in a


def test_bench_memsave_control_is_a_second_plain() -> None:
    ns = _ns(*TINY, "--scenarios", "bn-tuning", "--no-offload", "--control", "--steps", "2")
    res = bench_memsave.run_scenario("bn-tuning", ns)
    control = res[bench_memsave.CONTROL]
    assert control["saved_bytes"] == res["plain"]["saved_bytes"]
    assert res["plain"]["step_ratio"] == 1.0 and control["step_ratio"] > 0
    report = bench_memsave.format_report({"bn-tuning": res}, [])
    assert f"| {bench_memsave.CONTROL} |" in report and "x plain (paired)" in report
    assert "page faults per step" in report and control["faults"] >= 0


def test_keep_freed_memory_flag(tmp_path: Path) -> None:
    # a subprocess: the flag changes glibc's settings for the whole process
    out = tmp_path / "report.md"
    args = [*TINY, "--scenarios", "saliency", "--no-offload", "--keep-freed-memory"]
    proc = subprocess.run(
        [sys.executable, "-m", "offloadd", "bench", "memsave", *args, "--out", str(out)],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    text = out.read_text()
    assert "glibc keeps freed memory (--keep-freed-memory)" in text
    assert "page faults per step" in text


def test_bench_memsave_cli_and_errors() -> None:
    code, _, err = offloadd_cli("bench", "memsave", "--scenarios", "nope")
    assert code == 2 and "unknown 'nope'" in err
    code, out, _ = offloadd_cli("bench", "--help")
    assert code == 0 and "memsave" in out
