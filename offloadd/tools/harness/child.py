"""A measured run in a fresh interpreter: ``python -P -m MODULE --json SPEC`` prints its result
as JSON on its last line of stdout; the parent reads it back (train.py's runs, ``bench relay``'s).

One process per run, so that each run's peak RSS is its own.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["RunFailed", "child_main", "run_module"]


class RunFailed(RuntimeError):
    """A run's process failed; ``returncode`` is negative when a signal killed it."""

    def __init__(self, message: str, returncode: int, stderr: str) -> None:
        super().__init__(message)
        self.returncode = returncode
        self.stderr = stderr


def run_module(
    module: str,
    spec: Mapping[str, Any],
    *,
    what: str,
    progress: bool = False,
    timeout: float | None = None,
    env: Mapping[str, str] | None = None,
    preexec_fn: Callable[[], None] | None = None,
) -> dict[str, Any]:
    """Run ``python -P -m module --json SPEC`` (``--progress`` with ``progress``: its stderr then
    shows as it runs) and return the JSON object its last line of stdout holds; RunFailed naming
    ``what`` with its stderr if it fails. ``preexec_fn``: run in the child before it execs (to
    enter a memory cgroup: cgroup.py)."""
    # -P: import the installed offloadd, never a source tree that happens to be the cwd
    args = [sys.executable, "-P", "-m", module, "--json", json.dumps(dict(spec))]
    if progress:
        args.append("--progress")
    proc = subprocess.run(
        args,
        stdout=subprocess.PIPE,
        stderr=None if progress else subprocess.PIPE,
        text=True,
        timeout=timeout,
        env=dict(os.environ if env is None else env),
        preexec_fn=preexec_fn,
    )
    if proc.returncode != 0:
        raise RunFailed(
            f"{what} failed (exit {proc.returncode}): {proc.stderr}",
            proc.returncode,
            proc.stderr or "",
        )
    return dict(json.loads(proc.stdout.strip().splitlines()[-1]))


def child_main(
    module: str, run: Callable[[dict[str, Any], bool], dict[str, Any]], argv: list[str] | None
) -> int:
    """The child's side: ``python -m module --json SPEC [--progress]`` calls ``run(spec,
    progress)`` and prints its result as one line of JSON."""
    parser = argparse.ArgumentParser(prog=f"python -m {module}")
    parser.add_argument("--json", required=True, help="the run's spec as a JSON object")
    parser.add_argument("--progress", action="store_true")
    ns = parser.parse_args(argv)
    print(json.dumps(run(json.loads(ns.json), ns.progress)), flush=True)
    return 0
