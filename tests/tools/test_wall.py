"""``offloadd wall``: the search, the options, auto's budget inside a cap, and the walls found
for real, each point in a memory cgroup of its own (the kernel's OOM killer at the limit)."""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from offloadd import cli
from offloadd.tools.harness import cgroup
from offloadd.tools.harness.memory import rss
from offloadd.tools.harness.train import CAP_SHARE, RunSpec, run
from offloadd.tools.wall import command
from offloadd.tools.wall.search import find_wall
from tests._support.cgroup import memory_cgroup

ENGINE_PARAMS = ("default",)  # the runs under test choose the engine (auto)

MIB = 1 << 20


def _fits(wall: int):  # type: ignore[no-untyped-def]
    def status_of(size: int) -> str:
        return "ok" if size <= wall else "oom"

    return status_of


@pytest.mark.parametrize("wall", [1, 2, 3, 37, 64, 100, 1000])
def test_the_search_doubles_then_bisects_to_the_wall(wall: int) -> None:
    found = find_wall(_fits(wall), 1, 4096)
    assert (found.largest, found.smallest_failed, found.failed_as) == (wall, wall + 1, "oom")
    sizes = [s for s, _ in found.tried]
    assert len(sizes) == len(set(sizes))  # no point twice
    assert len(sizes) <= 2 * wall.bit_length() + 1  # about 2 log2(wall) points
    assert sizes[: wall.bit_length() + 1] == [2**k for k in range(wall.bit_length() + 1)]


def test_the_search_at_its_edges() -> None:
    none_fit = find_wall(_fits(0), 4, 64)
    assert (
        none_fit.largest is None
        and none_fit.smallest_failed == 4
        and none_fit.tried == [(4, "oom")]
    )
    all_fit = find_wall(_fits(10**6), 3, 20)
    assert all_fit.largest == 20 and all_fit.smallest_failed is None
    assert [s for s, _ in all_fit.tried] == [3, 6, 12, 20]
    coarse = find_wall(_fits(37), 1, 4096, tolerance=8)
    assert coarse.largest is not None and coarse.smallest_failed is not None
    assert coarse.largest <= 37 < coarse.smallest_failed <= coarse.largest + 8

    def broken(size: int) -> str:  # not memory: the search stops there, and says so
        return "ok" if size < 8 else "error"

    def planned(size: int) -> str:  # auto's planner finding no plan: memory too
        return "ok" if size <= 5 else "infeasible"

    assert find_wall(planned, 1, 4096).largest == 5
    stopped = find_wall(broken, 1, 4096)
    assert (stopped.largest, stopped.smallest_failed, stopped.failed_as) == (4, 8, "error")
    with pytest.raises(ValueError, match="start"):
        find_wall(_fits(3), 0, 8)


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["--memory-limit", "lots"], "--memory-limit"),
        (["--memory-limit", "0"], "--memory-limit"),
        (["--memory-limit", "1GiB", "--strategies", "plain,magic"], "--strategies"),
        (["--memory-limit", "1GiB", "--start", "64", "--most", "8"], "--start"),
        (["--memory-limit", "1GiB", "--layers", "0"], "--layers"),
    ],
)
def test_bad_options_are_named(
    args: list[str], named: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["wall", "--out", str(tmp_path / "o"), *args]) == 2
    assert named in capsys.readouterr().err


