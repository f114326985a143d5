"""``offloadd bench io``: the I/O engines against fio, on the same directory, in the same run.

For each request size, it first finds fio's best configuration over a small grid
({libaio, io_uring} x iodepth {8, 32} x numjobs {1, 4}, O_DIRECT, same request size), which is
the device's practical peak here. Then it alternates pairs (engine, fio-best) ``--pairs`` times,
writing then reading back ``--total-bytes``, and reports medians, spreads and the ratios
engine / fio. Content is verified once per engine (write, read back, compare) outside the
timed runs. CPU cost is CPU-seconds per GB moved: the process's CPU time for the engines
(every thread), fio's own usr+sys for fio.

``--gil`` adds the mode that made csrc/ necessary: the same engine runs while the main thread
spins in a pure-Python loop (holding the GIL, as a training loop does), and the ratio to its
idle throughput is reported.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

import psutil
import torch

from offloadd.config import parse_size
from offloadd.io.buffers import AlignedBuffer
from offloadd.io.files import SlotFile, default_offload_dir, filesystem_type
from offloadd.io.python_engine import PythonEngine
from offloadd.io.request import Engine, Op, Request

__all__ = ["ENGINES", "add_arguments", "format_summary", "main", "run_bench"]

HELP = "measure the I/O engines against fio on the same directory"
ENGINES = ("native-uring", "native-threads", "python")
_GB = 1e9


@dataclass(slots=True)
class Timing:
    seconds: float
    cpu_s: float
    nbytes: int

    @property
    def gbps(self) -> float:
        return self.nbytes / self.seconds / _GB

    @property
    def cpu_s_per_gb(self) -> float:
        return self.cpu_s / (self.nbytes / _GB)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dir", action="append", default=None, help="directory (repeat to stripe)")
    p.add_argument("--total-bytes", default="1GiB", help="bytes written and read per run")
    p.add_argument(
        "--request-bytes", default="4MiB,16MiB,64MiB", help="request sizes (comma-separated)"
    )
    p.add_argument(
        "--engine",
        default=",".join(ENGINES),
        help=f"engines to measure (comma-separated from {', '.join(ENGINES)})",
    )
    p.add_argument("--threads", type=int, default=4, help="engine threads / requests in flight")
    p.add_argument("--pairs", type=int, default=5, help="alternating (engine, fio) pairs")
    p.add_argument("--gil", action="store_true", help="also measure under a GIL-holding loop")
    p.add_argument("--no-fio", action="store_true", help="skip fio (engines only)")
    p.add_argument("--json", metavar="PATH", help="write the results as JSON to PATH ('-': stdout)")


def main(ns: argparse.Namespace) -> int:
    try:
        opts = _options(ns)
    except ValueError as e:
        print(f"offloadd bench io: {e}", file=sys.stderr)
        return 2
    result = run_bench(**opts)
    print(format_summary(result))
    if ns.json == "-":
        json.dump(result, sys.stdout, indent=2)
        print()
    elif ns.json:
        with open(ns.json, "w") as f:
            json.dump(result, f, indent=2)
        print(f"results written to {ns.json}", file=sys.stderr)
    return 0


def _options(ns: argparse.Namespace) -> dict[str, Any]:
    dirs = ns.dir or [default_offload_dir()]
    for d in dirs:
        if not os.path.isdir(d) or not os.access(d, os.W_OK):
            raise ValueError(f"--dir {d}: not a writable directory")
    total = parse_size("--total-bytes", ns.total_bytes)
    sizes = [parse_size("--request-bytes", s) for s in ns.request_bytes.split(",") if s]
    if not sizes:
        raise ValueError("--request-bytes: give at least one size")
    for s in sizes:
        if s <= 0 or s % 4096:
            raise ValueError(f"--request-bytes: {s} is not a positive multiple of 4096")
        if 4 * s > total:  # fio's grid runs 4 jobs, each moving total / 4
            raise ValueError(
                f"--total-bytes {total} must be at least 4 x --request-bytes ({s}): "
                "fio runs up to 4 jobs and each must move whole requests"
            )
    engines = [e for e in ns.engine.split(",") if e]
    for e in engines:
        if e not in ENGINES:
            raise ValueError(f"--engine: unknown engine {e!r}; known: {', '.join(ENGINES)}")
    if ns.pairs < 1:
        raise ValueError(f"--pairs must be at least 1, got {ns.pairs}")
    if not 1 <= ns.threads <= 256:
        raise ValueError(f"--threads must be in 1..256, got {ns.threads}")
    fio = None if ns.no_fio else shutil.which("fio")
    if not ns.no_fio and fio is None:
        print(
            "offloadd bench io: fio not found (Debian: apt-get install fio); engines only",
            file=sys.stderr,
        )
    return dict(
        dirs=dirs,
        total_bytes=total,
        request_sizes=sizes,
        engines=engines,
        threads=ns.threads,
        pairs=ns.pairs,
        gil=ns.gil,
        fio=fio,
    )


# -- engines ---------------------------------------------------------------------------------


def make_engine(name: str, threads: int, chunk_bytes: int) -> Engine:
    if name == "python":
        return PythonEngine(threads)
    from offloadd.io.native import NativeEngine

    backend = name.removeprefix("native-")
    return NativeEngine(threads, chunk_bytes=chunk_bytes, backend=backend, depth=2 * threads)


class _Run:
    """All requests of one pass in flight at once; ``wait`` returns when every one called back."""

    def __init__(self, n: int) -> None:
        self.left = n
        self.errors: list[BaseException] = []
        self.done = threading.Event()
        self.lock = threading.Lock()

    def __call__(self, r: Request) -> None:
        with self.lock:
            if r.error is not None:
                self.errors.append(r.error)
            self.left -= 1
            if self.left == 0:
                self.done.set()

    def wait(self) -> None:
        self.done.wait()
        if self.errors:
            raise self.errors[0]


class _Target:
    """The engine's files (one per directory), the source buffers and the read-back buffers."""

    def __init__(self, dirs: list[str], total: int, request: int, window: int) -> None:
        self.files = [SlotFile(d, request, "on") for d in dirs]
        self.n = total // request
        self.request = request
        self.where = []
        for i in range(self.n):
            f = self.files[i % len(self.files)]
            self.where.append((f, f.alloc()))
        self.window = min(window, self.n)
        self.src = [AlignedBuffer(request) for _ in range(self.window)]
        for k, b in enumerate(self.src):  # distinct content per buffer: a misplaced read shows
            b.tensor.copy_(
                torch.randint(
                    0,
                    256,
                    (request,),
                    dtype=torch.uint8,
                    generator=torch.Generator().manual_seed(k),
                )
            )
        self.dst = [AlignedBuffer(request) for _ in range(self.window)]

    def run(self, engine: Engine, op: Op) -> Timing:
        bufs = self.src if op is Op.WRITE else self.dst
        run = _Run(self.n)
        reqs = [
            Request(op, f.fd, f.path, off, bufs[i % self.window].address, self.request, run)
            for i, (f, off) in enumerate(self.where)
        ]
        cpu0, t0 = time.process_time(), time.perf_counter()
        for r in reqs:
            engine.submit(r)
        run.wait()
        t1, cpu1 = time.perf_counter(), time.process_time()
        return Timing(t1 - t0, cpu1 - cpu0, self.n * self.request)

    def verify(self, engine: Engine) -> None:
        """Read each request back into its own buffer and compare with what was written."""
        for start in range(0, self.n, self.window):
            idx = list(range(start, min(self.n, start + self.window)))
            run = _Run(len(idx))
            for j, i in enumerate(idx):
                f, off = self.where[i]
                engine.submit(
                    Request(Op.READ, f.fd, f.path, off, self.dst[j].address, self.request, run)
                )
            run.wait()
            for j, i in enumerate(idx):
                if not torch.equal(self.dst[j].tensor, self.src[i % self.window].tensor):
                    raise RuntimeError(f"bench io: request {i} read back different bytes")

    def close(self) -> None:
        for b in self.src + self.dst:
            b.close()
        for f in self.files:
            f.close()


