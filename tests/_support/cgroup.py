"""A memory cgroup of a test's own (offloadd/tools/harness/cgroup.py), and a cgroup that
throttles writes to a disk (a slow disk, for real): the test skipped where none can be made
(not root)."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from offloadd.tools.harness import cgroup
from offloadd.tools.harness.cgroup import CgroupUnavailable, MemoryCgroup

__all__ = ["MemoryCgroup", "memory_cgroup", "slow_writes"]


@contextlib.contextmanager
def memory_cgroup(limit: int) -> Iterator[MemoryCgroup]:
    """A fresh memory cgroup limited to ``limit`` bytes, no swap; removed on exit."""
    with contextlib.ExitStack() as stack:
        try:
            cg = stack.enter_context(cgroup.memory_cgroup(limit, prefix="offloadd-test"))
        except CgroupUnavailable as err:
            pytest.skip(str(err))
        yield cg


def _disk_of(path: Path) -> str:
    """``major:minor`` of the disk ``path`` lies on (its whole disk, for a partition)."""
    dev = os.stat(path).st_dev
    node = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}")
    if (node / "partition").exists():
        node = node.resolve().parent
    if not (node / "dev").exists():
        pytest.skip(f"{path} is on no block device ({node}): its writes cannot be throttled")
    return (node / "dev").read_text().strip()


@contextlib.contextmanager
def slow_writes(path: Path, bytes_per_s: int) -> Iterator[Path]:
    """A cgroup of v1's blkio controller whose processes write to the disk of ``path`` at most
    ``bytes_per_s``: yields its ``cgroup.procs``, for a child to write its pid to (as
    ``MemoryCgroup.enter``); removed on exit. v1 only: under v2 a process in such a cgroup could
    make no memory cgroup below it (no internal processes), and ``offloadd wall`` makes one."""
    disk = _disk_of(path)
    v1 = Path("/sys/fs/cgroup/blkio")
    if not (v1 / "blkio.throttle.write_bps_device").exists():
        pytest.skip("no cgroup v1 blkio controller here to throttle writes with")
    made = v1 / f"offloadd-test-io-{os.getpid()}-{time.monotonic_ns()}"
    try:
        made.mkdir()
        (made / "blkio.throttle.write_bps_device").write_text(f"{disk} {bytes_per_s}")
    except OSError as err:
        with contextlib.suppress(OSError):
            made.rmdir()
        pytest.skip(f"no cgroup throttles writes to {disk} here ({err})")
    try:
        yield made / "cgroup.procs"
    finally:
        cgroup.remove(made)
