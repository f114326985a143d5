"""Peaks predicted without training (tools/predict/; ``offloadd plan`` without ``--budget``; the
wall's ``predicted_peak_bytes``): the trace sees what torch's allocator is asked for, the host
cache replayed over it gives the real cache's counters to the byte, offloading is traced once per
storage, every architecture of the wall traces, and the wall's peaks measured in a memory cgroup
are within 15 % of the prediction."""

from __future__ import annotations

import csv
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch

from offloadd import cli
from offloadd.runtime import host_allocator
from offloadd.runtime.host_allocator import SLACK
from offloadd.tools.models.build import build_model
from offloadd.tools.predict.hostcache import replay, size_class
from offloadd.tools.predict.live import LiveBytes
from offloadd.tools.predict.peak import predict
from offloadd.tools.predict.report import MOST, Row, largest_batch, recommend
from offloadd.tools.predict.trace import TraceSpec, _offloaded, trace
from offloadd.tools.wall.predicted import behind_a_slow_disk
from tests._support.cgroup import memory_cgroup, slow_writes
from tests._support.helpers import linked_tensors

ENGINE_PARAMS = ("default",)

MIB = 1 << 20
ROOT = Path(__file__).resolve().parents[2]
MINI = {"num_layers": 2, "d_model": 128, "num_heads": 2, "seq_len": 128, "vocab_size": 256}
MINI_SPEC = TraceSpec(model="mini-gpt", layers=2, hidden=128, heads=2, vocab=256)


def _real_counters(strategy: str) -> list[int]:
    """The host cache's peaks (live, and live plus cached) after the harness's steps for real,
    in a fresh process (the counters are the process's): built, then the cache, gradients and
    AdamW's state, then three steps at batch 8."""
    code = "import sys; from tests.tools.test_predict import _train; print(*_train(sys.argv[1]))"
    out = subprocess.run(
        [sys.executable, "-c", code, strategy], capture_output=True, text=True, check=True, cwd=ROOT
    )
    return [int(v) for v in out.stdout.split()[-2:]]


def _train(strategy: str) -> tuple[int, int]:
    torch.manual_seed(0)
    built = build_model(
        "mini-gpt", recompute=strategy != "plain", selective=strategy == "sac", **MINI
    )
    params = list(built.module.parameters())
    cache = host_allocator.acquire()
    try:
        opt = torch.optim.AdamW(params, lr=1e-3)
        for p in params:
            p.grad = torch.zeros_like(p)
        opt.step()
        for _ in range(3):
            x = torch.randint(0, 256, (8, 129))
            loss = built.loss(x[:, :-1], x[:, 1:])
            loss.backward()
            del loss, x
            opt.step()
            opt.zero_grad(set_to_none=False)
        c = cache.counters()
        return c.peak_live_bytes, c.peak_footprint_bytes
    finally:
        host_allocator.release()


@pytest.mark.parametrize("strategy", ["plain", "recompute", "sac"])
def test_the_host_cache_replayed_over_the_trace_gives_the_real_caches_counters(
    strategy: str,
) -> None:
    """The fake run asks for the same storages as the real one, in the same order: replayed
    through the cache's policy, its peaks of live and of live plus cached bytes are the real
    cache's, byte for byte."""
    traced = replay(trace(MINI_SPEC, strategy, 8, 128).events)
    assert [traced.live, traced.footprint] == _real_counters(strategy)


def test_size_classes_are_the_caches() -> None:
    cache = host_allocator.acquire()
    try:
        for n in (128 << 10, (128 << 10) + 1, 300_001, 1 << 20, 5 * MIB + 7, 33 * MIB):
            before = cache.counters().live_bytes
            t = torch.empty(n, dtype=torch.uint8)
            assert cache.counters().live_bytes - before == size_class(n), n
            del t
    finally:
        host_allocator.release()


