from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from offloadd.tools import demo
from offloadd.tools.harness.train import RunFailed, RunSpec
from tests._support.cli import offloadd_cli

ENGINE_PARAMS = ("default",)  # the demo runs the default engine (auto)

_TINY = ["--layers", "2", "--hidden", "64", "--heads", "2", "--seq", "64", "--batch", "4"]


@pytest.mark.slow  # the table's format: the made-up results below; the wall: the next tests
def test_demo_full_runs_and_reports(disk_dir: Path) -> None:
    cmd = [sys.executable, "-m", "offloadd", "demo", "--full", *_TINY, "--steps", "1"]
    cmd += ["--warmup", "1"]
    cmd += ["--ssd-dir", str(disk_dir), "--device", "cpu"]
    env = {**os.environ, "OFFLOADD_MIN_BYTES": "16k"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    header = next(line for line in out.splitlines() if "ssd offload" in line and "keep" in line)
    assert header.split() == ["plain", "keep", "recompute", "ssd", "offload"]
    for label in (
        "median step time",
        "peak saved activations held",
        "peak RSS above model",
        "bytes written",
        "bytes read back",
        "time waiting on I/O",
    ):
        assert label in out
    held = next(line for line in out.splitlines() if line.startswith("peak saved activations"))
    cells = held.split()
    assert cells[4] == cells[7] == "-"  # plain and recompute: no hooks, no accounting
    assert "keep (the hooks on, nothing moved) on offloadd's host cache (the allocator ssd " in out
    assert "Offloading then " in out and "; recompute held " in out
    assert "bit-identical to keep: ssd offload yes" in out
    assert "bit-identical to keep: plain yes" in out  # the allocator changes no numerics
    # the built-in GPT's non-reentrant checkpointing keeps dropout's RNG: exact as well
    assert "bit-identical to keep: recompute yes" in out
    for strategy in ("none", "keep", "recompute", "ssd"):
        assert f"[{strategy}] step 1/1" in proc.stderr  # progress


def test_demo_bad_arguments() -> None:
    code, _, err = offloadd_cli("demo", "--layers", "0")
    assert code == 2 and "--layers must be positive" in err
    code, _, err = offloadd_cli("demo", "--memory-limit", "lots")
    assert code == 2 and "--memory-limit" in err


_WALL = ["--layers", "6", "--hidden", "128", "--heads", "2", "--seq", "256", "--vocab", "256"]


def test_demo_shows_the_wall_inside_a_cgroup(disk_dir: Path) -> None:
    """The default demo: plain's batch doubles until the kernel kills it at the limit; offloadd
    trains a larger batch inside the same limit, bit-identical to plain without the limit."""
    from tests._support.cgroup import memory_cgroup

    with memory_cgroup(64 << 20):  # skips where no cgroup can be made
        pass
    cmd = [sys.executable, "-m", "offloadd", "demo", *_WALL, "--memory-limit", "340MiB"]
    cmd += ["--steps", "1", "--warmup", "0"]
    cmd += ["--ssd-dir", str(disk_dir), "--device", "cpu"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "plain PyTorch stops at batch" in out and "(out of memory at 340.0 MiB)" in out, out
    stop = int(out.split("plain PyTorch stops at batch ")[1].split()[0])
    trained = int(out.split("offloadd trains batch ")[1].split()[0])
    assert trained in (2 * stop, stop), out  # 4x or 2x plain's largest (stop / 2)
    assert f"bit-identical to plain PyTorch at batch {trained}: yes" in out
    assert "What it cost: at batch" in out and "ssd offload: totals: saved" in out
    assert "offloadd demo --full" in out


def test_demo_without_a_cgroup_predicts_the_wall(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """No cgroup (not root): one line says so, then the peaks at batch 2 and 8 without a limit
    and the wall a line through them predicts (made-up runs: the arithmetic), and the bits."""
    from offloadd.tools import demo_wall
    from offloadd.tools.harness.cgroup import CgroupUnavailable

    def refused(limit: int, prefix: str = "") -> None:
        raise CgroupUnavailable("no memory cgroup can be made here (EPERM); run as root")

    mib = 1 << 20
    per_sample = {"plain": 100 * mib, "offload-ssd": 10 * mib}
    ran: list[tuple[str, int, bool]] = []

    def fake(spec: Any, strategy: str, batch: int, seq: int, *, limited: bool = True) -> Any:
        ran.append((strategy, batch, limited))
        return {
            "strategy": strategy, "batch_size": batch, "status": "ok",
            "peak_bytes": 400 * mib + batch * per_sample[strategy], "samples_per_s": 2.0,
            "losses": [1.0], "weights_sha256": "ab" * 32,
        }  # fmt: skip

    monkeypatch.setattr(demo_wall, "memory_cgroup", refused)
    monkeypatch.setattr(demo_wall, "measure", fake)
    assert demo.main(demo_wall_args(["--device", "cpu", "--memory-limit", "1GiB"])) == 0
    out = capsys.readouterr().out
    assert "run as root; measuring peaks without a limit and predicting the wall" in out
    assert all(not limited for _, _, limited in ran) and len(ran) == 4
    plain = next(ln for ln in out.splitlines() if ln.startswith("plain PyTorch: peak"))
    assert "100.0 MiB a sample; predicted wall in 1.0 GiB: batch 6;" in plain  # (1024-400)/100
    ours = next(ln for ln in out.splitlines() if ln.startswith("offloadd (ssd offload): peak"))
    assert "predicted wall in 1.0 GiB: batch 62;" in ours
    assert "bit-identical to plain PyTorch at batch 8: yes" in out


def demo_wall_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    demo.add_arguments(p)
    return p.parse_args(argv)


# -- the report and the exit status, on made-up results (no training) --------------------------


def _result(strategy: str, *, digest: str = "ab" * 32, rss: int = 100 << 20) -> dict[str, Any]:
    out: dict[str, Any] = {
        "strategy": strategy,
        "oom": False,
        "error": None,
        "allocator": "system" if strategy == "plain" else "caching",
        "step_time_s": {"plain": 1.1, "keep": 1.0, "recompute": 1.25, "ssd": 1.03}[strategy],
        "losses": [8.5, 8.25],
        "weights_sha256": digest,
        "peak_rss_above_base": rss,
    }
    if strategy not in ("plain", "recompute"):
        moved = 0 if strategy == "keep" else 64 << 20
        out["stats"] = {
            "peak_resident_bytes": (80 << 20) if strategy == "keep" else (20 << 20),
            "bytes_written": moved,
            "bytes_read": moved,
            "io_wait_s": 0.0 if strategy == "keep" else 0.5,
        }
    return out


def _results(**changes: dict[str, Any]) -> dict[str, dict[str, Any]]:
    rss = {"plain": 100 << 20, "keep": 95 << 20, "recompute": 30 << 20, "ssd": 31 << 20}
    out = {s: _result(s, rss=rss[s]) for s in demo.STRATEGIES}
    for s, fields in changes.items():
        out[s].update(fields)
    return out


def _with_stats(results: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """``Stats(**st)`` needs every field: fill the ones the made-up results leave out."""
    from offloadd.runtime.stats import Stats

    for r in results.values():
        if "stats" in r:
            r["stats"] = {**Stats().as_dict(), **r["stats"]}
    return results


def test_report_says_what_ssd_bought() -> None:
    text, ssd_same = demo.format_report(_with_stats(_results()), device="cpu")
    assert ssd_same
    assert (
        "keep (the hooks on, nothing moved) on offloadd's host cache (the allocator ssd uses) "
        "ran at 0.91x plain PyTorch's step time (plain: no hooks, glibc's heap). "
        "Offloading then cost 3 % of keep's step time (the same allocator; no timed steps' "
        "range) to hold 0.31x of plain PyTorch's peak RSS; recompute held 0.30x at 1.25x keep's "
        "step time." in text
    )
    assert "wrote 64.0 MiB and read 64.0 MiB back over 2 steps" in text
    assert "waited 0.500 s on I/O" in text
    assert "ssd held 0.25x of keep's saved activations at peak" in text


def test_report_gives_the_cost_with_its_range() -> None:
    """The cost comes with what the timed steps allow, and says when that range holds 0."""
    wide = {"keep": {"step_times_s": [0.9, 1.0, 1.2]}, "ssd": {"step_times_s": [0.95, 1.03, 1.5]}}
    text, _ = demo.format_report(_with_stats(_results(**wide)), device="cpu")
    assert (
        "cost 3 % of keep's step time (the same allocator; the timed steps allow -21 to +67 %, "
        "which holds 0: this run does not resolve the difference)" in text
    )
    narrow = {"keep": {"step_times_s": [1.0, 1.0]}, "ssd": {"step_times_s": [1.2, 1.3]}}
    text, _ = demo.format_report(_with_stats(_results(**narrow)), device="cpu")
    assert "the timed steps allow +20 to +30 %) to hold" in text


def test_report_when_offloading_is_faster_than_keep() -> None:
    results = _with_stats(_results(ssd={"step_time_s": 0.95}, keep={"allocator": "system"}))
    text, _ = demo.format_report(results, device="cpu")
    assert "on the same allocator as plain PyTorch ran at 0.91x plain PyTorch's step" in text
    assert "Offloading then saved 5 % of keep's step time" in text


def test_report_on_cuda_names_device_memory() -> None:
    results = _results()
    for r in results.values():
        r["peak_device_above_base"] = r["peak_rss_above_base"]
    text, _ = demo.format_report(_with_stats(results), device="cuda")
    assert "peak device memory above model" in text
    assert "of plain PyTorch's peak device memory" in text


def _run_main(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    results: dict[str, dict[str, Any] | None],
) -> tuple[int, str]:
    def fake_run(spec: RunSpec, *, progress: bool = False) -> dict[str, Any]:
        r = results["plain" if spec.strategy == "none" else spec.strategy]
        if r is None:
            raise RunFailed("killed", -9, "")
        return r

    monkeypatch.setattr(demo, "run_in_subprocess", fake_run)
    p = argparse.ArgumentParser()
    demo.add_arguments(p)
    status = demo.main(p.parse_args(["--device", "cpu", "--full"]))
    return status, capsys.readouterr().out


def test_exit_status_fails_only_for_ssd(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    other = "cd" * 32
    results: dict[str, dict[str, Any] | None] = dict(
        _with_stats(_results(recompute={"weights_sha256": other}))
    )
    status, out = _run_main(monkeypatch, capsys, results)
    assert status == 0
    assert "recompute NO (reported only" in out and "ssd offload yes" in out

    results = dict(_with_stats(_results(ssd={"losses": [8.5, 8.0]})))
    status, out = _run_main(monkeypatch, capsys, results)
    assert status == 1 and "bit-identical to keep: ssd offload NO" in out


def test_failed_recompute_run_is_reported_not_fatal(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    results: dict[str, dict[str, Any] | None] = dict(_with_stats(_results()))
    results["recompute"] = None
    status, out = _run_main(monkeypatch, capsys, results)
    assert status == 0
    step = next(line for line in out.splitlines() if line.startswith("median step time"))
    assert step.split()[3:] == ["1.100", "s", "1.000", "s", "failed", "1.030", "s"]
    assert "to hold 0.31x of plain PyTorch's peak RSS." in out
    assert "recompute held" not in out

    results["plain"] = None  # plain failed too: memory against keep's
    status, out = _run_main(monkeypatch, capsys, results)
    assert status == 0
    assert (
        "Offloading then cost 3 % of keep's step time (the same allocator; no timed steps' "
        "range) to hold 0.33x of keep's peak RSS." in out
    )
    assert "plain PyTorch's step time" not in out
