"""Where a training step's time goes: one record per step, for ``bench step --trace``.

A record splits the step's wall time by phase (forward, backward, optimizer) and says how much of
it the training thread spent inside offloadd's hooks (``pack_s``, ``unpack_s``, waits on reads
and writes included), how busy the CPUs were (this process's CPU seconds over the step's wall
time, all threads) and how much CPU time the hypervisor took from the machine meanwhile (steal).
``compute_s`` is the rest: the step's time outside the hooks. The figures come from
:class:`~offloadd.Stats` (``pack_s``, ``unpack_s``, ``read_wait_s``, ``write_wait_s``), the
process's CPU times and /proc/stat; taking them costs a few microseconds per step.

Also here: the allocators a run can use (:data:`ALLOCATORS`) and where the preloaded ones live.
"""

from __future__ import annotations

import os
import resource
import statistics
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import psutil

from offloadd.runtime import host_allocator
from offloadd.runtime.stats import Stats

__all__ = [
    "ALLOCATORS",
    "HOST_ALLOCATOR",
    "PRELOADED",
    "STAT_FIELDS",
    "StepTrace",
    "allocator_used",
    "cpu_allocator",
    "medians",
    "preload_env",
    "preload_path",
]

ALLOCATORS = ("auto", "system", "caching", "jemalloc", "tcmalloc")
"""torch's CPU allocator for a run. ``auto``: the Offloader's default (the host cache for tier ssd
without CUDA, glibc's heap otherwise and without an Offloader). ``system``: glibc's heap.
``caching``: offloadd's host cache, also for runs without offloading. ``jemalloc``,
``tcmalloc``: preloaded (``LD_PRELOAD``) in the run's process, as PyTorch's CPU performance
guide recommends; the Offloader then leaves torch's allocator alone."""

PRELOADED: Mapping[str, tuple[str, str]] = {
    "jemalloc": ("libjemalloc.so.2", "libjemalloc2"),
    "tcmalloc": ("libtcmalloc_minimal.so.4", "libtcmalloc-minimal4"),
}
"""Preloaded allocators: (library file, Debian package that installs it)."""

HOST_ALLOCATOR: Mapping[str, str] = {
    "auto": "auto",
    "system": "system",
    "caching": "caching",
    "jemalloc": "system",  # preloaded: torch's allocator is then jemalloc's malloc
    "tcmalloc": "system",
}
"""``Config.host_allocator`` for a run's Offloader, by the run's allocator."""

_LIB_DIRS = (
    "/usr/lib/x86_64-linux-gnu",
    "/usr/lib/aarch64-linux-gnu",
    "/usr/lib64",
    "/usr/lib",
    "/usr/local/lib",
)

STAT_FIELDS = ("pack_s", "unpack_s", "read_wait_s", "write_wait_s")
"""The Stats fields a step record takes as differences."""


def preload_path(allocator: str) -> str:
    """The library to preload for ``allocator`` (jemalloc, tcmalloc); ValueError naming the
    Debian package when it is not installed."""
    if allocator not in PRELOADED:
        raise ValueError(f"allocator {allocator!r} is not preloaded; those are {list(PRELOADED)}")
    lib, package = PRELOADED[allocator]
    for d in _LIB_DIRS:
        path = Path(d) / lib
        if path.is_file():
            return str(path)
    raise ValueError(
        f"allocator {allocator!r}: {lib} not found in {', '.join(_LIB_DIRS)}; "
        f"on Debian: apt-get install {package}"
    )


def cpu_allocator() -> str:
    """The allocator that ``bench step``, the demo and ``rok`` hold equal on a CPU machine:
    offloadd's host cache (tier ssd's there) where it is built, else glibc's heap (ssd's fallback
    too), said on stderr."""
    try:
        host_allocator.load()
    except host_allocator.HostAllocatorError as e:
        print(
            f"offloadd: the host cache is unavailable ({e}); every run uses glibc's heap",
            file=sys.stderr,
        )
        return "system"
    return "caching"


def preload_env(allocator: str, env: Mapping[str, str]) -> dict[str, str]:
    """``env`` for a run's process: with ``LD_PRELOAD`` naming jemalloc or tcmalloc if the run
    asks for one (ValueError naming the package if it is not installed)."""
    out = dict(env)
    if allocator in PRELOADED:
        lib = preload_path(allocator)
        out["LD_PRELOAD"] = " ".join(p for p in (lib, out.get("LD_PRELOAD", "")) if p)
    return out


