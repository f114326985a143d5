"""Ranks learnt after ``import torch``: workers of ``torch.multiprocessing.spawn`` under
``OFFLOADD=1`` (offloadd/integrations/ranks.py [the rank when it is known]).

``offloadd_boot`` activates offloadd as a worker imports torch, before the worker sets ``RANK``
or joins its process group; each must still write its own report and offload into its own
per-rank directory.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from offloadd.integrations.autoload import EnvSettings
from offloadd.integrations.ranks import RankInfo, rank_now
from tests._support.envrun import CLIENTS, PYTHON, free_port, offload_env, run, summary_lines

SPAWN = str(CLIENTS / "spawn_train.py")
ENGINE_PARAMS = ("default",)  # the processes under test choose the engine (auto)


@pytest.mark.parametrize(
    "mode", ["env", pytest.param("explicit", marks=pytest.mark.slow)]
)  # explicit: the same path, its rank told by init_process_group(rank=) (unit test below)
def test_spawned_workers_report_and_offload_per_rank(
    disk_dir: Path, tmp_path: Path, mode: str
) -> None:
    """``env``: each worker sets RANK/WORLD_SIZE after ``import torch``, then
    ``init_process_group("gloo")``; ``explicit``: no rank variable, ``init_process_group`` with
    ``rank=``. Two reports, ranks 0 and 1 of 2, in two per-rank directories, and a summary
    line for each rank."""
    env = offload_env(disk_dir, tmp_path / "r-{rank}.json")
    proc = run([PYTHON, SPAWN, mode, free_port()], env)
    assert sorted(json.loads(ln)["rank"] for ln in proc.stdout.splitlines()) == [0, 1]
    lines = sorted(summary_lines(proc.stderr))
    assert [ln.split(":")[0] for ln in lines] == ["offloadd [rank 0/2]", "offloadd [rank 1/2]"]
    reports = {p.name: json.loads(p.read_text()) for p in tmp_path.glob("r-*.json")}
    assert sorted(reports) == ["r-0.json", "r-1.json"], proc.stderr
    for rank in (0, 1):
        data = reports[f"r-{rank}.json"]
        assert (data["rank"], data["world_size"]) == (rank, 2)
        assert data["config"]["ssd_dirs"] == [str(disk_dir / f"rank-{rank}")]
        assert data["stats"]["offloaded_bytes"] > 0 and data["forwards"] == 2


def test_the_rank_is_read_when_asked_for(tmp_path: Path) -> None:
    """Without a process group, the variables as they are when asked (not at activation); the
    report path substitutes the rank it is given, and one without ``{rank}`` is rank 0's."""
    assert rank_now({}) == RankInfo()
    assert (rank_now({"RANK": "1", "WORLD_SIZE": "2"}).rank, rank_now({}).world_size) == (1, 1)
    every = EnvSettings.from_env({"OFFLOADD": "1", "OFFLOADD_REPORT": str(tmp_path / "r-{rank}")})
    assert every.ranks == RankInfo()  # activation: no variable yet
    assert every.report_path(RankInfo(rank=1, world_size=2)) == str(tmp_path / "r-1")
    one = EnvSettings.from_env({"OFFLOADD": "1", "OFFLOADD_REPORT": str(tmp_path / "r")})
    assert one.report_path(RankInfo(rank=1, world_size=2)) is None
    assert one.report_path(RankInfo(rank=0, world_size=2)) == str(tmp_path / "r")


def test_the_summary_line_is_one_write(monkeypatch: pytest.MonkeyPatch) -> None:
    """The ranks of a node share one stderr: the summary and its newline go in one write, or
    another rank's line lands between them (two summaries on one line, one of them lost to a
    reader of lines; seen here in 1 of 12 runs of the spawned workers above)."""
    from offloadd.integrations.autoload import AutoOffload
    from offloadd.offloader import Offloader

    auto = AutoOffload(EnvSettings.from_env({"OFFLOADD": "1", "OFFLOADD_TIER": "keep"}))
    auto.offloader = Offloader(auto.settings.config)
    writes: list[str] = []

    class Stderr:
        def write(self, text: str) -> int:
            writes.append(text)
            return len(text)

        def flush(self) -> None:
            pass

    monkeypatch.setattr(sys, "stderr", Stderr())
    auto.finish()
    assert len(writes) == 1 and writes[0].startswith("offloadd: 0 forwards offloaded"), writes
    assert writes[0].endswith("\n") and writes[0].count("\n") == 1, writes


def test_no_stderr_at_exit_is_no_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """stderr closed (pythonw, a daemonized parent): the exit says nothing and still cleans up."""
    from offloadd.integrations.autoload import AutoOffload
    from offloadd.offloader import Offloader

    auto = AutoOffload(EnvSettings.from_env({"OFFLOADD": "1", "OFFLOADD_TIER": "keep"}))
    auto.offloader = Offloader(auto.settings.config)
    monkeypatch.setattr(sys, "stderr", None)
    auto.finish()
    assert auto._finished and auto.offloader.runtime.closed
