"""Running real client programs with and without ``OFFLOADD=1``: environments and results."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import psutil

CLIENTS = Path(__file__).resolve().parent / "clients"
RANKS = Path(__file__).resolve().parent / "ranks"
PYTHON = sys.executable
BIN = Path(sys.executable).parent


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without any ``OFFLOADD*`` variable (and with ``extra`` added)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OFFLOADD")}
    env.pop("PYTHONPATH", None)
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"  # torchrun, deepspeed, offloadd
    env.update(extra)
    return env


def offload_env(disk_dir: Path, report: Path, **extra: str) -> dict[str, str]:
    """``OFFLOADD=1`` into ``disk_dir`` with sizes small enough for test models."""
    return clean_env(
        OFFLOADD="1",
        OFFLOADD_SSD_DIRS=str(disk_dir),
        OFFLOADD_MIN_BYTES="16KiB",
        OFFLOADD_CHUNK_BYTES="256KiB",
        OFFLOADD_STAGING_BYTES="8MiB",
        OFFLOADD_REPORT=str(report),
        **extra,
    )


def run(
    args: list[str], env: dict[str, str], *, timeout: float = 300, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """Run a client to completion; fail with its output if it fails or runs past ``timeout``.
    The client runs in its own session: on a timeout the whole group goes, and every process
    below it (torchrun starts its ranks in sessions of their own: left running, a rank holds
    ports, cores, file locks, and the pipes whose end this waits for)."""
    with subprocess.Popen(
        args,
        env=env,
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    ) as child:
        try:
            out, err = child.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_tree(child.pid)
            try:
                out, err = child.communicate(timeout=30)
            except subprocess.TimeoutExpired as e:  # a process outside the tree holds a pipe
                out, err = _text(e.stdout), _text(e.stderr)
            raise AssertionError(
                f"{args} ran past {timeout:g} s (its process group killed)\n"
                f"--- stdout\n{out[-4000:]}\n--- stderr\n{err[-8000:]}"
            ) from None
    proc = subprocess.CompletedProcess(args, child.returncode, out, err)
    if proc.returncode != 0:
        raise AssertionError(
            f"{args} exited with {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}\n"
            f"--- stderr\n{proc.stderr[-8000:]}"
        )
    return proc


def _kill_tree(pid: int) -> None:
    """SIGKILL ``pid``'s process group and every process below it, whatever their session."""
    below: list[psutil.Process] = []
    with contextlib.suppress(psutil.Error):
        below = psutil.Process(pid).children(recursive=True)
    for proc in below:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)


def _text(data: str | bytes | None) -> str:
    if isinstance(data, bytes):
        return data.decode(errors="replace")
    return data or ""


def last_json(text: str) -> dict[str, Any]:
    """The last line of ``text`` that is a JSON object."""
    for line in reversed(text.strip().splitlines()):
        if line.startswith("{"):
            return dict(json.loads(line))
    raise AssertionError(f"no JSON line in output:\n{text[-4000:]}")


def same_as_plain(
    got: dict[str, Any],
    base: dict[str, Any],
    plain: list[str],
    env: dict[str, str] | None = None,
) -> None:
    """Assert that ``got`` (a client's losses and weights with offloadd) equals ``base`` (the
    same client's without it: ``plain`` its command, ``env`` its environment, ``clean_env()``
    if None). Where it does not, plain training is run again: one run of a fixture's plain
    client, in a loaded full test run, once gave other final weights than every other plain run
    of it before or since. Then ``got`` must equal the new plain run, and a warning shows both
    plain results; else it fails showing all three."""
    if got == base:
        return
    again = last_json(run(plain, clean_env() if env is None else env).stdout)
    assert got == again, (
        f"offloadd's run differs from plain training's:\n  with offloadd {got}\n"
        f"  plain {base}\n  plain again {again}"
    )
    warnings.warn(
        f"plain training gave other results in one run ({base}, then {again}); offloadd's run "
        "matches the second",
        stacklevel=2,
    )


def summary_lines(stderr: str) -> list[str]:
    return [
        ln for ln in stderr.splitlines() if ln.startswith("offloadd") and "forwards offloaded" in ln
    ]


_TORCH_ABORT = "terminate called without an active exception"


def free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def torchrun(
    script: list[str], env: dict[str, str], timeout: float, before_retry: Any = None
) -> str:
    """Launch ``script`` (its path and arguments) on 2 gloo ranks under torchrun; its stdout.
    torch 2.13's CPU wheel: on a loaded machine a rank sometimes aborts in C++ (gloo/c10d) while
    the group starts, with or without offloadd (seen in launches without it). One retry for that
    signature only; it is no numerical outcome, and the launches' results must still match bit
    for bit."""

    def cmd() -> list[str]:  # a free port for each launch
        return ["torchrun", "--nproc_per_node=2", f"--master_port={free_port()}", *script]

    try:
        return run(cmd(), env, timeout=timeout).stdout
    except AssertionError as e:
        if _TORCH_ABORT not in str(e):
            raise
        warnings.warn(f"torchrun rank aborted in C++; retrying once: {script}", stacklevel=2)
        if before_retry is not None:
            before_retry()
        return run(cmd(), env, timeout=timeout).stdout
