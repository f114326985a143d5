"""The native engine's builds for the tests of tests/io/ (tests/io/native_build.py): the test
build with the fault hooks, and under ``NATIVE_TESTS_SANITIZE=1`` (csrc/tests/sanitize.sh) a
sanitized build of the production sources in place of the installed ``offloadd.io._native`` for
the whole run."""

from __future__ import annotations

import atexit
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

import offloadd.io
from tests.io import native_build

if native_build.SANITIZE:  # before any test imports the installed module
    _sanitized = Path(tempfile.mkdtemp(prefix="offloadd-native-sanitized-"))
    atexit.register(shutil.rmtree, _sanitized, ignore_errors=True)
    # no compiler here is an error, not a skip: this run exists to test the sanitized build
    native_build.install(native_build.load(native_build.build(_sanitized, faults=False)))


@pytest.fixture(scope="session")
def native_test_build(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The path of the test build of ``offloadd.io._native`` (fault hooks in), compiled once per
    session (sanitized in a sanitized run)."""
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