def test_no_cgroup_is_said_before_any_point(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    def refused(limit: int, prefix: str = "") -> None:
        raise cgroup.CgroupUnavailable("no memory cgroup can be made here (EPERM); run as root")

    monkeypatch.setattr(command, "memory_cgroup", refused)
    assert cli.main(["wall", "--memory-limit", "1GiB", "--out", str(tmp_path / "o")]) == 2
    assert "run as root" in capsys.readouterr().err
    assert not (tmp_path / "o" / "wall.csv").exists()


def test_auto_inside_a_cap_budgets_a_share_of_what_the_cap_leaves(disk_dir: Path) -> None:
    """Without a budget, auto in a cap plans for CAP_SHARE of the cap less what the process
    holds once the model, gradients and optimizer state exist."""
    cap = rss() + 512 * MIB
    res = run(
        RunSpec(
            strategy="auto", model="mini-gpt", num_layers=2, d_model=64, num_heads=2, seq_len=32,
            batch_size=2, steps=1, warmup=0, vocab_size=128, ssd_dir=str(disk_dir),
            min_bytes=1024, memory_cap_bytes=cap,
        )
    )  # fmt: skip
    assert not res["oom"] and res["plan"] is not None
    budget = res["plan"]["budget_bytes"]
    assert 0 < budget <= CAP_SHARE * 512 * MIB
    assert budget >= CAP_SHARE * (512 - 128) * MIB  # the model and its state (and imports): little
    with pytest.raises(ValueError, match="needs a budget"):
        run(RunSpec(strategy="auto", model="mini-gpt", num_layers=1, d_model=32, num_heads=2))


def test_rounds_measure_again_each_size_two_strategies_train(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--rounds 3: after the search, each size plain and auto both train is measured twice
    more, the strategies in turn (reversed every other round); the summary compares the medians
    of those rounds, without the search's point (plain's, here, from a slow hour)."""
    monkeypatch.setattr(command, "memory_cgroup", lambda limit, prefix="": contextlib.nullcontext())
    ran: list[tuple[str, int]] = []
    speed = {"plain": [1.0, 2.0, 2.0], "auto": [1.8, 1.9, 2.1]}  # plain's first point: slow hour

    def measure(spec: Any, s: str, batch: int, seq: int) -> dict[str, Any]:
        ran.append((s, batch))
        fits = batch <= {"plain": 2, "auto": 8}[s]
        seen = sum(1 for t, b in ran if (t, b) == (s, batch)) - 1
        v = speed[s][seen] if batch == 1 else 1.0
        return {
            "strategy": s, "batch_size": batch, "seq_len": seq, "peak_bytes": 1 << 20,
            "status": "ok" if fits else "oom", "error": None if fits else "killed",
            "samples_per_s": v * batch, "step_time_s": 1 / v,
            "step_time_min_s": 1 / v, "step_time_max_s": 1 / v,
        }  # fmt: skip

    monkeypatch.setattr(command, "measure", measure)
    args = ["wall", "--memory-limit", "1GiB", "--strategies", "plain,auto", "--most", "16"]
    args += ["--rounds", "3", "--no-predict", "--no-plot", "--out", str(tmp_path / "o")]
    assert cli.main(args) == 0
    search = [("plain", b) for b in (1, 2, 4, 3)] + [
        ("auto", b) for b in (1, 2, 4, 8, 16, 12, 10, 9)
    ]
    again = [("auto", 1), ("plain", 1), ("plain", 1), ("auto", 1)]
    again += [("auto", 2), ("plain", 2), ("plain", 2), ("auto", 2)]
    assert ran == search + again
    rows = list(csv.DictReader((tmp_path / "o" / "wall.csv").open()))
    assert [int(r["round"]) for r in rows[-8:]] == [1, 1, 2, 2, 1, 1, 2, 2]
    out = capsys.readouterr().out
    assert "auto at batch 1: 1.00x (0.95-1.05)~ the throughput of plain" in out
    assert "(medians of 2 rounds)" in out  # the search's point left out
    assert json.loads((tmp_path / "o" / "wall.json").read_text())["rounds"] == 3


def test_the_wall_found_for_real_inside_a_cgroup(tmp_path: Path) -> None:
    """plain's batch grows by doubling until the kernel kills a point at the limit: wall.csv
    holds every point (peaks within the limit), wall.json the wall, wall.png the figure."""
    with memory_cgroup(64 * MIB):  # skips where no cgroup can be made
        pass
    out = tmp_path / "wall"
    args = ["wall", "--model", "mini-gpt", "--layers", "6", "--hidden", "128", "--heads", "2"]
    args += ["--seq", "256", "--vocab", "256", "--memory-limit", "340MiB", "--strategies"]
    args += ["plain", "--start", "4", "--most", "512", "--tolerance", "1000", "--steps", "1"]
    args += ["--warmup", "0", "--no-predict", "--out", str(out)]
    assert cli.main(args) == 0
    rows = list(csv.DictReader((out / "wall.csv").open()))
    statuses = [(int(r["batch_size"]), r["status"]) for r in rows]
    assert statuses[-1][1] == "oom" and all(s == "ok" for _, s in statuses[:-1]), statuses
    assert [b for b, _ in statuses] == [4 * 2**k for k in range(len(statuses))]
    assert all(int(r["peak_bytes"]) <= 340 * MIB for r in rows)
    ok = [r for r in rows if r["status"] == "ok"]
    assert ok and all(float(r["samples_per_s"]) > 0 for r in ok)
    doc = json.loads((out / "wall.json").read_text())
    assert doc["walls"]["plain"] == {
        "largest": statuses[-2][0] if len(statuses) > 1 else None,
        "smallest_failed": statuses[-1][0],
        "failed_as": "oom",
    }
    assert (out / "wall.png").stat().st_size > 10_000


def _held_after_forward(selective: bool, recompute: bool) -> int:
    """What a forward of the built-in GPT leaves held for backward: the host cache's live bytes
    after it less before (its tensors are 128 KiB and more, all counted)."""
    import torch

    from offloadd.runtime import host_allocator
    from offloadd.tools.models.build import build_model

    torch.manual_seed(0)
    built = build_model(
        "mini-gpt", num_layers=2, d_model=128, num_heads=2, seq_len=64, vocab_size=128,
        recompute=recompute, selective=selective,
    )  # fmt: skip
    x = torch.randint(0, 128, (8, 65))
    cache = host_allocator.acquire()
    try:
        before = cache.counters().live_bytes
        loss = built.loss(x[:, :-1], x[:, 1:])
        held = cache.counters().live_bytes - before
        loss.backward()
        del loss
    finally:
        host_allocator.release()
    return held


def test_sac_saves_between_recompute_and_plain_and_trains_the_same_bits() -> None:
    """The sac peer: each block checkpointed with its matmuls' and attention's outputs saved,
    so it saves less than plain and more than full recompute; it changes no bit."""
    plain, sac, full = (
        _held_after_forward(False, False),
        _held_after_forward(True, True),
        _held_after_forward(False, True),
    )
    assert full < sac < plain, (full, sac, plain)
    kw = {"model": "mini-gpt", "num_layers": 2, "d_model": 64, "num_heads": 2, "seq_len": 32}
    kw |= {"batch_size": 2, "steps": 2, "warmup": 1, "vocab_size": 128}
    a, b = run(RunSpec(strategy="none", **kw)), run(RunSpec(strategy="sac", **kw))  # type: ignore[arg-type]
    assert a["losses"] == b["losses"] and a["weights_sha256"] == b["weights_sha256"]


@pytest.mark.slow
def test_compile_budget_runs_compiled_under_torchs_memory_budget() -> None:
    """The compile-budget peer: the model compiled whole, torch.compile's partitioner under
    ``COMPILE_MEMORY_BUDGET``; it trains (compiled code, so not the eager run's bits)."""
    import torch._functorch.config as functorch_config

    from offloadd.tools.harness.peers import COMPILE_MEMORY_BUDGET

    was = functorch_config.activation_memory_budget
    try:
        res = run(
            RunSpec(
                strategy="compile-budget", model="mini-gpt", num_layers=1, d_model=32,
                num_heads=2, seq_len=16, batch_size=2, steps=1, warmup=0, vocab_size=64,
            )
        )  # fmt: skip
        assert functorch_config.activation_memory_budget == COMPILE_MEMORY_BUDGET
    finally:
        functorch_config.activation_memory_budget = was
    assert not res["oom"] and res["warmup_steps"] == 2 and len(res["losses"]) == 3


def test_a_points_row_from_each_way_a_run_ends(monkeypatch: pytest.MonkeyPatch) -> None:
    """ok (auto's plan shown), killed by the OOM killer, an allocation failed, auto's planner
    finding no plan, anything else: made-up runs, the row each gives."""
    import contextlib
    from types import SimpleNamespace

    from offloadd.tools.harness.train import RunFailed
    from offloadd.tools.wall import points

    killed = [False]

    @contextlib.contextmanager
    def fake_cgroup(limit: int, prefix: str = ""):  # type: ignore[no-untyped-def]
        yield SimpleNamespace(enter=lambda: None, peak=lambda: 123, oom_killed=lambda: killed[0])

    outcome: list[Any] = []

    def fake_run(spec: RunSpec, **kw: Any) -> dict[str, Any]:
        if isinstance(outcome[0], BaseException):
            raise outcome[0]
        return outcome[0]

    monkeypatch.setattr(points, "memory_cgroup", fake_cgroup)
    monkeypatch.setattr(points, "run_in_subprocess", fake_run)
    w = points.WallSpec(
        model="mini-gpt", layers=1, hidden=8, heads=1, seq=4, vocab=8, batch=1, limit=1 << 30,
        steps=2, warmup=0, ssd_dir=None, point_timeout=None,
    )  # fmt: skip
    plan = {
        "budget_bytes": MIB,
        "blocks": [{"decision": d} for d in ("keep", "offload", "offload")],
    }
    outcome[:] = [{"oom": False, "step_time_s": 0.5, "step_times_s": [0.4, 0.5, 0.7], "losses": [1.0],
                   "weights_sha256": "ab", "plan": plan}]  # fmt: skip
    row = points.measure(w, "auto", 4, 16)
    assert row["status"] == "ok" and row["samples_per_s"] == 8.0 and row["peak_bytes"] == 123
    assert (row["step_time_min_s"], row["step_time_max_s"]) == (0.4, 0.7)
    assert row["plan"] == "k1 o2 r0 in 1.0 MiB"
    killed[0] = True
    outcome[:] = [RunFailed("x", -9, "")]
    assert points.measure(w, "plain", 4, 16)["status"] == "oom"
    killed[0] = False
    outcome[:] = [RunFailed("x", 1, "Traceback\nMemoryError: the model holds more than the cap")]
    assert points.measure(w, "auto", 4, 16)["status"] == "oom"
    outcome[:] = [RunFailed("x", 1, "offloadd.auto.solver.InfeasibleBudget: budget: 5 bytes ...")]
    row = points.measure(w, "auto", 4, 16)
    assert row["status"] == "infeasible" and row["error"].startswith("budget: 5 bytes")
    outcome[:] = [RunFailed("x", 1, "ValueError: something else")]
    row = points.measure(w, "auto", 4, 16)
    assert row["status"] == "error" and row["error"] == "ValueError: something else"


def test_the_gpu_kit_runs_its_cpu_path(tmp_path: Path) -> None:
    """scripts/wall_gpu.py (scripts/gpu_check.sh's wall parts) at toy size on the CPU: the
    config written, the wall run inside cgroups, the page with a row per strategy, so the kit
    works the day a GPU is lent."""
    with memory_cgroup(64 * MIB):  # skips where no cgroup can be made
        pass
    script = Path(__file__).resolve().parents[2] / "scripts" / "wall_gpu.py"
    cmd = [sys.executable, str(script), "--tiny", "--most", "1", "--out", str(tmp_path)]
    proc = subprocess.run(
        [*cmd, "--strategies", "offload-cpu,torchtune-offload"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    config = json.loads((tmp_path / "config" / "config.json").read_text())
    assert config["model_type"] == "llama" and config["num_hidden_layers"] == 2
    page = (tmp_path / "wall.md").read_text()
    assert "| offload-ssd | 1 |" in page  # on the CPU, the host's tier
    assert "torchtune" not in page and "--device" not in page  # no GPU-only peer on the CPU


def test_gpu_only_peers_are_refused_on_the_cpu(tmp_path: Path) -> None:
    p = argparse.ArgumentParser()
    command.add_arguments(p)
    ns = p.parse_args(
        ["--memory-limit", "1GiB", "--strategies", "plain,compile-offload", "--out", str(tmp_path)]
    )
    with pytest.raises(command.UsageError, match=r"compile-offload offloads .* needs a CUDA"):
        command._resolve(ns)
    ns = p.parse_args(["--memory-limit", "1GiB", "--host-memory-limit", "2GiB"])
    with pytest.raises(command.UsageError, match="--host-memory-limit is for --device cuda"):
        command._resolve(ns)
