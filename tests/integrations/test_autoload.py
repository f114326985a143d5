"""Activation by environment: settings, the start-up hook, a plain client and ``offloadd run``.

Every client runs as a real interpreter started with and without ``OFFLOADD=1``.
"""

from __future__ import annotations

import json
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

import offloadd_boot
from offloadd.integrations.autoload import EnvSettings
from offloadd.integrations.ranks import rank_info
from offloadd.units import format_bytes
from tests._support.envrun import (
    CLIENTS,
    PYTHON,
    clean_env,
    last_json,
    offload_env,
    run,
    same_as_plain,
    summary_lines,
)

PLAIN = str(CLIENTS / "plain_train.py")
ENGINE_PARAMS = ("default",)  # the processes under test choose the engine (auto)


# -- settings -------------------------------------------------------------------------------


def test_settings_read_every_variable(disk_dir: Path) -> None:
    s = EnvSettings.from_env(
        {
            "OFFLOADD": "1",
            "OFFLOADD_SSD_DIRS": str(disk_dir),
            "OFFLOADD_MIN_BYTES": "4MiB",
            "OFFLOADD_REPORT": str(disk_dir / "r{rank}.json"),
            "OFFLOADD_LOG": "INFO",
            "RANK": "3",
            "WORLD_SIZE": "4",
            "LOCAL_RANK": "1",
        }
    )
    assert s.enabled and s.config.min_bytes == 4 << 20 and s.config.ssd_dirs == (str(disk_dir),)
    assert s.report == str(disk_dir / "r3.json") and s.report_every_rank
    assert (s.ranks.rank, s.ranks.world_size, s.ranks.local_rank) == (3, 4, 1)
    assert s.log_level == "info"


@pytest.mark.parametrize(
    ("env", "named"),
    [
        ({"OFFLOADD": "2"}, "OFFLOADD must be"),
        ({"OFFLOADD": "1", "OFFLOADD_MIN_BYTE": "4"}, "OFFLOADD_MIN_BYTE='4'"),
        ({"OFFLOADD": "1", "OFFLOADD_MIN_BYTES": "lots"}, "OFFLOADD_MIN_BYTES"),
        ({"OFFLOADD": "1", "OFFLOADD_TIER": "disk"}, "OFFLOADD_TIER"),
        ({"OFFLOADD": "1", "OFFLOADD_SSD_DIRS": "/nonexistent/x"}, "'/nonexistent/x'"),
        ({"OFFLOADD": "1", "OFFLOADD_CONFIG": "/nonexistent.toml"}, "/nonexistent.toml"),
        ({"OFFLOADD": "1", "OFFLOADD_REPORT": "/nonexistent/r.json"}, "OFFLOADD_REPORT"),
        ({"OFFLOADD": "1", "OFFLOADD_LOG": "loud"}, "OFFLOADD_LOG"),
        ({"OFFLOADD": "1", "RANK": "x"}, "RANK"),
        ({"OFFLOADD": "1", "RANK": "4", "WORLD_SIZE": "4"}, "RANK=4"),
    ],
)
def test_bad_settings_name_the_variable(env: dict[str, str], named: str) -> None:
    with pytest.raises(ValueError, match=named.replace("(", r"\(")):
        EnvSettings.from_env(env)


def test_switches(tmp_path: Path) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text('tier = "keep"\n')
    assert offloadd_boot.enabled({"OFFLOADD_CONFIG": str(cfg)})
    assert EnvSettings.from_env({"OFFLOADD_CONFIG": str(cfg)}).config.tier == "keep"
    for off in ("0", "false", "No", "off", ""):
        assert not offloadd_boot.enabled({"OFFLOADD": off, "OFFLOADD_CONFIG": str(cfg)})
        assert not EnvSettings.from_env({"OFFLOADD": off}).enabled
    assert not offloadd_boot.enabled({})