def allocator_used(allocator: str, offloader_allocator: str | None) -> str:
    """What torch's CPU allocator was in this process: caching (the host cache), system,
    jemalloc or tcmalloc (checked in /proc/self/maps: mapped, or ``system (... not loaded)``).
    ``offloader_allocator``: ``Stats.host_allocator`` of the run's Offloader, None without one."""
    if allocator in PRELOADED:
        lib = PRELOADED[allocator][0]
        try:
            maps = Path("/proc/self/maps").read_text()
        except OSError:
            return allocator  # no /proc: taken on trust
        return allocator if lib in maps else f"system ({allocator} not loaded)"
    if offloader_allocator is not None:
        return offloader_allocator or "system"
    return "caching" if allocator == "caching" else "system"


def _steal_s() -> float | None:
    """CPU seconds the hypervisor has taken from this machine's CPUs since boot, all CPUs
    together (``steal`` in /proc/stat); None where it is not reported. On a VM whose disk is
    served by the host's CPUs, I/O shows up here when the guest's CPUs are busy."""
    steal = getattr(psutil.cpu_times(), "steal", None)
    return None if steal is None else float(steal)


def _page_faults() -> int:
    """Page faults of this process so far: each first touch of fresh memory costs one."""
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return int(ru.ru_minflt + ru.ru_majflt)


def _process_cpu_s() -> float:
    return time.process_time()  # all threads, at ns resolution (os.times counts clock ticks)


class StepTrace:
    """Records one step at a time: :meth:`begin`, :meth:`mark` after forward and backward,
    :meth:`end` returns the step's record."""

    def __init__(self) -> None:
        self._stats: Stats | None = None
        self.cores = len(os.sched_getaffinity(0))
        self._t0 = self._cpu0 = self._main0 = 0.0
        self._faults0 = 0
        self._steal0: float | None = None
        self._stat0: dict[str, float] = {}
        self._marks: list[float] = []

    def begin(self, stats: Stats | None = None) -> None:
        if stats is not None:
            self._stats = stats
        self._stat0 = self._stat_values()
        self._marks = []
        self._steal0 = _steal_s()
        self._faults0 = _page_faults()
        self._cpu0 = _process_cpu_s()
        self._main0 = time.thread_time()
        self._t0 = time.perf_counter()

    def mark(self) -> None:
        """The end of a phase (forward, then backward); the rest of the step is the optimizer."""
        self._marks.append(time.perf_counter())

    def end(self, stats: Stats | None = None) -> dict[str, Any]:
        t1 = time.perf_counter()
        main = time.thread_time() - self._main0
        cpu = _process_cpu_s() - self._cpu0
        faults = _page_faults() - self._faults0
        steal1 = _steal_s()
        if stats is not None:
            self._stats = stats
        ends = [*self._marks, t1][:3]
        while len(ends) < 3:
            ends.insert(0, self._t0)  # a phase not marked took no time
        fwd, bwd = ends[0] - self._t0, ends[1] - ends[0]
        step = t1 - self._t0
        rec: dict[str, Any] = {
            "step_s": step,
            "forward_s": fwd,
            "backward_s": bwd,
            "optimizer_s": ends[2] - ends[1],
            "cpu_s": cpu,
            "main_thread_cpu_s": main,
            "busy_cores": cpu / step if step > 0 else 0.0,
            "page_faults": faults,
            "idle_fraction": max(0.0, 1.0 - cpu / (step * self.cores)) if step > 0 else 0.0,
            "steal_s": None
            if self._steal0 is None or steal1 is None
            else max(0.0, steal1 - self._steal0),
        }
        now = self._stat_values()
        for name in STAT_FIELDS:
            rec[name] = now.get(name, 0.0) - self._stat0.get(name, 0.0)
        rec["compute_s"] = step - rec["pack_s"] - rec["unpack_s"]
        return rec

    def _stat_values(self) -> dict[str, float]:
        st = self._stats
        if st is None:
            return {}
        return {name: float(getattr(st, name)) for name in STAT_FIELDS}


def medians(records: Sequence[Mapping[str, Any]]) -> dict[str, float | None]:
    """Each field's median over ``records`` (None where no record has it)."""
    if not records:
        return {}
    out: dict[str, float | None] = {}
    for key, first in records[0].items():
        if isinstance(first, bool):
            continue
        values = [float(r[key]) for r in records if r.get(key) is not None]
        out[key] = statistics.median(values) if values else None
    return out
