"""A memory cgroup of a test's own (offloadd/tools/harness/cgroup.py), the test skipped where
none can be made (not root)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest

from offloadd.tools.harness import cgroup
from offloadd.tools.harness.cgroup import CgroupUnavailable, MemoryCgroup

__all__ = ["MemoryCgroup", "memory_cgroup"]


@contextlib.contextmanager
def memory_cgroup(limit: int) -> Iterator[MemoryCgroup]:
    """A fresh memory cgroup limited to ``limit`` bytes, no swap; removed on exit."""
    with contextlib.ExitStack() as stack:
        try:
            cg = stack.enter_context(cgroup.memory_cgroup(limit, prefix="offloadd-test"))
        except CgroupUnavailable as err:
            pytest.skip(str(err))
        yield cg