def _spin_while(fn: Any) -> tuple[Any, int]:
    """Run ``fn`` in a thread while this thread spins in pure Python (GIL held); its result."""
    out: list[Any] = []
    err: list[BaseException] = []

    def target() -> None:
        try:
            out.append(fn())
        except BaseException as e:
            err.append(e)

    t = threading.Thread(target=target)
    spins = 0
    t.start()
    while t.is_alive():
        for _ in range(1000):  # pure bytecode: never releases the GIL on its own
            spins += 1
    t.join()
    if err:
        raise err[0]
    return out[0], spins


# -- fio -------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class FioConfig:
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


def _fio_cleanup(directory: str) -> None:
    for name in os.listdir(directory):
        if name.startswith("offloadd-bench-fio."):
            os.unlink(os.path.join(directory, name))


# -- the benchmark ---------------------------------------------------------------------------


def _stats(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def _progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def run_bench(
    *,
    dirs: list[str],
    total_bytes: int,
    request_sizes: list[int],
    engines: list[str],
    threads: int,
    pairs: int,
    gil: bool,
    fio: str | None,
) -> dict[str, Any]:
    from offloadd.io import native

    if any(e.startswith("native") for e in engines) and not native.available()[0]:
        raise RuntimeError(f"bench io: {native.available()[1]}")
    if "native-uring" in engines and not native.uring_available()[0]:
        _progress(f"io_uring unavailable ({native.uring_available()[1]}): skipping native-uring")
        engines = [e for e in engines if e != "native-uring"]
    result: dict[str, Any] = {"machine": _machine(dirs), "sizes": []}
    for request in request_sizes:
        _progress(f"== request size {request >> 20} MiB, {total_bytes >> 20} MiB per run")
        entry: dict[str, Any] = {"request_bytes": request, "total_bytes": total_bytes}
        target = _Target(dirs, total_bytes, request, window=2 * threads)
        fio_best: dict[str, FioConfig] = {}
        try:
            if fio is not None:
                for rw in ("write", "read"):
                    grid = {}
                    for cfg in FIO_GRID:
                        grid[cfg] = run_fio(fio, dirs, cfg, rw, total_bytes, request)
                    fio_best[rw] = max(grid, key=lambda c: grid[c].gbps)
                    entry[f"fio_grid_{rw}"] = {c.label(): round(t.gbps, 3) for c, t in grid.items()}
                    _progress(
                        f"fio {rw} best: {fio_best[rw].label()} {grid[fio_best[rw]].gbps:.2f} GB/s"
                    )
            for name in engines:
                entry[name] = _measure_engine(
                    name, target, threads, pairs, gil, fio, fio_best, dirs
                )
        finally:
            target.close()
            if fio is not None:
                for d in dirs:
                    _fio_cleanup(d)
        result["sizes"].append(entry)
    return result


def _measure_engine(
    name: str,
    target: _Target,
    threads: int,
    pairs: int,
    gil: bool,
    fio: str | None,
    fio_best: dict[str, FioConfig],
    dirs: list[str],
) -> dict[str, Any]:
    engine = make_engine(name, threads, min(target.request, 4 << 20))
    out: dict[str, Any] = {}
    try:
        target.run(engine, Op.WRITE)  # lay the file out, then check what comes back
        target.verify(engine)
        runs: dict[str, list[Timing]] = {"write": [], "read": [], "fio_write": [], "fio_read": []}
        for i in range(pairs):
            for rw, op in (("write", Op.WRITE), ("read", Op.READ)):
                runs[rw].append(target.run(engine, op))
                if fio is not None:
                    cfg = fio_best[rw]
                    runs[f"fio_{rw}"].append(
                        run_fio(fio, dirs, cfg, rw, target.n * target.request, target.request)
                    )
            _progress(
                f"{name} pair {i + 1}/{pairs}: write {runs['write'][-1].gbps:.2f} read "
                f"{runs['read'][-1].gbps:.2f} GB/s"
                + (
                    f" | fio write {runs['fio_write'][-1].gbps:.2f} read "
                    f"{runs['fio_read'][-1].gbps:.2f}"
                    if fio is not None
                    else ""
                )
            )
        for key, ts in runs.items():
            if not ts:
                continue
            out[f"{key}_GBps"] = statistics.median(t.gbps for t in ts)
            out[f"{key}_GBps_spread"] = _stats([t.gbps for t in ts])
            out[f"{key}_cpu_s_per_GB"] = statistics.median(t.cpu_s_per_gb for t in ts)
        if fio is not None:
            for rw in ("write", "read"):
                ratios = [a.gbps / b.gbps for a, b in zip(runs[rw], runs[f"fio_{rw}"], strict=True)]
                out[f"{rw}_vs_fio"] = statistics.median(ratios)
                out[f"{rw}_vs_fio_spread"] = _stats(ratios)
                out[f"fio_{rw}_config"] = fio_best[rw].label()
        if gil:
            out.update(_measure_gil(name, engine, target, pairs))
    finally:
        engine.close()
    return out


def _measure_gil(name: str, engine: Engine, target: _Target, pairs: int) -> dict[str, Any]:
    """Idle and GIL-held runs alternated; the ratio per pair, then the median."""
    out: dict[str, Any] = {}
    for rw, op in (("write", Op.WRITE), ("read", Op.READ)):
        ratios, busy_gbps = [], []
        for _ in range(pairs):
            idle = target.run(engine, op)
            busy, _spins = _spin_while(lambda op=op: target.run(engine, op))
            ratios.append(busy.gbps / idle.gbps)
            busy_gbps.append(busy.gbps)
        out[f"gil_{rw}_GBps"] = statistics.median(busy_gbps)
        out[f"gil_{rw}_vs_idle"] = statistics.median(ratios)
        out[f"gil_{rw}_vs_idle_spread"] = _stats(ratios)
        _progress(f"{name} under a GIL-holding loop: {rw} {statistics.median(ratios):.2f} x idle")
    return out


def _machine(dirs: list[str]) -> dict[str, Any]:
    return {
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "ram_bytes": psutil.virtual_memory().total,
        "kernel": platform.release(),
        "dirs": {d: filesystem_type(d) for d in dirs},
        "python": sys.version.split()[0],
        "time": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def format_summary(result: dict[str, Any]) -> str:
    """A table: one line per (request size, engine) with GB/s, ratios to fio and CPU cost."""
    lines = [
        f"{'request':>8} {'engine':<15} {'write':>7} {'read':>7} {'w/fio':>6} {'r/fio':>6} "
        f"{'fio w':>6} {'fio r':>6} {'CPU-s/GB w':>10} {'r':>5} {'GIL w':>6} {'GIL r':>6}"
    ]

    def f(v: Any, spec: str = ".2f") -> str:
        return format(v, spec) if isinstance(v, float) else "-"

    for entry in result["sizes"]:
        for name in ENGINES:
            e = entry.get(name)
            if e is None:
                continue
            lines.append(
                f"{entry['request_bytes'] >> 20:>5}MiB {name:<15} {f(e.get('write_GBps')):>7} "
                f"{f(e.get('read_GBps')):>7} {f(e.get('write_vs_fio')):>6} "
                f"{f(e.get('read_vs_fio')):>6} {f(e.get('fio_write_GBps')):>6} "
                f"{f(e.get('fio_read_GBps')):>6} {f(e.get('write_cpu_s_per_GB'), '.3f'):>10} "
                f"{f(e.get('read_cpu_s_per_GB'), '.3f'):>5} {f(e.get('gil_write_vs_idle')):>6} "
                f"{f(e.get('gil_read_vs_idle')):>6}"
            )
    lines.append(
        "GB/s = 1e9 bytes/s, medians over the pairs; w/fio, r/fio: engine / fio-best per pair"
    )
    lines.append(
        "CPU-s/GB: the engine's whole process (io_uring's kernel workers included); "
        "fio reports its job threads only"
    )
    return "\n".join(lines)
