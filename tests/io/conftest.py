"""The test build of the native engine, with the fault hooks (tests/io/native_build.py)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

import offloadd.io
from tests.io import native_build


@pytest.fixture(scope="session")
def native_test_build(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The path of the test build of ``offloadd.io._native`` (fault hooks in), compiled once per
    session."""
    try:
        return native_build.build(tmp_path_factory.mktemp("native-test-build"), faults=True)
    except native_build.NoBuild as e:
        pytest.skip(f"no test build of offloadd.io._native: {e}")


@pytest.fixture
def native_faults(native_test_build: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[ModuleType]:
    """The test build, as the ``offloadd.io._native`` that ``NativeEngine`` uses during the test."""
    module = native_build.load(native_test_build)
    monkeypatch.setitem(sys.modules, "offloadd.io._native", module)
    monkeypatch.setattr(offloadd.io, "_native", module, raising=False)
    yield module
