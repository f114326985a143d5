"""The measurement of ``offloadd bench io``: fio's best configuration, then (engine, fio) pairs.

For each request size, :func:`run_bench` finds fio's best configuration over ``FIO_GRID``, then
has each engine verify its content once (outside the timed runs) and alternate with fio-best
``pairs`` times, writing then reading back the total. The result holds medians, spreads (min,
median, max) and the ratios engine / fio, per request size and engine.
"""

from __future__ import annotations

import os
import platform
import statistics
import sys
import time
from functools import partial
from typing import Any

import psutil

from offloadd.io.files import filesystem_type
from offloadd.io.request import Engine, Op
from offloadd.tools.bench.io_engines import Target, Timing, make_engine, spin_while
from offloadd.tools.bench.io_fio import (
    FIO_GRID,
    FioConfig,
    lay_out_fio_files,
    remove_fio_files,
    run_fio,
)

__all__ = ["run_bench"]

_SIDES = (("write", Op.WRITE), ("read", Op.READ))


def _median_and_spread(out: dict[str, Any], key: str, values: list[float]) -> None:
    """``out[key]``: the median of ``values``; ``out[key + "_spread"]``: median, min and max."""
    out[key] = statistics.median(values)
    out[f"{key}_spread"] = {"median": out[key], "min": min(values), "max": max(values)}


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
    huge_pages: bool = True,
) -> dict[str, Any]:
    """Measure ``engines`` (and fio, unless ``fio`` is None) at each request size; the results
    as a JSON-ready dict, with the machine they ran on."""
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
        target = Target(dirs, total_bytes, request, window=2 * threads, huge_pages=huge_pages)
        entry["huge_pages"] = target.huge_pages
        _progress(f"engine buffers on huge pages: {target.huge_pages}")
        fio_best: dict[str, FioConfig] = {}
        try:
            if fio is not None:
                lay_out_fio_files(fio, dirs, total_bytes, request)
                for rw in ("write", "read"):
                    grid = {}
                    for cfg in FIO_GRID:
                        grid[cfg] = run_fio(fio, dirs, cfg, rw, total_bytes, request)
                    fio_best[rw] = max(grid, key=lambda c: grid[c].gbps)
                    entry[f"fio_grid_{rw}"] = {c.label(): round(t.gbps, 3) for c, t in grid.items()}
                    entry[f"fio_grid_{rw}_reported"] = {
                        c.label(): round(t.nbytes / t.reported_s / 1e9, 3)
                        for c, t in grid.items()
                        if t.reported_s
                    }
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
                    remove_fio_files(d)
        result["sizes"].append(entry)
    return result


def _measure_engine(
    name: str,
    target: Target,
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
            for rw, op in _SIDES:
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
            _median_and_spread(out, f"{key}_GBps", [t.gbps for t in ts])
            out[f"{key}_cpu_s_per_GB"] = statistics.median(t.cpu_s_per_gb for t in ts)
            reported = [t.nbytes / t.reported_s / 1e9 for t in ts if t.reported_s]
            if reported:  # fio's own figure, next to its wall span (see [fio's wall span])
                out[f"{key}_reported_GBps"] = statistics.median(reported)
        if fio is not None:
            for rw in ("write", "read"):
                ratios = [a.gbps / b.gbps for a, b in zip(runs[rw], runs[f"fio_{rw}"], strict=True)]
                _median_and_spread(out, f"{rw}_vs_fio", ratios)
                out[f"fio_{rw}_config"] = fio_best[rw].label()
        if gil:
            out.update(_measure_gil(name, engine, target, pairs))
    finally:
        engine.close()
    return out


def _measure_gil(name: str, engine: Engine, target: Target, pairs: int) -> dict[str, Any]:
    """Idle and GIL-held runs alternated; the ratio per pair, then the median."""
    out: dict[str, Any] = {}
    for rw, op in _SIDES:
        ratios, busy_gbps = [], []
        for _ in range(pairs):
            idle = target.run(engine, op)
            busy, _spins = spin_while(partial(target.run, engine, op))
            ratios.append(busy.gbps / idle.gbps)
            busy_gbps.append(busy.gbps)
        out[f"gil_{rw}_GBps"] = statistics.median(busy_gbps)
        _median_and_spread(out, f"gil_{rw}_vs_idle", ratios)
        _progress(f"{name} under a GIL-holding loop: {rw} {out[f'gil_{rw}_vs_idle']:.2f} x idle")
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