def test_rank_variables_of_launchers() -> None:
    assert rank_info({}).world_size == 1
    r = rank_info({"OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_SIZE": "8"})
    assert (r.rank, r.world_size, r.source) == (5, 8, "OMPI_COMM_WORLD_RANK")
    r = rank_info({"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "RANK": "0", "WORLD_SIZE": "2"})
    assert r.source == "RANK" and r.rank == 0  # torchrun inside a Slurm step: torchrun's rank
    assert rank_info({"PMI_RANK": "2", "PMI_SIZE": "3"}).label() == "rank 2/3"


# -- the start-up hook ----------------------------------------------------------------------


def _modules_at_start(env: dict[str, str]) -> list[str]:
    code = (
        "import sys, json; print(json.dumps(sorted(m for m in sys.modules "
        "if m.startswith(('offloadd', 'torch')) or m == 'numpy')))"
    )
    out = run([PYTHON, "-c", code], env)
    return list(json.loads(out.stdout))


def test_pth_is_installed_in_site_packages() -> None:
    purelib = Path(sysconfig.get_paths()["purelib"])
    pth = purelib / "offloadd.pth"
    assert pth.is_file(), f"{pth} missing: reinstall offloadd (pip install . or -e .)"
    assert pth.read_text() == offloadd_boot.PTH_LINE


def test_startup_without_offloadd_imports_nothing() -> None:
    assert _modules_at_start(clean_env()) == []
    # Switched on, start-up only installs the import hook: no torch, no offloadd package.
    assert _modules_at_start(clean_env(OFFLOADD="1")) == ["offloadd_boot"]
    # Switched off explicitly: the .pth line imports the small hook module, which does nothing.
    assert _modules_at_start(clean_env(OFFLOADD="0")) == ["offloadd_boot"]


def test_activation_is_lazy_and_idempotent() -> None:
    code = """
import site, sys, sysconfig
import offloadd_boot
site.addsitedir(sysconfig.get_paths()["purelib"])  # the .pth line runs a second time
offloadd_boot.install()
watchers = [f for f in sys.meta_path if type(f).__name__ == "_TorchWatcher"]
assert len(watchers) == 1, watchers
assert "offloadd.integrations.autoload" not in sys.modules
import torch
from offloadd.integrations import autoload
state = autoload.current()
assert state is not None and autoload.activate() is state
assert not any(type(f).__name__ == "_TorchWatcher" for f in sys.meta_path)
assert torch.__spec__.loader.__class__.__name__ != "_ActivatingLoader"
import importlib.resources
assert importlib.resources.files("torch").joinpath("__init__.py").is_file()
hooks = torch.nn.modules.module._global_forward_pre_hooks
assert len(hooks) == 1, hooks
print("ok")
"""
    out = run([PYTHON, "-c", code], clean_env(OFFLOADD="1"))
    assert out.stdout.strip() == "ok"
    assert summary_lines(out.stderr) == []  # no training forward: no summary


def test_offloading_imports_no_compiler(disk_dir: Path, tmp_path: Path) -> None:
    """A training step under ``OFFLOADD=1`` imports neither dynamo (about 0.9 s a process) nor
    ``torch.distributed.nn``: which of torch 2.13's two gloo teardown faults a DDP script meets
    depends on whether that module was imported before its group started (see [gloo's
    teardown] in test_clients.py). offloadd must not decide that for the script."""
    code = """
import sys, torch
from torch import nn
import offloadd, offloadd.auto, offloadd.relay  # every plug-in, imported whole
model = nn.Sequential(nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 256))
model(torch.randn(64, 256)).square().mean().backward()
from offloadd.integrations import autoload
assert autoload.current().offloader is not None
print(sorted(m for m in ("torch._dynamo", "torch.distributed.nn") if m in sys.modules))
"""
    out = run([PYTHON, "-c", code], offload_env(disk_dir, tmp_path / "r.json"))
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_compiled_model_offloads_unwarned(disk_dir: Path, tmp_path: Path) -> None:
    """``torch.compile(model)`` under ``OFFLOADD=1``: trained and offloaded, warnings as
    errors (the global hooks' warning, see [compile's warning] in scope.py)."""
    code = """
import warnings, torch
from torch import nn
warnings.simplefilter("error")
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 256))
run = torch.compile(model, backend="aot_eager")
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(3):
    run(torch.randn(64, 256)).square().mean().backward()
    opt.step()
    opt.zero_grad()
print("ok")
"""
    report = tmp_path / "r.json"
    out = run([PYTHON, "-c", code], offload_env(disk_dir, report))
    assert out.stdout.strip() == "ok", out.stderr
    assert json.loads(report.read_text())["stats"]["offloaded_bytes"] > 0


def test_bad_variable_fails_import_torch_naming_it() -> None:
    env = clean_env(OFFLOADD="1", OFFLOADD_MIN_BYTE="4")
    proc = subprocess.run([PYTHON, PLAIN, "1"], env=env, capture_output=True, text=True)
    assert proc.returncode != 0
    assert "OFFLOADD_MIN_BYTE='4'" in proc.stderr and "import torch" in proc.stderr
    assert proc.stdout == ""  # failed at import, not deep inside a forward


# -- a plain client -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def plain_baseline() -> dict[str, object]:
    """The plain client's losses and weights without offloadd (2 steps)."""
    return last_json(run([PYTHON, PLAIN, "2"], clean_env()).stdout)


def test_plain_script_is_identical_and_offloads(
    disk_dir: Path, tmp_path: Path, plain_baseline: dict[str, object]
) -> None:
    base = plain_baseline
    report = tmp_path / "report.json"
    proc = run([PYTHON, PLAIN, "2"], offload_env(disk_dir, report))
    same_as_plain(last_json(proc.stdout), base, [PYTHON, PLAIN, "2"])  # losses, final weights
    data = json.loads(report.read_text())
    assert data["stats"]["offloaded_bytes"] > 0 and data["stats"]["bytes_read"] > 0
    assert data["forwards"] == 4  # 2 steps x 2 micro-batches; eval and torch.func untouched
    assert data["rank"] == 0 and data["config"]["ssd_dirs"] == [str(disk_dir)]
    (line,) = summary_lines(proc.stderr)
    assert line.startswith("offloadd: 4 forwards offloaded")


@pytest.fixture(scope="module")
def plain_baseline_4() -> dict[str, object]:
    """The plain client's losses and weights without offloadd (4 steps: planned steps too)."""
    return last_json(run([PYTHON, PLAIN, "4"], clean_env()).stdout)


@pytest.mark.parametrize("budget", ["0.6x", "100x"])
def test_plain_script_under_a_budget_is_identical(
    disk_dir: Path, tmp_path: Path, plain_baseline_4: dict[str, object], budget: str
) -> None:
    """OFFLOADD_BUDGET in an unmodified script (gradient accumulation, dropout, eval and
    torch.func calls): planned per block, and still bit-identical."""
    report = tmp_path / "report.json"
    env = offload_env(disk_dir, report, OFFLOADD_BUDGET=budget, OFFLOADD_LOG="INFO")
    proc = run([PYTHON, PLAIN, "4"], env)
    same_as_plain(last_json(proc.stdout), plain_baseline_4, [PYTHON, PLAIN, "4"])
    plan = json.loads(report.read_text())["plan"]
    assert [b["name"] for b in plan["blocks"]] == ["layers.0", "layers.1", "(after the blocks)"]
    assert plan["predicted_peak_bytes"] <= plan["budget_bytes"]
    if budget == "100x":  # keeping all fits (4 steps end within the race against offloading
        # every block, [race] in auto/race.py: the report has the plan, not the contender)
        assert {b["decision"] for b in plan["blocks"]} == {"keep"} and plan["race_s"] is None
    assert "plan for a budget of" in proc.stderr
    (line,) = summary_lines(proc.stderr)  # the end-of-run line names the budget and its plan
    counts = " ".join(
        f"{d[0]}{[b['decision'] for b in plan['blocks']].count(d)}"
        for d in ("keep", "offload", "recompute")
    )
    assert f"; budget {format_bytes(plan['budget_bytes'])}: plan {counts} " in line, line
    totals, peaks = line.split("; totals: ")[1].split("; peaks: ")  # totals apart from peaks
    assert "written" in totals and "peak" not in totals and "resident" in peaks


def test_forked_child_is_silent(disk_dir: Path, tmp_path: Path) -> None:
    code = """
import os, torch
torch.set_num_threads(1)  # an OpenMP pool used before fork() hangs the child, offloadd or not
model = torch.nn.Linear(256, 256)
model(torch.randn(64, 256)).sum().backward()
pid = os.fork()
if pid == 0:
    model(torch.randn(64, 256)).sum()  # the inherited hooks are off here
    raise SystemExit(0)  # a normal exit, so atexit handlers run
os.waitpid(pid, 0)
"""
    proc = run([PYTHON, "-c", code], offload_env(disk_dir, tmp_path / "r.json"), timeout=60)
    lines = summary_lines(proc.stderr)
    assert len(lines) == 1 and lines[0].startswith("offloadd: 1 forwards offloaded")


# -- offloadd run ---------------------------------------------------------------------------


def _offloadd() -> list[str]:
    return [PYTHON, "-m", "offloadd"]


def test_run_wrapper_matches_env_var(
    disk_dir: Path, tmp_path: Path, plain_baseline: dict[str, object]
) -> None:
    base = plain_baseline
    cfg = tmp_path / "offload.toml"
    cfg.write_text(f'ssd_dirs = ["{disk_dir}"]\nmin_bytes = "16KiB"\nchunk_bytes = "256KiB"\n')
    report = tmp_path / "run.json"
    cmd = [
        *_offloadd(),
        "run",
        "--config",
        str(cfg),
        "--report",
        str(report),
        "--",
        PYTHON,
        PLAIN,
        "2",
    ]
    proc = run(cmd, clean_env(OFFLOADD_LOG="info"))
    same_as_plain(last_json(proc.stdout), base, [PYTHON, PLAIN, "2"])
    assert f"INFO offloadd: active, tier ssd, dirs {disk_dir}" in proc.stderr
    assert json.loads(report.read_text())["stats"]["offloaded_bytes"] > 0


def test_run_wrapper_with_a_daemon(
    disk_dir: Path, tmp_path: Path, plain_baseline: dict[str, object]
) -> None:
    """``offloadd run --daemon``: a real daemon for the command's lifetime does the I/O."""
    report = tmp_path / "run.json"
    env = clean_env(OFFLOADD_SSD_DIRS=str(disk_dir), OFFLOADD_MIN_BYTES="16KiB")
    cmd = [*_offloadd(), "run", "--daemon", "--report", str(report), "--", PYTHON, PLAIN, "2"]
    proc = run(cmd, env)
    same_as_plain(last_json(proc.stdout), plain_baseline, [PYTHON, PLAIN, "2"])
    stats = json.loads(report.read_text())["stats"]
    assert stats["engine"] == "daemon" and stats["offloaded_bytes"] > 0
    assert not list(disk_dir.iterdir())  # the daemon was stopped and left nothing


def test_run_wrapper_errors() -> None:
    def status(*args: str) -> tuple[int, str]:
        p = subprocess.run(
            [*_offloadd(), "run", *args], env=clean_env(), capture_output=True, text=True
        )
        return p.returncode, p.stderr

    code, err = status("--daemon", "--", "true")
    assert code == 0, err  # a daemon was started for `true`, and stopped
    bad = {"OFFLOADD_SSD_DIRS": "/proc"}  # exists, so only the daemon finds it unusable
    p = subprocess.run(
        [*_offloadd(), "run", "--daemon", "--", "true"],
        env=clean_env(**bad),
        capture_output=True,
        text=True,
    )
    assert p.returncode == 2 and "--daemon: the daemon exited" in p.stderr and "/proc" in p.stderr
    code, err = status("--config", "/nonexistent.toml", "--", "true")
    assert code == 2 and "/nonexistent.toml" in err
    code, err = status()
    assert code == 2 and "no command given" in err
    code, err = status("--", "/nonexistent-command")
    assert code == 2 and "cannot run '/nonexistent-command'" in err
    code, _ = status("--", sys.executable, "-c", "raise SystemExit(7)")
    assert code == 7


def test_run_bootstraps_without_pth_and_chains_sitecustomize(tmp_path: Path) -> None:
    """An interpreter whose site-packages lacks offloadd.pth still activates under
    ``offloadd run``, and an existing sitecustomize still runs."""
    bare = tmp_path / "bare"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(bare)], check=True)
    user = tmp_path / "user"
    user.mkdir()
    (user / "sitecustomize.py").write_text("import os\nos.environ['USER_SITECUSTOMIZE'] = 'ran'\n")
    probe = (
        "import os, sys; w = [type(f).__name__ for f in sys.meta_path]; "
        "print(os.environ.get('USER_SITECUSTOMIZE'), '_TorchWatcher' in w, 'torch' in sys.modules)"
    )
    py = str(bare / "bin" / "python")
    env = clean_env(PYTHONPATH=str(user))
    assert run([py, "-c", probe], env).stdout.split() == ["ran", "False", "False"]
    out = run([*_offloadd(), "run", "--", py, "-c", probe], env).stdout
    assert out.split() == ["ran", "True", "False"]
