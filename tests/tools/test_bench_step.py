"""``offloadd bench step`` smoke-runs at tiny sizes (figures are never asserted, only their
shape), and its ratios on made-up results."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from offloadd import cli
from offloadd.runtime.stats import Stats
from offloadd.tools.bench.step_report import RATIOS, format_report, per_round
from offloadd.tools.harness.step_trace import StepTrace, medians, preload_path
from offloadd.tools.harness.train import RunSpec, run_in_subprocess

ENGINE_PARAMS = ("default",)  # the benchmark runs the default engine (auto)

_TINY = ["--layers", "2", "--hidden", "64", "--heads", "2", "--seq", "64", "--batch", "2"]


def _bench(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "offloadd", "bench", "step", *args],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def _ratio_rows(out: str) -> dict[str, str]:
    """The ratio table's value and target by label."""
    rows = {}
    for line in out.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 3 and " / " in cells[0]:
            rows[cells[0]] = cells[2]
    return rows


def test_bench_step_end_to_end(disk_dir: Path, tmp_path: Path) -> None:
    out, doc = tmp_path / "step.md", tmp_path / "step.json"
    args = [*_TINY, "--steps", "2", "--warmup", "1", "--rounds", "1", "--deep-layers", "3"]
    proc = _bench(
        *args, "--ssd-dir", str(disk_dir), "--out", str(out), "--json", str(doc), "--trace"
    )
    assert proc.returncode == 0, proc.stderr
    assert out.read_text().strip() == proc.stdout.strip()
    assert "- model: built-in GPT, 2 layers, d=64" in proc.stdout
    assert "2 timed steps (their median) after 1 warm-up step" in proc.stdout
    assert (
        "- allocator: none:system: system, keep: caching, recompute: caching, ssd: caching"
        in proc.stdout
    )
    assert _ratio_rows(proc.stdout) == {
        "ssd step time / keep (same allocator)": "<= 1.10",
        "ssd step time / recompute": "< 1",
        "keep step time / plain": "(allocator + hooks)",
        "ssd step time / plain": "-",
        "ssd peak RSS above model / plain": "<= 0.15",
        "ssd peak RSS above model / keep": "<= 0.35",
        "ssd peak RSS above model / recompute": "<= 1.0",
        "ssd peak_resident_bytes / keep": "<= 0.25",
    }
    for s in ("none:system", "recompute", "ssd"):
        assert f"bit-identical across keep and {s} runs: yes" in proc.stdout
    # --trace: where each strategy's step time goes
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| ssd | ")]
    assert len(rows) == 2  # the strategy table's row, then the trace's
    assert len(rows[1].split("|")) == 2 + 1 + 9 + 3
    assert "| strategy | step | forward | backward |" in proc.stdout
    # --json: every run, with its per-step records (warm-ups marked)
    runs = json.loads(doc.read_text())["results"]
    assert set(runs) == {"none:system", "keep", "recompute", "ssd"}
    ssd = runs["ssd"][0]
    assert [r["warmup"] for r in ssd["trace"]] == [True, False, False]
    med = ssd["trace_median"]
    assert med["pack_s"] > 0 and med["unpack_s"] > 0
    assert med["pack_s"] >= med["write_wait_s"] and med["unpack_s"] >= med["read_wait_s"]
    assert runs["none:system"][0]["trace_median"]["pack_s"] == 0
    assert "Hook cost per small kept tensor" in proc.stdout
    assert "Depth scaling (ssd)" in proc.stdout and "at 3 layers" in proc.stdout
    assert "round 1/1: ssd" in proc.stderr


@pytest.mark.slow  # the end-to-end run's path with a codec strategy (the codec: tests/codec/)
def test_bench_step_compares_a_codec_with_the_strategy_alone(disk_dir: Path) -> None:
    args = [*_TINY, "--steps", "1", "--warmup", "0", "--rounds", "1", "--deep-layers", "0"]
    args += ["--no-hook-cost", "--strategies", "ssd,ssd+int8"]
    proc = _bench(*args, "--ssd-dir", str(disk_dir))
    assert proc.returncode == 0, proc.stderr
    assert "| ssd+int8 step time / ssd |" in proc.stdout
    assert "| ssd+int8 saved bytes / ssd |" in proc.stdout


