from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from offloadd.storage import filesystem_type

_MEMORY_FS = {"tmpfs", "ramfs"}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


def _disk_root() -> str:
    """A directory on real disk (ext4/xfs, not tmpfs: tmpfs does not enforce O_DIRECT rules)."""
    for cand in (
        os.environ.get("OFFLOADD_TEST_DIR"),
        tempfile.gettempdir(),
        "/var/tmp",
        os.getcwd(),
    ):
        if cand and os.path.isdir(cand) and filesystem_type(cand) not in _MEMORY_FS:
            return cand
    pytest.skip("no disk-backed directory for offload files")


@pytest.fixture
def disk_dir() -> Iterator[Path]:
    """A fresh directory on a disk file system; asserts nothing is left in it afterwards."""
    d = Path(tempfile.mkdtemp(prefix="offloadd-test-", dir=_disk_root()))
    yield d
    leftovers = list(d.iterdir())
    for p in leftovers:
        p.unlink()
    d.rmdir()
    assert not leftovers, f"files left behind: {leftovers}"
