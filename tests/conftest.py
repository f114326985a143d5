from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from offloadd import native
from offloadd.storage import filesystem_type
from tests import helpers

_MEMORY_FS = {"tmpfs", "ramfs"}


# Every test that does I/O (uses ``disk_dir``) runs once per engine: the native engine with each
# backend, and the Python reference engine.
ENGINES = ("native-uring", "native-threads", "python")


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "engine_name" in metafunc.fixturenames:
        # a module that picks its engines itself sets ENGINE_PARAMS (e.g. test_native.py)
        params = getattr(metafunc.module, "ENGINE_PARAMS", ENGINES)
        metafunc.parametrize("engine_name", params, indirect=True)


@pytest.fixture
def engine_name(request: pytest.FixtureRequest) -> Iterator[str]:
    """The engine this test runs on; ``helpers.small_offloader`` uses it unless told otherwise."""
    name: str = request.param
    if name.startswith("native"):
        ok, why = native.available()
        if not ok:
            pytest.fail(f"native engine unavailable: {why}")  # it must build wherever CI runs
        if name == "native-uring" and not native.uring_available()[0]:
            pytest.skip(f"io_uring unavailable: {native.uring_available()[1]}")
    helpers.ENGINE = helpers.ENGINE_OPTIONS[name]
    yield name
    helpers.ENGINE = helpers.ENGINE_OPTIONS["python"]


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
def disk_dir(engine_name: str) -> Iterator[Path]:
    """A fresh directory on a disk file system; asserts nothing is left in it afterwards."""
    d = Path(tempfile.mkdtemp(prefix="offloadd-test-", dir=_disk_root()))
    yield d
    leftovers = list(d.iterdir())
    for p in leftovers:
        p.unlink()
    d.rmdir()
    assert not leftovers, f"files left behind: {leftovers}"