# the same preload path twice: tcmalloc is jemalloc's slow sibling
@pytest.mark.parametrize(
    "allocator", ["jemalloc", pytest.param("tcmalloc", marks=pytest.mark.slow)]
)
def test_bench_step_preloaded_allocator(allocator: str) -> None:
    """keep on a preloaded allocator (.ci/run installs both): the library is mapped in the run's
    process, and the weights match plain PyTorch's on glibc."""
    try:
        lib = preload_path(allocator)
    except ValueError as e:
        pytest.skip(str(e))
    common = dict(num_layers=1, d_model=64, num_heads=2, seq_len=32, batch_size=2)
    plain = run_in_subprocess(
        RunSpec(strategy="none", allocator="system", steps=1, warmup=0, **common)
    )
    got = run_in_subprocess(
        RunSpec(strategy="keep", allocator=allocator, steps=1, warmup=0, **common)
    )
    assert got["allocator"] == allocator
    assert got["weights_sha256"] == plain["weights_sha256"]
    assert Path(lib).is_file()


@pytest.mark.slow  # the end-to-end run above is the command's; the HF model: test_rok, test_clients
def test_bench_step_hf_gpt2(disk_dir: Path) -> None:
    pytest.importorskip("transformers")
    args = [*_TINY, "--steps", "1", "--warmup", "0", "--rounds", "1", "--deep-layers", "0"]
    args += ["--no-hook-cost", "--vocab", "300", "--strategies", "keep,ssd"]
    proc = _bench("--model", "gpt", *args, "--ssd-dir", str(disk_dir))
    assert proc.returncode == 0, proc.stderr
    assert "- model: GPT-2 (transformers, random weights), 2 layers" in proc.stdout
    assert "- command: `python -m offloadd bench step --model gpt --layers 2" in proc.stdout
    assert "ssd step time / keep (same allocator)" in _ratio_rows(proc.stdout)
    assert "bit-identical across keep and ssd runs: yes" in proc.stdout
    assert "Hook cost" not in proc.stdout and "Depth scaling" not in proc.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--strategies", "keep,fast"], "--strategies: unknown 'fast'"),
        (["--rounds", "0"], "--rounds must be at least 1"),
        (["--d-model", "64", "--heads", "3"], "--heads (3) must divide --hidden (64)"),
        (["--deep-layers", "-1"], "--deep-layers must be 0 (skip) or positive"),
        (["--batch", "0"], "--batch must be positive"),
        (["--model", "llama"], "invalid choice: 'llama'"),
        (["--codec", "int3"], "--codec: codec.name: 'int3'"),
        (["--strategies", "ssd+int3"], "--strategies 'ssd+int3'"),
        (["--strategies", "none:hoard"], "--strategies 'none:hoard': unknown allocator 'hoard'"),
        (["--strategies", "auto"], "--strategies: unknown 'auto'"),
        (["--vocab", "0"], "--vocab must be positive"),
        (["--warmup", "-1"], "--warmup must be 0 or more"),
    ],
)
def test_bench_step_bad_arguments(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """In process (the end-to-end tests run the command itself): refused, before any run."""
    try:
        code = cli.main(["bench", "step", *args])
    except SystemExit as e:  # argparse's own errors
        code = e.code
    err = capsys.readouterr().err
    assert code == 2 and message in err, err
    assert "round 1/" not in err


def _run(step: float, rss: int, digest: str = "ab") -> dict[str, Any]:
    return {
        "step_time_s": step,
        "step_times_s": [step, step, step * 1.1, step * 1.1],
        "peak_rss_above_base": rss,
        "weights_sha256": digest,
    }


def test_ratios_are_medians_of_per_round_ratios() -> None:
    results = {
        "none:system": [_run(1.2, 400), _run(2.4, 400), _run(1.2, 400)],
        "keep": [_run(1.0, 100), _run(2.0, 100), _run(1.0, 200)],
        "recompute": [_run(1.5, 40), _run(1.5, 40), _run(1.0, 50)],
        "ssd": [_run(1.1, 30), _run(2.0, 30), _run(0.9, 40)],
    }
    assert per_round(results, "ssd", "keep", "step_time_s") == pytest.approx([1.1, 1.0, 0.9])
    ns = argparse.Namespace(
        model="gpt", layers=8, d_model=512, heads=8, seq=512, batch=4, steps=3, rounds=3, warmup=3
    )
    text = format_report(ns, results, command="offloadd bench step --model gpt")
    rows = {line.split("|")[1].strip(): line for line in text.splitlines() if " / " in line}
    assert set(rows) == {label for label, *_ in RATIOS}
    assert "| 1.000 (0.900..1.100) | <= 1.10 |" in rows["ssd step time / keep (same allocator)"]
    assert "| 0.833 (0.833..0.833) |" in rows["keep step time / plain"]
    assert "| 0.075 (0.075..0.100) | <= 0.15 |" in rows["ssd peak RSS above model / plain"]
    assert "| 0.900 (0.733..1.333) | < 1 |" in rows["ssd step time / recompute"]
    assert "| 0.300 (0.200..0.300) | <= 0.35 |" in rows["ssd peak RSS above model / keep"]
    assert "| 0.750 (0.750..0.800) | <= 1.0 |" in rows["ssd peak RSS above model / recompute"]
    assert "Final weights bit-identical across keep and ssd runs: yes" in text
    # a run on another allocator than keep's: the row says so instead of "same allocator"
    for r in results["ssd"]:
        r["allocator"] = "system"
    for r in results["keep"]:
        r["allocator"] = "caching"
    text = format_report(ns, results, command="offloadd bench step --allocator auto")
    assert "| ssd step time / keep (allocators differ: system, caching) |" in text
    assert "| recompute | 1.500 | 1.10 | 40 B | - |" in text  # drift: 2nd half / 1st half


def test_step_trace_splits_a_step() -> None:
    """One step's record: phases from the marks, the hooks' time as Stats differences, compute
    the rest; the process's CPU time over wall time (a busy loop here: its one thread's CPU)."""
    st = Stats(pack_s=1.0, unpack_s=2.0, read_wait_s=0.5)
    trace = StepTrace()
    trace.begin(st)
    # 50 ms of this thread's CPU (so at least 50 ms of wall): with another test process on the
    # cores, 50 ms of wall could hold less than the 30 ms of CPU asserted below
    end = time.thread_time() + 0.05
    while time.thread_time() < end:
        pass
    trace.mark()
    st.pack_s += 0.01
    trace.mark()
    st.unpack_s += 0.02
    st.read_wait_s += 0.015
    rec = trace.end(st)
    assert rec["forward_s"] >= 0.05 and rec["backward_s"] >= 0 and rec["optimizer_s"] >= 0
    total = rec["forward_s"] + rec["backward_s"] + rec["optimizer_s"]
    assert total == pytest.approx(rec["step_s"])
    assert rec["pack_s"] == pytest.approx(0.01) and rec["unpack_s"] == pytest.approx(0.02)
    assert rec["read_wait_s"] == pytest.approx(0.015) and rec["write_wait_s"] == 0
    assert rec["compute_s"] == pytest.approx(rec["step_s"] - 0.03)
    # one busy thread: the process's CPU over the step is that thread's, whatever share of a
    # core the machine gave it (beside another test worker it can be under half)
    assert 0 < rec["busy_cores"] < 1.5 and 0 <= rec["idle_fraction"] < 1
    cpu = rec["busy_cores"] * rec["step_s"]
    assert cpu == pytest.approx(rec["main_thread_cpu_s"], abs=0.01)
    assert rec["main_thread_cpu_s"] > 0.03
    without = StepTrace()
    without.begin(None)
    rec = without.end(None)
    assert rec["pack_s"] == 0 and rec["forward_s"] == 0  # no marks: all optimizer
    assert medians([{"a": 1.0, "w": True}, {"a": 3.0, "w": False}, {"a": 2.0, "w": False}]) == {
        "a": 2.0
    }