def test_offloading_is_traced_once_per_storage() -> None:
    """A storage three ops save (two through views) leaves memory after forward and comes back
    once in backward; a parameter's is never moved."""
    live, brought = LiveBytes(), []
    with torch._subclasses.fake_tensor.FakeTensorMode(), live:
        w = torch.nn.Parameter(torch.randn(256, 512))
        x = torch.randn(32, 256)  # saved by the matmul, moved too (min_bytes 0)
        with _offloaded([w], min_bytes=0, brought=brought):
            h = (x @ w).exp()  # 64 KiB, saved by exp, sin and cos (the last two: views)
            loss = h.view(-1).sin().sum() + h.t().cos().sum()
        hbytes = h.untyped_storage().nbytes()
        del h
        held = live.now  # w, x and two scalars: h is away (x too, but the test holds it)
        loss.backward()
    assert held < w.nbytes + x.nbytes + 4096
    assert brought == [hbytes, x.nbytes]


def test_a_trace_dropped_without_backward_frees_what_it_kept() -> None:
    """The trace's pack keeps small tensors and parameters as offloadd does, detached where they
    have a grad_fn: sigmoid saves its own output, which kept with its grad_fn would hold its
    own graph, a cycle no collection frees once the graph is dropped unused."""
    w = torch.nn.Parameter(torch.randn(16, 16))

    before = linked_tensors()
    with _offloaded([w], min_bytes=1 << 20):  # every tensor below min_bytes: kept
        for _ in range(3):
            (torch.randn(4, 16) @ w).sigmoid().relu().sum()  # dropped without a backward
    assert linked_tensors() == before
    with _offloaded([w], min_bytes=0, keeping=lambda: True):  # kept by the plan
        for _ in range(3):
            (torch.randn(4, 16) @ w).sigmoid().relu().sum()
    assert linked_tensors() == before


