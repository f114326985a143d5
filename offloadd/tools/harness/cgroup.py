"""A memory cgroup of our own, for a subprocess to run inside a hard limit (``offloadd wall``,
the tests that need a real limit).

Made below the cgroup this process is in (v1's ``memory`` controller, or v2 where ``memory`` can
be enabled for children), with swap off for it, and removed afterwards. Needs root, or a
delegated v2 subtree: :func:`memory_cgroup` raises :class:`CgroupUnavailable`, saying why, where
it cannot be made. An out-of-memory there is the kernel's: its OOM killer ends the process
(SIGKILL), and :meth:`MemoryCgroup.oom_killed` says so.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from pathlib import Path

__all__ = ["ROOT", "CgroupUnavailable", "MemoryCgroup", "memory_cgroup", "remove"]

ROOT = Path("/sys/fs/cgroup")


class CgroupUnavailable(OSError):
    """No memory cgroup with a hard limit can be made here (the message says why)."""


class MemoryCgroup:
    """One cgroup: :meth:`enter` (a ``preexec_fn``) moves the calling process in; :meth:`peak`
    is the most it was charged (anonymous memory and page cache)."""

    def __init__(self, path: Path, v1: bool) -> None:
        self.path = path
        self.v1 = v1
        self.swap_limited = False  # swap is held to the limit too (or there is none)

    def enter(self) -> None:
        (self.path / "cgroup.procs").write_text(str(os.getpid()))

    def peak(self) -> int:
        name = "memory.max_usage_in_bytes" if self.v1 else "memory.peak"
        return int((self.path / name).read_text())

    def oom_killed(self) -> bool:
        """Whether the kernel killed a process of it for memory."""
        text = (self.path / ("memory.oom_control" if self.v1 else "memory.events")).read_text()
        counts = dict(line.split()[:2] for line in text.splitlines() if len(line.split()) >= 2)
        return int(counts.get("oom_kill", "0")) > 0


def _swap_on() -> bool:
    return len(Path("/proc/swaps").read_text().splitlines()) > 1


def _own(controller: str) -> str | None:
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, names, path = line.split(":", 2)
        if controller in names.split(",") or (controller == "" and names == ""):
            return path
    return None


def _make(name: str, limit: int) -> MemoryCgroup:
    v1_parent = ROOT / "memory"
    made: MemoryCgroup | None = None
    try:
        if (v1_parent / "memory.limit_in_bytes").exists():
            own = _own("memory") or "/"
            path = v1_parent / own.lstrip("/") / name
            path.mkdir()
            made = MemoryCgroup(path, v1=True)
            (path / "memory.limit_in_bytes").write_text(str(limit))
            with contextlib.suppress(OSError):  # only where swap accounting is on
                (path / "memory.memsw.limit_in_bytes").write_text(str(limit))
                made.swap_limited = True
        else:
            own = _own("") or "/"
            parent = ROOT / own.lstrip("/")
            if "memory" not in (parent / "cgroup.subtree_control").read_text().split():
                (parent / "cgroup.subtree_control").write_text("+memory")
            path = parent / name
            path.mkdir()
            made = MemoryCgroup(path, v1=False)
            (path / "memory.max").write_text(str(limit))
            with contextlib.suppress(OSError):
                (path / "memory.swap.max").write_text("0")
                made.swap_limited = True
    except OSError as err:
        if made is not None:
            with contextlib.suppress(OSError):
                made.path.rmdir()
        raise CgroupUnavailable(
            f"no memory cgroup can be made here ({err}); run as root, or where a cgroup v2 "
            "subtree is delegated to you"
        ) from None
    if not made.swap_limited and _swap_on():
        made.path.rmdir()
        raise CgroupUnavailable(
            "swap is on and cannot be limited here: a memory limit would not be hard"
        )
    return made


@contextlib.contextmanager
def memory_cgroup(limit: int, prefix: str = "offloadd") -> Iterator[MemoryCgroup]:
    """A fresh memory cgroup limited to ``limit`` bytes, no swap; removed on exit (its
    processes must have ended). :class:`CgroupUnavailable` where none can be made."""
    made = _make(f"{prefix}-{os.getpid()}-{time.monotonic_ns()}", limit)
    try:
        yield made
    finally:
        remove(made.path)


def remove(path: Path) -> None:
    """Remove cgroup ``path`` once its processes have ended (the last may take a moment to
    leave); left in place after 5 s."""
    for _ in range(50):
        try:
            path.rmdir()
            return
        except OSError:
            time.sleep(0.1)
