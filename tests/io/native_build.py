"""Builds of csrc/io_native/ that only the tests use, compiled here with the C compiler.

- The *test build* adds csrc/io_native/faults.c and ``-DOFFLOADD_FAULTS``: the module then has
  the fault hooks ``_inject_fault``, ``_hold_copies`` and ``_held_copies`` (faults.h), which the
  production ``offloadd.io._native`` that setup.py builds does not hold.
- With ``NATIVE_TESTS_SANITIZE=1`` (csrc/tests/sanitize.sh), every build here is instrumented
  with ASan and UBSan, and the tests of tests/io/ run on a sanitized build of the production
  sources in place of the installed module (tests/io/conftest.py).

Each is a module named ``offloadd.io._native`` (the sources' ``PyInit__native``), loaded from its
own file; the fixtures of tests/io/conftest.py put it where ``offloadd.io.native`` finds it, and
:data:`CHILD_INSTALL` does the same in a child process. A test that
cannot get its build (no compiler, no Python headers) skips and says why; one whose build fails
to compile fails. docs/native.md says why the hooks are built this way.
"""

from __future__ import annotations

import importlib.util
import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path
from types import ModuleType

import pytest

__all__ = ["SANITIZE", "NoBuild", "build", "install", "load", "sources"]

ROOT = Path(__file__).resolve().parent.parent.parent
SOURCES = ROOT / "csrc" / "io_native"
FAULTS_SOURCE = "faults.c"

SANITIZE = os.environ.get("NATIVE_TESTS_SANITIZE") == "1"
"""Whether this run builds with ASan and UBSan (csrc/tests/sanitize.sh sets it; not an
``OFFLOADD_*`` variable, which offloadd's config would refuse as an unknown key)."""

# the flags of setup.py's extension, and -g for a debugger and the sanitizers' reports
FLAGS = ["-std=gnu11", "-O2", "-g", "-Wall", "-Wextra", "-Wno-unused-parameter"]
FLAGS += ["-fvisibility=hidden", "-fPIC", "-shared", "-pthread"]
SANITIZE_FLAGS = [
    "-fsanitize=address,undefined",
    "-fno-sanitize-recover=all",  # a UBSan report ends the process: the run cannot miss it
    "-fno-omit-frame-pointer",
]


class NoBuild(Exception):
    """This machine cannot build the module (no compiler, no Python headers)."""


def sources(*, faults: bool) -> list[Path]:
    """The C sources of the module: setup.py's, and faults.c for the test build."""
    return sorted(p for p in SOURCES.glob("*.c") if faults or p.name != FAULTS_SOURCE)


def _compiler() -> list[str]:
    cc = shlex.split(os.environ.get("CC", "")) or ["cc"]
    if shutil.which(cc[0]) is None:
        raise NoBuild(f"no C compiler ({cc[0]!r} is not on PATH)")
    return cc


def build(out_dir: Path, *, faults: bool, sanitize: bool = SANITIZE) -> Path:
    """Compile the module into ``out_dir``; returns the path of the shared object."""
    include = sysconfig.get_paths()["include"]
    if not (Path(include) / "Python.h").is_file():
        raise NoBuild(f"no Python headers (Python.h) in {include}")
    cmd = [*_compiler(), *FLAGS, f"-I{include}"]
    if faults:
        cmd.append("-DOFFLOADD_FAULTS")
    if sanitize:
        cmd += SANITIZE_FLAGS
    out = out_dir / f"_native{sysconfig.get_config_var('EXT_SUFFIX')}"
    cmd += [str(p) for p in sources(faults=faults)] + ["-o", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        pytest.fail(f"the test build of csrc/io_native/ failed:\n{shlex.join(cmd)}\n{done.stderr}")
    return out


_LOADED: dict[Path, ModuleType] = {}


def load(path: Path) -> ModuleType:
    """The module ``offloadd.io._native`` built at ``path``, loaded once (not installed)."""
    if path not in _LOADED:
        spec = importlib.util.spec_from_file_location("offloadd.io._native", path)
        assert spec is not None and spec.loader is not None, path
        # CPython files a module of single-phase init under its name in sys.modules as it loads
        # it: put back what was there, so that loading installs nothing
        before = sys.modules.get(spec.name)
        try:
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
        finally:
            if before is None:
                sys.modules.pop(spec.name, None)
            else:
                sys.modules[spec.name] = before
        _LOADED[path] = module
    return _LOADED[path]


def install(module: ModuleType) -> None:
    """Make ``module`` the ``offloadd.io._native`` that ``offloadd.io.native`` loads."""
    import offloadd.io

    sys.modules["offloadd.io._native"] = module
    offloadd.io._native = module  # type: ignore[attr-defined]


# The child processes of tests/io/test_native_faults.py run this first: argv[2] is the test build.
CHILD_INSTALL = """
import importlib.util as _util, sys as _sys
_spec = _util.spec_from_file_location("offloadd.io._native", _sys.argv[2])
_native = _util.module_from_spec(_spec)
_spec.loader.exec_module(_native)
_sys.modules["offloadd.io._native"] = _native
import offloadd.io
offloadd.io._native = _native
"""