SMALL = {"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 256, "vocab_size": 512}
SMALL |= {"num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512}


def _config(tmp_path: Path, name: str) -> str:
    tf = pytest.importorskip("transformers")
    made: dict[str, Any] = {
        "gpt2": lambda: tf.GPT2Config(
            n_layer=2, n_embd=64, n_head=4, n_positions=512, vocab_size=512
        ),
        "llama": lambda: tf.LlamaConfig(**SMALL),
        "qwen2": lambda: tf.Qwen2Config(**SMALL),  # Mistral-style: grouped-query attention
        "mixtral": lambda: tf.MixtralConfig(**SMALL, num_local_experts=4, num_experts_per_tok=2),
    }
    d = tmp_path / name
    made[name]().save_pretrained(str(d))
    return str(d)


@pytest.mark.parametrize("name", ["gpt2", "llama", "qwen2", "mixtral"])
def test_each_architecture_traces_and_recompute_and_offload_save(tmp_path: Path, name: str) -> None:
    """GPT-2, Llama, Qwen2 and Mixtral (its experts' grouped matmul stood in for on fake
    tensors): recompute and offloading each trace below plain's peak."""
    spec = TraceSpec(hf_config=_config(tmp_path, name), min_bytes=64 << 10, steps=2)
    peaks = {s: trace(spec, s, 4, 256).peak for s in ("plain", "recompute", "offload")}
    assert peaks["recompute"] < peaks["plain"] and peaks["offload"] < peaks["plain"], peaks


def test_a_compiled_run_is_traced_through_its_partitioner() -> None:
    """compile-budget traces through torch.compile on fake tensors (Note [a compiled run
    traced]): its partitioner keeps part of what plain saves and recomputes the rest, so its
    steps' peak lies between recompute's and plain's; and the trace leaves dynamo as it was."""
    import torch._functorch.config as functorch_config

    spec = dataclasses.replace(MINI_SPEC, steps=1)
    before = functorch_config.activation_memory_budget
    peaks = {s: trace(spec, s, 8, 128).peak for s in ("plain", "recompute", "compile-budget")}
    assert peaks["recompute"] < peaks["compile-budget"] < peaks["plain"], peaks
    assert functorch_config.activation_memory_budget == before


def test_plans_table_says_what_the_compiler_holds_apart() -> None:
    from offloadd.tools.predict.peak import Prediction
    from offloadd.tools.predict.report import render

    def at(compiler: int) -> Prediction:
        return Prediction(
            peak_bytes=(900 + compiler) * MIB, base_bytes=257 * MIB, file_bytes=0,
            weights_bytes=101 * MIB, state_bytes=303 * MIB, steps_bytes=239 * MIB,
            allocator="caching", compiler_bytes=compiler * MIB,
        )  # fmt: skip

    text = render([Row("compile-budget", at(150), None), Row("plain", at(0), None)], 1, 512, None)
    assert "each peak counts 257.0 MiB of interpreter and libraries" in text
    assert "(compile-budget also counts 150.0 MiB that torch.compile holds)" in text


def test_offload_is_predicted_with_room_for_writes_behind_a_slow_disk() -> None:
    """offload-ssd's ``writes_bytes``: the run's ``staging_bytes``, at most what offloading saved
    against plain (none where nothing is offloaded); the strategies that write nothing have
    none; plan's largest batch, its table and its JSON leave the room (Note [writes behind a
    slow disk])."""
    from offloadd.tools.predict.report import predict_rows, render, rows_json

    spec = TraceSpec(model="mini-gpt", layers=2, hidden=64, heads=2, vocab=128, steps=1)
    spec = dataclasses.replace(spec, min_bytes=1024, staging_bytes=MIB // 4)
    plain, ssd = predict(spec, "plain", 2, 64), predict(spec, "offload-ssd", 2, 64)
    assert plain.writes_bytes == 0 and plain.peak_bytes - ssd.peak_bytes > MIB // 4
    assert ssd.writes_bytes == MIB // 4 == ssd.slow_disk_peak_bytes - ssd.peak_bytes
    loose = dataclasses.replace(spec, staging_bytes=1 << 30)  # capped at what offloading saved
    assert predict(loose, "offload-ssd", 2, 64).writes_bytes == plain.peak_bytes - ssd.peak_bytes
    nothing = dataclasses.replace(spec, min_bytes=1 << 30)  # every tensor below min_bytes
    assert predict(nothing, "offload-ssd", 2, 64).writes_bytes == 0
    limit = ssd.peak_bytes + MIB // 8  # fits while the disk keeps up, not behind it
    (row,) = predict_rows(spec, ["offload-ssd"], 2, 64, limit, held=True)
    assert row.largest is not None and row.largest < 2
    assert "(offload-ssd: up to 256.0 KiB more while the disk falls behind its writes" in render(
        [row], 2, 64, limit
    )
    doc = json.loads(rows_json([row], spec, 2, 64, limit))["strategies"]["offload-ssd"]
    assert doc["slow_disk_peak_bytes"] == doc["peak_bytes"] + doc["writes_bytes"] > 0


@pytest.mark.slow
def test_a_compiled_wall_point_is_predicted_within_15_percent(tmp_path: Path) -> None:
    """compile-budget compiled for real by inductor in a memory cgroup, against the prediction
    (the trace, plus what the compiler holds: ``compiler_bytes``)."""
    model = ["--model", "mini-gpt", "--layers", "4", "--hidden", "256", "--heads", "4"]
    model += ["--seq", "256", "--vocab", "512"]
    _within(_wall(tmp_path, model, "compile-budget", 16, "1GiB"), 0.15)


def _wall(tmp_path: Path, model: list[str], strategies: str, batch: int, limit: str) -> list[Any]:
    with memory_cgroup(64 * MIB):  # skips where no cgroup can be made
        pass
    out = tmp_path / "wall"
    args = ["wall", *model, "--memory-limit", limit, "--strategies", strategies]
    args += ["--start", str(batch), "--most", str(batch), "--steps", "1", "--warmup", "1"]
    args += ["--no-plot", "--out", str(out)]
    assert cli.main(args) == 0
    return list(csv.DictReader((out / "wall.csv").open()))


def _within(rows: list[Any], share: float) -> None:
    """Each point within ``share`` of its predicted peak or, above it, of its slow-disk peak
    (Note [writes behind a slow disk] in tools/predict/peak.py); offload-ssd alone has one."""
    ok = [r for r in rows if r["status"] == "ok"]
    assert len(ok) == len(rows), rows
    for r in ok:
        slow = int(r["predicted_slow_disk_peak_bytes"] or 0)
        assert bool(slow) == (r["strategy"] == "offload-ssd"), r
        point = {**r, "peak_bytes": int(r["peak_bytes"]), "predicted_slow_disk_peak_bytes": slow}
        point["predicted_peak_bytes"] = int(r["predicted_peak_bytes"])
        off = point["predicted_peak_bytes"] / point["peak_bytes"] - 1
        assert abs(off) <= share or behind_a_slow_disk(point, share), (r["strategy"], off, slow)


def test_the_walls_peaks_are_predicted_within_15_percent(tmp_path: Path) -> None:
    """Measured in a memory cgroup of its own, each point's peak (the interpreter, torch, the
    model, its state and the steps) against the prediction beside it in wall.csv."""
    model = ["--model", "mini-gpt", "--layers", "4", "--hidden", "256", "--heads", "4"]
    model += ["--seq", "256", "--vocab", "512"]
    _within(_wall(tmp_path, model, "plain,offload-ssd", 16, "1GiB"), 0.15)


def test_a_slow_disk_holds_what_its_prediction_leaves_room_for(tmp_path: Path) -> None:
    """offload-ssd's writes throttled for real (a cgroup's limit on the disk): the peak rises by
    the ``staging_bytes`` of writes held behind the disk, and meets the slow-disk prediction
    (Note [writes behind a slow disk] in tools/predict/peak.py)."""
    with memory_cgroup(64 * MIB):  # skips where no cgroup can be made
        pass
    staging = 128 * MIB
    out = tmp_path / "wall"
    args = [sys.executable, "-m", "offloadd", "wall", "--model", "mini-gpt", "--layers", "4"]
    args += ["--hidden", "256", "--heads", "4", "--seq", "256", "--vocab", "512"]
    args += ["--memory-limit", "1GiB", "--strategies", "offload-ssd", "--start", "8"]
    args += ["--most", "8", "--steps", "1", "--warmup", "1", "--no-plot", "--out", str(out)]
    args += ["--ssd-dir", str(tmp_path / "ssd")]
    env = {**os.environ, "OFFLOADD_STAGING_BYTES": str(staging)}
    with slow_writes(tmp_path, 64 * MIB) as procs:
        done = subprocess.run(
            args,
            env=env,
            preexec_fn=lambda: procs.write_text(str(os.getpid())),
            capture_output=True,
            text=True,
            timeout=300,
        )
    assert done.returncode == 0, done.stderr[-3000:]
    (r,) = csv.DictReader((out / "wall.csv").open())
    assert r["status"] == "ok", r
    peak, ideal = int(r["peak_bytes"]), int(r["predicted_peak_bytes"])
    slow = int(r["predicted_slow_disk_peak_bytes"])
    assert ideal < slow <= ideal + staging  # at most what offloading saved against plain
    assert peak - ideal > staging // 2, (peak, ideal)  # the writes were held
    assert abs(slow / peak - 1) <= 0.05, (peak, slow)
    assert "within the slow-disk peak" in done.stdout


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt2", "llama", "qwen2", "mixtral"])
def test_each_architectures_wall_is_predicted_within_15_percent(tmp_path: Path, name: str) -> None:
    model = ["--hf-config", _config(tmp_path, name), "--seq", "512"]
    _within(_wall(tmp_path, model, "plain,recompute,sac,offload-ssd", 16, "2GiB"), 0.15)


def test_plan_predicts_each_strategy_and_its_largest_batch(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = _config(tmp_path, "llama")
    out = tmp_path / "plan.json"
    args = ["plan", "--hf-config", cfg, "--seq", "512", "--batch", "8"]
    args += ["--strategies", "plain,recompute"]
    assert cli.main([*args, "--memory-limit", "400MiB", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "largest batch in 400.0 MiB" in printed and "recommended:" in printed
    doc = json.loads(out.read_text())
    rows = doc["strategies"]
    assert list(rows) == ["plain", "recompute"]
    assert all(r["peak_bytes"] > r["base_bytes"] + r["weights_bytes"] for r in rows.values())
    assert rows["recompute"]["peak_bytes"] < rows["plain"]["peak_bytes"]
    largest = {s: r["largest_batch"] for s, r in rows.items()}
    assert largest["recompute"] > largest["plain"] >= 1, largest
    n = largest["plain"]  # it fits, and the next batch does not, as predicted
    spec = TraceSpec(**doc["spec"])
    assert predict(spec, "plain", n, 512).peak_bytes <= 400 * MIB
    assert predict(spec, "plain", n + 1, 512).peak_bytes > 400 * MIB
    assert doc["recommendation"]["advice"]


def test_plan_names_what_it_cannot_predict(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["plan", "--strategies", "compile-offload"]) == 2
    assert "--strategies must list names from plain" in capsys.readouterr().err
    assert cli.main(["plan", "--strategies", "auto,auto"]) == 2
    assert "--strategies auto needs --memory-limit" in capsys.readouterr().err
    assert cli.main(["plan", "--hidden", "100", "--heads", "3"]) == 2
    assert "--heads (3) must divide --hidden (100)" in capsys.readouterr().err
    assert cli.main(["plan", "--memory-limit", "lots"]) == 2
    assert "--memory-limit" in capsys.readouterr().err
    cfg = _config(tmp_path, "gpt2")
    assert cli.main(["plan", "--hf-config", cfg, "--budget", "1GiB"]) == 2
    assert "--budget plans the built-in models" in capsys.readouterr().err
    assert cli.main(["plan", "--hf-config", cfg, "--seq", "4096"]) == 2
    assert "max_position_embeddings (512)" in capsys.readouterr().err


def test_a_plan_is_traced_keeping_what_it_keeps() -> None:
    """auto's plan in a trace: keeping more units never holds less in a step; keeping every
    unit holds what plain holds; a plan is one decision per block and one for the head."""
    plain = replay(trace(MINI_SPEC, "plain", 8, 128).events, before=("build", "state"))
    lives = []
    for n in range(4):  # two blocks and the head
        kept = tuple(k > 2 - n for k in range(3))
        lives.append(replay(trace(MINI_SPEC, "offload", 8, 128, kept=kept).events).step_live)
    assert lives == sorted(lives) and lives[0] < lives[-1]
    assert lives[-1] == plain.step_live
    with pytest.raises(ValueError, match="3 decisions here, not 2"):
        trace(MINI_SPEC, "offload", 8, 128, kept=(True, False))
    with pytest.raises(ValueError, match="offload only"):
        trace(MINI_SPEC, "plain", 8, 128, kept=(True, True, True))


def test_auto_inside_a_limit_is_predicted_with_the_plan_its_planner_makes() -> None:
    """Where the budget holds every unit, plain's steps; where it holds none, offloading every
    block plus the writes in flight the budget leaves room for; in between, as many kept
    blocks as the planner's reckoning fits."""
    from offloadd.tools.harness.train import CAP_SHARE
    from offloadd.tools.predict import peak

    p = peak.predict(MINI_SPEC, "plain", 8, 128)
    rss = p.base_bytes + p.file_bytes + p.weights_bytes + p.state_bytes
    lives = [peak._planned(MINI_SPEC, 8, 128, n)[0] for n in range(4)]
    budgets = {"roomy": lives[3], "one block": (lives[0] + lives[3]) // 2, "none": 0}
    got = {}
    for name, budget in budgets.items():
        limit = rss + int((budget + 1) / CAP_SHARE)
        assert peak.cap_budget(p, limit) == budget
        got[name] = peak.predict_auto(MINI_SPEC, 8, 128, limit).peak_bytes - p.base_bytes
    assert got["roomy"] == peak._planned(MINI_SPEC, 8, 128, 3)[2].resident
    # the head and one block kept, the writes in flight filling what the budget leaves
    writes = budgets["one block"] - lives[2]
    one = peak._planned(MINI_SPEC, 8, 128, 2)[2].resident + int(writes * (1 + SLACK))
    assert got["one block"] == one
    assert got["none"] == peak._planned(MINI_SPEC, 8, 128, 1)[2].resident


@pytest.mark.slow
@pytest.mark.parametrize("limit", ["1GiB", "700MiB"])
def test_autos_wall_points_are_predicted_within_15_percent(tmp_path: Path, limit: str) -> None:
    """auto in a memory cgroup, its warm-up, profile and race included: at 1 GiB it keeps every
    block; at 700 MiB it offloads."""
    model = ["--model", "mini-gpt", "--layers", "4", "--hidden", "256", "--heads", "4"]
    model += ["--seq", "256", "--vocab", "512"]
    _within(_wall(tmp_path, model, "auto", 16, limit), 0.15)


@pytest.mark.parametrize("wall", [0, 1, 2, 3, 17, 1000])
@pytest.mark.parametrize("shape", ["linear", "sublinear", "superlinear"])
def test_the_largest_batch_is_found_from_a_few_peaks(wall: int, shape: str) -> None:
    grow = {"linear": lambda b: b, "sublinear": lambda b: b**0.5, "superlinear": lambda b: b**2}
    asked: list[int] = []

    def peak_of(batch: int) -> int:
        asked.append(batch)
        return int(1000 + 100 * grow[shape](batch))

    limit = peak_of(wall) if wall else 1000
    assert largest_batch(peak_of, limit) == wall
    assert largest_batch(peak_of, 1 << 40) == MOST
    assert len(set(asked)) < 64


def test_the_recommended_config_loads() -> None:
    from offloadd.config import Config
    from offloadd.tools.predict.peak import Prediction

    def row(name: str, peak: int) -> Row:
        return Row(
            name, Prediction(peak, 300 * MIB, 90 * MIB, 100 * MIB, 300 * MIB, 0, "caching"), 4
        )

    limit = 2 << 30
    advice, toml = recommend([row("plain", 3 << 30), row("offload-ssd", 1 << 30)], 8, limit)
    assert "tier ssd with a budget" in advice
    path = Path(tempfile.mkdtemp()) / "offload.toml"
    path.write_text(toml)
    cfg = Config.load(path, environ={})
    assert cfg.tier == "ssd" and 0 < cfg.budget < limit
    advice, toml = recommend([row("plain", 1 << 30), row("offload-ssd", 1 << 29)], 8, limit)
    assert "no offloading needed" in advice and not toml
    advice, toml = recommend([row("plain", 3 << 30), row("offload-ssd", 3 << 30)], 8, limit)
    assert "does not fit" in advice and not toml


def test_tier_cpu_moves_nothing_on_a_cpu_machine_and_is_predicted_as_plain() -> None:
    from offloadd.tools.predict.peak import allocator_of, traced_as

    assert traced_as("offload-cpu") == traced_as("plain") == "plain"
    assert traced_as("offload-ssd") == "offload" and traced_as("compile-offload") is None
    assert allocator_of("plain", held=False) == "system"
    assert allocator_of("offload-ssd", held=False) == allocator_of("plain", held=True) == "caching"
