"""The harness that runs clients (tests/_support/envrun.py): a client past its time goes, and
so does every process it started, whatever its session (torchrun's ranks have their own)."""

from __future__ import annotations

import time

import psutil
import pytest

from tests._support.envrun import PYTHON, clean_env, run

_CLIENT = """
import subprocess, sys, time
rank = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"],
                        start_new_session=True)  # holds our stdout and stderr, as a rank does
print(rank.pid, flush=True)
time.sleep(120)
"""


def test_a_client_past_its_time_goes_with_what_it_started() -> None:
    start = time.monotonic()
    with pytest.raises(AssertionError, match="ran past 2 s") as failed:
        run([PYTHON, "-c", _CLIENT], clean_env(), timeout=2)
    assert time.monotonic() - start < 45  # once waited for ever for the rank's pipes
    pid = int(str(failed.value).split("--- stdout\n")[1].split()[0])
    deadline = time.monotonic() + 10
    while psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, f"the client's child {pid} still runs"
        time.sleep(0.1)
