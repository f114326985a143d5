"""fio's side of ``offloadd bench io``: one fio run, on the directories the engines use.

:data:`FIO_GRID` is the small grid of configurations ({libaio, io_uring} x iodepth {8, 32} x
numjobs {1, 4}, O_DIRECT) in which the benchmark looks for the device's practical peak.
"""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass

from offloadd.tools.bench_io_engines import Timing

__all__ = ["FIO_GRID", "FioConfig", "remove_fio_files", "run_fio"]


@dataclass(frozen=True, slots=True)
class FioConfig:
    """One fio configuration of the grid (every run is O_DIRECT, the request size the engines')."""

    ioengine: str
    iodepth: int
    numjobs: int

    def label(self) -> str:
        return f"{self.ioengine} iodepth={self.iodepth} numjobs={self.numjobs}"


FIO_GRID = tuple(
    FioConfig(e, d, j) for e in ("libaio", "io_uring") for d in (8, 32) for j in (1, 4)
)


def run_fio(fio: str, dirs: list[str], cfg: FioConfig, rw: str, total: int, request: int) -> Timing:
    """One fio run over the same directories as the engine (fio spreads its files over them)."""
    per_job = total // cfg.numjobs // request * request
    cmd = [
        fio,
        "--name=offloadd-bench",
        "--directory=" + ":".join(d.replace(":", "\\:") for d in dirs),
        "--filename_format=offloadd-bench-fio.$jobnum",
        f"--rw={rw}",
        f"--bs={request}",
        f"--size={per_job}",
        "--direct=1",
        f"--ioengine={cfg.ioengine}",
        f"--iodepth={cfg.iodepth}",
        f"--numjobs={cfg.numjobs}",
        "--group_reporting=1",
        "--output-format=json",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"fio failed ({' '.join(cmd)}): {proc.stderr.strip()[-500:]}")
    job = json.loads(proc.stdout[proc.stdout.index("{") :])["jobs"][0]
    side = job["write" if rw == "write" else "read"]
    seconds = side["runtime"] / 1000.0
    nbytes = side["io_bytes"]
    # fio reports usr/sys as a percentage of one CPU over the job's run time, per job
    cpu_s = (job["usr_cpu"] + job["sys_cpu"]) / 100.0 * (job["job_runtime"] / 1000.0)
    return Timing(seconds, cpu_s, nbytes)


def remove_fio_files(directory: str) -> None:
    """Delete the files fio's runs left in ``directory``."""
    for name in os.listdir(directory):
        if name.startswith("offloadd-bench-fio."):
            os.unlink(os.path.join(directory, name))
