"""Every directory named on a subcommand's command line is ready before the subcommand works.

One rule (Note [directories of the command line] in offloadd/cli_dirs.py): a missing directory is
created, like ``mkdir -p -m 0700``; one that cannot be made a writable directory stops the
command with status 2 and a message naming the option, before any work.
Each subcommand runs in this process with its first real step (a point measured, a model built,
a run started, the daemon started, the command executed) replaced by one that records what it
found and stops: nothing is measured, so the whole file takes a second or two.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from pathlib import Path

import pytest

from offloadd import cli

TINY = ["--layers", "2", "--hidden", "64", "--heads", "2", "--seq", "64", "--device", "cpu"]
MODEL = ["--layers", "1", "--d-model", "64", "--heads", "2", "--seq", "16", "--batch", "1"]

Argv = Callable[[Path, Path], list[str]]
"""(the path given to the option under test, an existing directory for the others) -> argv."""

CASES: list[tuple[str, str, Argv, str, str]] = [
    # (id, option, argv, module, attribute of its first real step); the option names a
    # directory, or a file whose directory is the one under test (its name ends the path)
    (
        "rok",
        "--ssd-dir",
        lambda p, d: [
            "rok",
            *TINY,
            "--strategies",
            "keep,recompute,auto",
            "--no-plot",
            "--ssd-dir",
            str(p),
            "--out",
            str(d / "out"),
        ],
        "offloadd.tools.rok.command",
        "measure",
    ),
    (
        "rok",
        "--out",
        lambda p, d: ["rok", *TINY, "--no-plot", "--out", str(p)],
        "offloadd.tools.rok.command",
        "measure",
    ),
    (
        "plan",
        "--ssd-dir",
        lambda p, d: ["plan", "--budget", "0.5x", "--ssd-dir", str(p)],
        "offloadd.tools.plan",
        "build_model",
    ),
    (
        "plan",
        "--json",
        lambda p, d: ["plan", "--budget", "0.5x", "--ssd-dir", str(d), "--json", f"{p}/p.json"],
        "offloadd.tools.plan",
        "build_model",
    ),
    (
        "bench-step",
        "--ssd-dir",
        lambda p, d: ["bench", "step", *MODEL, "--ssd-dir", str(p)],
        "offloadd.tools.bench.step",
        "run_in_subprocess",
    ),
    (
        "bench-step",
        "--out",
        lambda p, d: ["bench", "step", *MODEL, "--ssd-dir", str(d), "--out", f"{p}/r.md"],
        "offloadd.tools.bench.step",
        "run_in_subprocess",
    ),
    (
        "bench-memsave",
        "--ssd-dir",
        lambda p, d: ["bench", "memsave", "--ssd-dir", str(p)],
        "offloadd.tools.bench.memsave",
        "run_scenario",
    ),
    (
        "bench-memsave",
        "--out",
        lambda p, d: ["bench", "memsave", "--ssd-dir", str(d), "--out", f"{p}/r.md"],
        "offloadd.tools.bench.memsave",
        "run_scenario",
    ),
    (
        "bench-io",
        "--dir",
        lambda p, d: ["bench", "io", "--no-fio", "--dir", str(d), "--dir", str(p)],
        "offloadd.tools.bench.io",
        "run_bench",
    ),
    (
        "bench-io",
        "--json",
        lambda p, d: ["bench", "io", "--no-fio", "--dir", str(d), "--json", f"{p}/r.json"],
        "offloadd.tools.bench.io",
        "run_bench",
    ),
    (
        "demo",
        "--ssd-dir",
        lambda p, d: ["demo", *MODEL, "--device", "cpu", "--ssd-dir", str(p)],
        "offloadd.tools.demo_wall",  # the wall, the default: with or without a cgroup
        "measure",
    ),
    (
        "demo-full",
        "--ssd-dir",
        lambda p, d: ["demo", "--full", *MODEL, "--device", "cpu", "--ssd-dir", str(p)],
        "offloadd.tools.demo",
        "run_in_subprocess",
    ),
    (
        "serve",
        "--dir",
        lambda p, d: ["serve", "--socket", f"{d}/d.sock", "--dir", str(p)],
        "offloadd.daemon.core",
        "serve",
    ),
    (
        "serve",
        "--socket",
        lambda p, d: ["serve", "--dir", str(d), "--socket", f"{p}/d.sock"],
        "offloadd.daemon.core",
        "serve",
    ),
    (
        "run",
        "--report",
        lambda p, d: ["run", "--report", f"{p}/r.json", "--", "true"],
        "os",
        "execvpe",
    ),
]
IDS = [f"{c[0]} {c[1]}" for c in CASES]


class Reached(Exception):
    """The subcommand got to its first real step."""


@pytest.fixture(autouse=True)
def _no_offloadd_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in [v for v in os.environ if v.startswith("OFFLOADD")]:
        monkeypatch.delenv(var)


def _stop_at_work(
    monkeypatch: pytest.MonkeyPatch, module: str, attr: str, look: Path | None = None
) -> list[bool]:
    """Replace the first real step by one that stops; the list gets an entry each time it is
    reached: whether ``look`` was a directory then (True without one)."""
    reached: list[bool] = []

    def first_step(*args: object, **kwargs: object) -> None:
        reached.append(look is None or look.is_dir())
        raise Reached

    monkeypatch.setattr(f"{module}.{attr}", first_step)
    return reached


@pytest.mark.parametrize(("command", "option", "argv", "module", "attr"), CASES, ids=IDS)
def test_a_missing_directory_is_created_0700_before_any_work(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    command: str,
    option: str,
    argv: Argv,
    module: str,
    attr: str,
) -> None:
    if command == "bench-memsave":
        pytest.importorskip("transformers")
    missing = tmp_path / "new" / "dir"
    reached = _stop_at_work(monkeypatch, module, attr, look=missing)
    with pytest.raises(Reached):
        cli.main(argv(missing, tmp_path))
    assert reached == [True], f"{option} {missing} did not exist when the work began"
    assert stat.S_IMODE(missing.stat().st_mode) == 0o700, oct(missing.stat().st_mode)
    # the directory above, as mkdir -p makes it: the umask's mode (passable by a daemon's
    # allowed_uids on the way to its socket)
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(missing.parent.stat().st_mode) == 0o777 & ~umask


@pytest.mark.parametrize(("command", "option", "argv", "module", "attr"), CASES, ids=IDS)
def test_a_directory_that_cannot_be_made_stops_the_command_naming_the_option(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    command: str,
    option: str,
    argv: Argv,
    module: str,
    attr: str,
) -> None:
    if command == "bench-memsave":
        pytest.importorskip("transformers")
    blocker = tmp_path / "a-file"
    blocker.write_text("")  # a file where a directory is wanted: not even root can make it
    reached = _stop_at_work(monkeypatch, module, attr)
    assert cli.main(argv(blocker / "dir", tmp_path)) == 2
    err = capsys.readouterr().err
    assert f"{option} " in err and "is not a writable directory" in err, err
    assert not reached
