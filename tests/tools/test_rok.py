"""``offloadd rok``: the sweep end to end in real subprocesses, OOM points, bad arguments, and the
transformers model families."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from offloadd import cli
from offloadd.tools.harness.train import RunSpec, run
from offloadd.tools.rok.summary import (
    aggregate,
    auto_rounds,
    compare,
    compare_auto,
    interpolate,
    pooled,
    summary_lines,
)

ENGINE_PARAMS = ("default",)  # the runs under test choose the engine (auto)

TINY = ["--layers", "2", "--hidden", "64", "--heads", "2", "--seq", "64", "--device", "cpu"]


def _rok(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OFFLOADD_MIN_BYTES": "16k"}  # tiny tensors still get offloaded
    return subprocess.run(
        [sys.executable, "-m", "offloadd", "rok", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )


def _rows(out: Path) -> list[dict[str, str]]:
    with (out / "rok.csv").open(newline="") as f:
        return list(csv.DictReader(f))


def test_quick_sweep_end_to_end(disk_dir: Path, tmp_path: Path) -> None:
    """Every strategy, auto under two budgets (one of them recompute's measured peak), plotted,
    summarized and resumed: one sweep (each point is a fresh interpreter: one run saves five)."""
    out = tmp_path / "out"
    args = [
        "--quick", *TINY, "--batch-sizes", "2", "--out", str(out), "--ssd-dir", str(disk_dir),
        "--strategies", "keep,recompute,offload-ssd,auto", "--budgets", "100x,recompute",
    ]  # fmt: skip
    proc = _rok(*args)
    assert proc.returncode == 0, proc.stderr
    rows = _rows(out)
    by = {r["strategy"]: r for r in rows}
    assert set(by) == {"keep", "recompute", "offload-ssd", "auto@100x", "auto@recompute"}
    assert {int(r["batch_size"]) for r in rows} == {2}
    # At this size RSS is mostly not tensors: recompute's RSS less keep's overhead can be below
    # what the measured plan needs (see [budgets on the axis]). Infeasible is then the honest
    # answer.
    rec = by["auto@recompute"]
    assert rec["status"] == "ok" or (
        rec["status"] == "infeasible" and "smallest feasible budget" in rec["error"]
    ), rec
    assert int(rec["budget_bytes"]) == int(by["recompute"]["activation_peak_bytes"])
    for r in rows:
        assert r["model"] == "mini-gpt" and r["layers"] == "2" and r["steps"] == "2"
        # auto warms up until its planner settled (test_auto_warms_up_until_its_planner_settled)
        assert r["warmup"] == "1" or r["strategy"].startswith("auto@"), r
        if r is rec:
            continue
        assert r["status"] == "ok", r
        assert float(r["step_time_s"]) > 0 and float(r["samples_per_s"]) > 0
        assert float(r["model_tflops"]) > 0 and int(r["activation_peak_bytes"]) > 0
    keep, ssd = by["keep"], by["offload-ssd"]
    # moved off (a tiny model's backward may take blocks from staging before their write)
    assert int(ssd["offloaded_bytes"]) > 0 and int(keep["offloaded_bytes"]) == 0
    assert int(keep["bytes_written"]) == 0
    assert int(keep["peak_resident_bytes"]) > 0 and int(ssd["peak_resident_bytes"]) > 0
    assert keep["weights_sha256"] == ssd["weights_sha256"]  # offloading is lossless
    assert by["recompute"]["peak_resident_bytes"] == ""  # no hooks, no accounting
    # Everything fits (both blocks and the head): keeping them all, unless the race found
    # offloading every block no slower, the leaner (on a busy machine it cannot tell them apart)
    assert by["auto@100x"]["plan"] in ("k3 o0 r0", "k0 o3 r0"), by["auto@100x"]
    assert by["auto@100x"]["race"].endswith(" blocks)"), by["auto@100x"]  # the race's verdict
    png = out / "rok.png"
    assert png.stat().st_size > 20_000
    import matplotlib.image

    img = matplotlib.image.imread(png)
    assert img.ndim == 3 and img.shape[0] > 300 and img.shape[1] > 600
    report = json.loads((out / "rok.json").read_text())
    machine = report["machine"]
    assert machine["logical_cores"] >= 1 and machine["ram_bytes"] > 0
    assert machine["torch"] and machine["disk"]["fs"]
    assert len(report["points"]) == 5
    summary = (out / "summary.txt").read_text()
    assert "offload-ssd, per batch size" in summary and "dominates recompute" in summary
    assert "auto, per budget (on the memory axis) and batch size" in summary
    assert "the fastest single strategy within its budget" in summary
    assert "offload-ssd batch" in proc.stdout  # one line per point
    assert "point" in proc.stderr  # the progress bar

    again = _rok(*args, "--resume")
    assert again.returncode == 0, again.stderr
    assert "0 points to measure (5 already in" in again.stdout
    assert len(_rows(out)) == 5


def test_out_of_memory_point_is_recorded(tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = _rok(
        *TINY,
        "--strategies",
        "keep",
        "--batch-sizes",
        "512",
        "--steps",
        "1",
        "--memory-limit",
        "64MiB",
        "--repeats",
        "2",
        "--out",
        str(out),
    )
    assert proc.returncode == 0, proc.stderr
    rows = _rows(out)
    assert sorted((int(r["batch_size"]), int(r["round"])) for r in rows) == [(512, 1), (512, 2)]
    for r in rows:  # the points that fit are every other test's
        assert r["status"] == "oom" and "allocate" in r["error"]
        assert r["step_time_s"] == ""


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--strategies", "keep,bogus"], "unknown strategy 'bogus'"),
        (["--strategies", "keep:jemalloc"], "unknown strategy 'keep:jemalloc'"),
        (["--strategies", ","], "--strategies must name at least one strategy"),
        (["--batch-sizes", " , "], "--batch-sizes must list at least one batch size"),
        (["--batch-sizes", "1,x"], "--batch-sizes must be comma-separated integers"),
        (["--batch-sizes", "0,2"], "--batch-sizes must be positive"),
        (["--hidden", "65"], "--heads (2) must divide --hidden (65)"),
        (["--strategies", "keep,offload-cpu"], "offload-cpu needs --device cuda"),
        (["--memory-limit", "lots"], "--memory-limit must be a byte count"),
        (["--repeats", "0"], "--repeats must be positive"),
        (["--codec", "int3"], "--codec: codec.name: 'int3'"),
        (["--strategies", "keep,offload-ssd+int3"], "--strategies 'offload-ssd+int3'"),
        (["--strategies", "recompute+int8"], "a codec after a plus is for keep and offload"),
    ],
)
def test_bad_arguments_fail_before_any_work(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    out = tmp_path / "never"
    assert cli.main(["rok", *TINY, "--out", str(out), *args]) == 2
    assert message in capsys.readouterr().err
    assert not out.exists()


def test_unknown_model_and_unwritable_out(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as e:
        cli.main(["rok", "--model", "nope"])
    assert e.value.code == 2
    assert "invalid choice: 'nope'" in capsys.readouterr().err
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert cli.main(["rok", *TINY, "--out", str(blocker / "sub")]) == 2
    err = capsys.readouterr().err
    assert "--out" in err and "is not a writable directory" in err


@pytest.mark.parametrize("family", ["gpt", "bert", "t5"])
def test_transformers_families_train_losslessly(disk_dir: Path, family: str) -> None:
    pytest.importorskip("transformers")
    common = dict(
        model=family,
        num_layers=2,
        d_model=64,
        num_heads=2,
        seq_len=32,
        vocab_size=512,
        batch_size=2,
        steps=1,
        ssd_dir=str(disk_dir),
        min_bytes=4096,
    )
    keep = run(RunSpec(strategy="keep", **common))  # type: ignore[arg-type]
    ssd = run(RunSpec(strategy="ssd", **common))  # type: ignore[arg-type]
    rec = run(RunSpec(strategy="recompute", **common))  # type: ignore[arg-type]
    assert not keep["oom"] and ssd["stats"]["offloaded_bytes"] > 0
    assert keep["losses"] == ssd["losses"]
    assert keep["weights_sha256"] == ssd["weights_sha256"]
    assert rec["losses"][0] == keep["losses"][0]  # same forward, recomputed in backward
    assert keep["flops_per_step"] > 6 * keep["params"] * 2 * 32  # plus attention
    if psutil.LINUX:  # steal is Linux's; the figure is machine-wide, so only its type is checked
        assert isinstance(ssd["steal_s"], float) and ssd["steal_s"] >= 0.0


def test_comparisons() -> None:
    assert interpolate([(10.0, 1.0), (30.0, 3.0)], 20.0) == 2.0
    assert interpolate([(10.0, 1.0), (30.0, 3.0)], 40.0) is None

    def row(s: str, b: int, mem: int, thr: float) -> dict[str, object]:
        return {
            "strategy": s,
            "batch_size": b,
            "status": "ok",
            "activation_peak_bytes": mem,
            "samples_per_s": thr,
        }

    rows = [
        row("keep", 2, 1000, 10.0),
        row("recompute", 2, 400, 7.0),
        row("recompute", 4, 800, 8.0),
        row("offload-ssd", 2, 420, 9.6),
    ]
    (c,) = compare(rows, "offload-ssd")
    assert c["mem_vs_keep"] == pytest.approx(0.42) and c["thr_vs_keep"] == pytest.approx(0.96)
    assert c["keep_target"] and c["dominates_recompute"]
    assert c["thr_vs_recompute_at_equal_memory"] == pytest.approx(9.6 / 7.05)
    assert "extra_steal_s" not in c  # no steal figures: no steal line
    assert not any("hypervisor" in line for line in summary_lines(rows))
    rows[0].update(step_time_s=1.0, steal_s=0.01)
    rows[3].update(step_time_s=1.15, steal_s=0.21)
    (c,) = compare(rows, "offload-ssd")
    assert c["extra_s"] == pytest.approx(0.15) and c["extra_steal_s"] == pytest.approx(0.2)
    (line,) = [x for x in summary_lines(rows) if "hypervisor" in x]
    assert line.endswith("batch 2 +150 ms, +200 ms")


def test_aggregate_takes_medians_over_ok_rounds() -> None:
    def row(n: int, status: str, step: float | None) -> dict[str, object]:
        return {
            "strategy": "keep",
            "batch_size": 4,
            "round": n,
            "status": status,
            "error": None if status == "ok" else "boom",
            "step_time_s": step,
            "step_time_min_s": step,
            "samples_per_s": None if step is None else 4 / step,
        }

    (p,) = aggregate([row(1, "ok", 2.0), row(2, "error", None), row(3, "ok", 4.0)])
    assert p["step_time_s"] == 3.0 and p["step_time_min_s"] == 2.0
    assert p["rounds"] == 3 and p["ok_rounds"] == 2 and p["status"] == "ok"
    (q,) = aggregate([row(1, "oom", None)])
    assert q["status"] == "oom" and q["ok_rounds"] == 0


def test_sweeps_from_before_the_race_column_still_read(tmp_path: Path) -> None:
    """A rok.csv written before the race column (and before --compile, --codec) reads back,
    the missing columns as such sweeps ran: no race shown, exact, eager."""
    from offloadd.tools.rok.points import FIELDS, read_points

    later = ({"race"}, {"compile", "race"}, {"codec", "compile", "race"})
    for missing in (*later, {"offloaded_bytes"}, {"offloaded_bytes", "race"}):
        path = tmp_path / "rok.csv"
        names = [k for k in FIELDS if k not in missing]
        with path.open("w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=names)
            w.writeheader()
            w.writerow({k: "" for k in names} | {"strategy": "keep", "batch_size": "2"})
        (row,) = read_points(path)
        assert row["race"] is None and row["batch_size"] == 2
        assert row["codec"] == ("none" if "codec" in missing else None)
    names = [k for k in FIELDS if k != "plan"]
    path.write_text(",".join(names) + "\n")
    with pytest.raises(ValueError, match="columns of this offloadd version"):
        read_points(path)


def test_auto_budgets_are_checked(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "never"
    assert (
        cli.main(["rok", *TINY, "--out", str(out), "--strategies", "auto", "--budgets", "lots"])
        == 2
    )
    assert "--budgets: budget: 'lots' is not a memory budget" in capsys.readouterr().err
    assert cli.main(["rok", *TINY, "--out", str(out), "--strategies", "auto,recompute"]) == 2
    assert "needs recompute among --strategies, before auto" in capsys.readouterr().err


def test_auto_comparisons() -> None:
    def row(s: str, mem: int, thr: float, **kw: object) -> dict[str, object]:
        return {
            "strategy": s,
            "batch_size": 2,
            "status": "ok",
            "activation_peak_bytes": mem,
            "samples_per_s": thr,
            **kw,
        }

    rows = [
        row("keep", 1000, 10.0),
        row("recompute", 400, 7.0),
        row("offload-ssd", 300, 9.0),
        row("auto@recompute", 450, 9.7, budget_bytes=400, plan="k3 o9 r0"),
        row("auto@0.2x", 250, 6.0, budget_bytes=200, plan="k0 o0 r12"),
    ]
    a, b = compare_auto(rows)
    assert a["best_single"] == "offload-ssd" and a["thr_vs_best_single"] == pytest.approx(9.7 / 9)
    assert a["auto_target"] and a["tba_target"] and a["thr_vs_keep"] == pytest.approx(0.97)
    assert "best_single" not in b and "auto_target" not in b  # nothing single fits 200 bytes


def test_auto_rounds_pair_each_round_with_its_own_single_run() -> None:
    def row(s: str, n: int, thr: float, mem: int = 300, **kw: object) -> dict[str, object]:
        return {"strategy": s, "batch_size": 4, "round": n, "status": "ok"} | {
            "activation_peak_bytes": mem,
            "samples_per_s": thr,
            "step_time_min_s": 1.0,
            **kw,
        }

    rounds = [
        row("keep", 1, 10.0, mem=1000),
        row("offload-ssd", 1, 8.0),
        row("auto@0.5x", 1, 8.4, budget_bytes=500, plan="k1 o8 r0"),
        row("keep", 2, 9.0, mem=1000),
        row("offload-ssd", 2, 6.0),  # a slow round for everyone
        row("auto@0.5x", 2, 6.0, budget_bytes=500, plan="k1 o8 r0"),
        row("auto@0.5x", 3, 5.0, budget_bytes=500, plan="k1 o8 r0"),  # its single failed
        row("offload-ssd", 3, 1.0) | {"status": "error"},
    ]
    per = auto_rounds(rounds)
    assert [(p["round"], p["ratio"]) for p in per] == [(1, pytest.approx(1.05)), (2, 1.0)]
    mean, lo, hi = pooled([p["ratio"] for p in per])
    assert mean == pytest.approx((1.05 * 1.0) ** 0.5) and lo == pytest.approx(1.0)
    assert hi == pytest.approx(1.05)
    assert pooled([1.0, 1.0, 1.0]) == (1.0, 1.0, 1.0)
    with pytest.raises(ValueError, match="at least two ratios, got 1"):
        pooled([1.02])
    assert not [x for x in summary_lines(aggregate(rounds), rounds) if "point-rounds" in x]
    many = [r | {"round": n} for n in range(1, 11) for r in rounds[:3]]  # POOL_MIN rounds
    (line,) = [x for x in summary_lines(aggregate(many), many) if "point-rounds" in x]
    assert "10 point-rounds" in line and "lowest 1.05x" in line


def test_auto_over_its_axis_budget_runs_once_more_with_a_margin(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An auto point whose RSS peak lands over its budget on the axis runs a second time with
    offloadd's budget smaller by the excess and RETRY_MARGIN of the axis budget (the excess
    alone once left a second try 1.001x over); its plan says so."""
    from types import SimpleNamespace

    from offloadd.tools.rok import points as rok_points

    specs: list[str | None] = []
    peaks = iter([1010, 990])  # the first try 10 bytes over the axis budget of 1000

    def fake_run(sw: object, spec: RunSpec) -> dict[str, object]:
        specs.append(spec.budget)
        return {"status": "ok", "activation_peak_bytes": next(peaks), "plan": "k0 o9 r0",
                "held_budget_bytes": int(spec.budget or 0)}  # fmt: skip

    monkeypatch.setattr(rok_points, "_run", fake_run)
    sw = SimpleNamespace(key=dict, model="gpt", layers=1, hidden=8, heads=1, seq=8, vocab=8,
                         steps=1, warmup=1, allocator="auto", device="cpu", ssd_dir=None,
                         memory_limit=None, compile=False, codec="none")  # fmt: skip
    keep = {"strategy": "keep", "batch_size": 2, "round": 1, "status": "ok",
            "activation_peak_bytes": 2000, "peak_live_above_base": 1800}  # fmt: skip
    row = rok_points.measure(sw, "auto@0.5x", 2, 1, [keep])  # type: ignore[arg-type]
    margin = int(rok_points.RETRY_MARGIN * 1000)
    assert specs == ["800", str(800 - 10 - margin)]  # 1000 less keep's 200 of overhead
    assert row["plan"] == "k0 o9 r0 (2nd try)" and row["activation_peak_bytes"] == 990


def test_resume_takes_auto_rows_with_the_warmups_auto_needs() -> None:
    """A row records the warm-ups that ran; auto's are more than the sweep asked for, and
    --resume must still see them as this sweep's (it refused every sweep with auto points)."""
    from types import SimpleNamespace

    from offloadd.tools.harness.train import warmup_steps
    from offloadd.tools.rok.command import _sweep_key
    from offloadd.tools.rok.sweep import KEY

    asked = {k: 0 for k in KEY} | {"warmup": 3, "compile": False}
    sw = SimpleNamespace(warmup=3, compile=False)
    auto_ran = warmup_steps("auto", 3, compile=False)
    assert auto_ran > 3

    def key(strategy: str, warmup: int) -> dict[str, object]:
        return _sweep_key(asked | {"strategy": strategy, "warmup": warmup}, sw)  # type: ignore[arg-type]

    assert key("auto@0.5x", auto_ran) == asked
    from offloadd.auto.planner import WARMUP_STEPS_MAX

    assert key("auto@0.5x", WARMUP_STEPS_MAX) == asked  # the longest race
    assert key("auto@0.5x", WARMUP_STEPS_MAX + 1) != asked
    assert key("keep", 3) == asked
    assert key("keep", auto_ran) != asked  # another sweep's warm-ups
    assert key("auto@recompute", 5) != asked


def test_auto_warms_up_until_its_planner_settled(
    disk_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """auto's race runs as long as it takes to tell its plans apart ([race]); the run warms up
    until the planner has settled and run one step under its final plan, so that every timed
    step is a settled plan's; the warm-ups that ran are recorded (rok's rows key on them)."""
    import offloadd.auto.drift
    from offloadd.auto.planner import WARMUP_STEPS, WARMUP_STEPS_MAX
    from offloadd.tools.harness.train import RunSpec, run

    # One race fits in WARMUP_STEPS_MAX, two do not. On a loaded machine the tiny blocks' slow
    # first planned steps read as drift, and a profile again starts a second race (seen once
    # in CI). Drift has tests of its own (tests/auto/test_auto.py).
    monkeypatch.setattr(offloadd.auto.drift, "DRIFT", float("inf"))

    spec = RunSpec(
        strategy="auto", budget="0.6x", num_layers=2, d_model=64, num_heads=2, seq_len=32,
        batch_size=2, steps=3, warmup=1, ssd_dir=str(disk_dir), min_bytes=1024, vocab_size=128,
    )  # fmt: skip
    res = run(spec)
    assert res["auto_settled"] is True and len(res["step_times_s"]) == 3
    assert WARMUP_STEPS <= res["warmup_steps"] <= WARMUP_STEPS_MAX
    warm = [r["warmup"] for r in res["trace"]]
    assert warm == [True] * res["warmup_steps"] + [False] * 3
    assert res["trace"][res["warmup_steps"] - 1]["auto_settled"]  # one step under the plan
