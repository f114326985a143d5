"""What offloadd's start-up hook costs: interpreter start-up with and without the package.

Builds two bare virtual environments in a temporary directory (no pip, no other packages): one
empty, one with offloadd installed (``pip install --no-deps``, which puts offloadd.pth and
offloadd_boot.py into its site-packages). Then, interleaved round by round, times
``python -c pass`` in the empty one, in the one with offloadd (OFFLOADD unset), and in the one
with offloadd and ``OFFLOADD=1`` (the import hook installed, torch not imported). A second part
times ``python -c "import torch"`` in this interpreter's environment with and without
``OFFLOADD=1`` (activation at torch import). Prints medians, spreads and the ratios.

Run under the machine-wide lock: ``flock /work/bench.lock python scripts/bench_startup.py``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OFFLOADD")}
    env.pop("PYTHONPATH", None)
    env.update(extra)
    return env


def _time(cmd: list[str], env: dict[str, str]) -> float:
    t0 = time.perf_counter()
    subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - t0


def _show(label: str, xs: list[float]) -> float:
    med = statistics.median(xs)
    print(
        f"  {label:<44} median {med * 1e3:7.2f} ms  (min {min(xs) * 1e3:.2f}, "
        f"max {max(xs) * 1e3:.2f}, n={len(xs)})"
    )
    return med


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=40, help="rounds of the bare start-up part")
    p.add_argument("--torch-rounds", type=int, default=10, help="rounds of the torch part")
    ns = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="offloadd-bench-startup-") as tmp:
        bare, withpkg = Path(tmp, "bare"), Path(tmp, "with")
        for venv in (bare, withpkg):
            subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
        print("installing offloadd (--no-deps) into the second environment ...", flush=True)
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "--python",
                str(withpkg / "bin" / "python"),
                "install",
                "-q",
                "--no-deps",
                str(ROOT),
            ],
            check=True,
        )
        site = next((withpkg / "lib").glob("python3*/site-packages"))
        assert (site / "offloadd.pth").is_file(), "offloadd.pth was not installed"
        cases = {
            "empty venv": ([str(bare / "bin" / "python"), "-c", "pass"], _env()),
            "offloadd installed, OFFLOADD unset": (
                [str(withpkg / "bin" / "python"), "-c", "pass"],
                _env(),
            ),
            "offloadd installed, OFFLOADD=1": (
                [str(withpkg / "bin" / "python"), "-c", "pass"],
                _env(OFFLOADD="1"),
            ),
        }
        times: dict[str, list[float]] = {k: [] for k in cases}
        for cmd, env in cases.values():  # warm the page cache
            _time(cmd, env)
        print(f"python -c pass, {ns.rounds} interleaved rounds:", flush=True)
        for i in range(ns.rounds):
            order = list(cases.items())
            if i % 2:
                order.reverse()
            for label, (cmd, env) in order:
                times[label].append(_time(cmd, env))
        med = {k: _show(k, v) for k, v in times.items()}
        base = med["empty venv"]
        print(
            f"  ratio installed/empty:          {med['offloadd installed, OFFLOADD unset'] / base:.3f}"
        )
        print(
            f"  ratio installed+OFFLOADD=1/empty: {med['offloadd installed, OFFLOADD=1'] / base:.3f}"
        )
    torch_cases = {
        "import torch": _env(),
        "import torch, OFFLOADD=1 (activation)": _env(OFFLOADD="1"),
    }
    ttimes: dict[str, list[float]] = {k: [] for k in torch_cases}
    cmd = [sys.executable, "-c", "import torch"]
    for env in torch_cases.values():
        _time(cmd, env)
    print(f"python -c 'import torch' in {sys.prefix}, {ns.torch_rounds} interleaved rounds:")
    for i in range(ns.torch_rounds):
        order = list(torch_cases.items())
        if i % 2:
            order.reverse()
        for label, env in order:
            ttimes[label].append(_time(cmd, env))
    tmed = {k: _show(k, v) for k, v in ttimes.items()}
    ratio = tmed["import torch, OFFLOADD=1 (activation)"] / tmed["import torch"]
    print(f"  ratio activated/plain: {ratio:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
