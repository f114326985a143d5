"""fio's side of ``offloadd bench io``: one fio run, on the directories the engines use.

:data:`FIO_GRID` is the small grid of configurations ({libaio, io_uring} x iodepth {8, 32} x
numjobs {1, 4}, O_DIRECT) in which the benchmark looks for the device's practical peak.

Note: [fio's wall span] fio's own bandwidth with ``--group_reporting`` is the bytes of all jobs
divided by the *longest single job's* run time. Its jobs are processes that start together but
need the CPU to submit (pinning the pages of a 64 MiB O_DIRECT request is real work), so on a
machine with fewer cores than jobs, jobs of a few large requests run largely one after another:
each job's run time is short, and the group figure, which adds them up as if they had
overlapped, comes out several times what the wall span from the first request issued to the last
completed gives (docs/benchmarks/native-io_cpu-2core_2026-11-23.md). The engines are timed from
the first submission to the last completion, so fio is timed the same way: every request's
completion time and latency come from fio's latency log
(``--write_lat_log`` with epoch time stamps), and the span runs from the earliest issue
(completion minus latency) to the latest completion. The log's time stamps are whole
milliseconds, so a span is known to the millisecond. fio's own figure is kept as ``reported_s``.
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import tempfile
from dataclasses import dataclass

from offloadd.tools.bench.io_engines import Timing

__all__ = [
    "FIO_GRID",
    "FioConfig",
    "lat_log_span",
    "lay_out_fio_files",
    "remove_fio_files",
    "run_fio",
]


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


def lat_log_span(paths: list[str]) -> float | None:
    """Seconds from the first request issued to the last completed, over fio latency logs
    (lines ``time_ms, latency_ns, direction, size, ...``); None if they hold no request."""
    first, last = float("inf"), float("-inf")
    for path in paths:
        with open(path) as f:
            for line in f:
                fields = line.split(",")
                if len(fields) < 2:
                    continue
                done_ms = int(fields[0])
                first = min(first, done_ms - int(fields[1]) / 1e6)
                last = max(last, done_ms)
    if last < first:
        return None
    return max(last - first, 1.0) / 1000.0  # stamps are whole milliseconds


def run_fio(fio: str, dirs: list[str], cfg: FioConfig, rw: str, total: int, request: int) -> Timing:
    """One fio run over the same directories as the engine (fio spreads its files over them),
    timed by its wall span (see [fio's wall span])."""
    per_job = total // cfg.numjobs // request * request
    with tempfile.TemporaryDirectory(prefix="offloadd-fio-log-") as logdir:
        prefix = os.path.join(logdir, "req")
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
            f"--write_lat_log={prefix}",
            "--log_unix_epoch=1",
            "--log_avg_msec=0",
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise RuntimeError(f"fio failed ({' '.join(cmd)}): {proc.stderr.strip()[-500:]}")
        span = lat_log_span(sorted(glob.glob(f"{prefix}_lat.*.log")))
    job = json.loads(proc.stdout[proc.stdout.index("{") :])["jobs"][0]
    side = job["write" if rw == "write" else "read"]
    reported = side["runtime"] / 1000.0
    nbytes = side["io_bytes"]
    # fio reports usr/sys as a percentage of one CPU over the job's run time, per job
    cpu_s = (job["usr_cpu"] + job["sys_cpu"]) / 100.0 * (job["job_runtime"] / 1000.0)
    return Timing(span if span is not None else reported, cpu_s, nbytes, reported_s=reported)


def lay_out_fio_files(fio: str, dirs: list[str], total: int, request: int) -> None:
    """Write fio's files once, untimed, at every ``numjobs`` of the grid: fio's timed writes then
    overwrite written blocks, as the engines' do (their first pass lays their file out). A fresh
    fio file is fallocate()d, and writes into its unwritten extents cost more."""
    for numjobs in sorted({c.numjobs for c in FIO_GRID}):
        run_fio(fio, dirs, FioConfig("libaio", 32, numjobs), "write", total, request)


def remove_fio_files(directory: str) -> None:
    """Delete the files fio's runs left in ``directory``."""
    for name in os.listdir(directory):
        if name.startswith("offloadd-bench-fio."):
            os.unlink(os.path.join(directory, name))
