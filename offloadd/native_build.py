"""C++ sources of csrc/ compiled at first use against the torch that runs them.

Used for the host cache (csrc/host_allocator.cpp, :mod:`offloadd.runtime.host_allocator`) and
memsave's kernels and C++ autograd functions (csrc/memsave_kernels.cpp with memsave_ops.cpp,
:mod:`offloadd.memsave.kernels`). They are not
built by ``pip install``: pip builds in an isolated environment without torch, and a library that
links against torch must match the torch it is loaded into.

A library is compiled with the C++ compiler (``$CXX``, else ``c++``) and cached per source, flags,
torch version and ABI under ``$XDG_CACHE_HOME/offloadd`` (else ``~/.cache/offloadd``); a file lock
keeps the ranks of a node from building it twice at once. A wheel carries the sources in
``offloadd/csrc/`` (setup.py copies them there); a source tree has them in ``csrc/``.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

import torch

__all__ = ["NativeBuildError", "build", "cache_dir", "library_path", "source_path"]

log = logging.getLogger("offloadd")


class NativeBuildError(RuntimeError):
    """A source could not be found or compiled (the message says why)."""


def source_path(name: str) -> Path:
    """The C++ source ``name``: in the package's csrc/ (a wheel), or the source tree's."""
    package = Path(__file__).resolve().parent
    for candidate in (package / "csrc" / name, package.parent / "csrc" / name):
        if candidate.is_file():
            return candidate
    raise NativeBuildError(
        f"its source {name} is missing (looked in {package / 'csrc'} and {package.parent / 'csrc'})"
    )


def cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "offloadd"


def library_path(
    name: str,
    *,
    also: Sequence[str] = (),
    flags: Sequence[str] = (),
    libs: Sequence[str] = ("c10",),
    directory: Path | None = None,
) -> Path:
    """Where :func:`build` keeps the library of csrc/``name`` for this torch (built or not yet;
    nothing is compiled or created). Its name holds the cache key: the sources, torch's version,
    directory and ABI, the compiler and the flags."""
    src = source_path(name)
    others = [source_path(other) for other in also]
    torch_dir = Path(torch.__file__).resolve().parent
    key = hashlib.sha256(
        b"\0".join(
            [
                src.read_bytes(),
                *(p.read_bytes() for p in others),
                torch.__version__.encode(),
                str(torch_dir).encode(),
                b"%d" % int(torch._C._GLIBCXX_USE_CXX11_ABI),
                (os.environ.get("CXX") or "c++").encode(),
                " ".join([*flags, *libs]).encode(),
            ]
        )
    ).hexdigest()[:16]
    directory = directory if directory is not None else cache_dir()
    return directory / f"{Path(name).stem}-{key}.so"


def build(
    name: str,
    *,
    also: Sequence[str] = (),
    flags: Sequence[str] = (),
    libs: Sequence[str] = ("c10",),
    what: str = "",
    directory: Path | None = None,
) -> Path:
    """The shared library of csrc/``name`` for this torch, compiled now unless already cached.

    ``also`` are more files of csrc/ that go into it: sources (``.cpp``) compiled with ``name``,
    headers only read by them (both part of the cache key). ``flags`` go to the compiler before
    the sources (a ``-std=`` there overrides the default C++17), ``libs`` are torch's libraries
    to link; ``what`` names the library in the log line."""
    target = library_path(name, also=also, flags=flags, libs=libs, directory=directory)
    directory = target.parent
    src = source_path(name)
    others = [source_path(other) for other in also]
    compiled = [str(src), *(str(p) for p in others if p.suffix == ".cpp")]
    torch_dir = Path(torch.__file__).resolve().parent
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    cxx = os.environ.get("CXX") or "c++"
    stem = Path(name).stem
    if target.is_file():
        return target
    compiler = shutil.which(cxx)
    if compiler is None:
        raise NativeBuildError(f"no C++ compiler: {cxx!r} is not on PATH (set CXX, or install g++)")
    try:
        directory.mkdir(parents=True, exist_ok=True)
        lock = open(directory / ".build.lock", "w")  # noqa: SIM115 (held across the build)
    except OSError as e:
        raise NativeBuildError(f"cannot write its build cache {directory}: {e}") from e
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another rank may be building it right now
        if target.is_file():
            return target
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{stem}-", suffix=".so")
        os.close(fd)
        cmd = [
            compiler, "-std=c++17", "-shared", "-fPIC", f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
            *flags, f"-I{torch_dir / 'include'}", *compiled, "-o", tmp,
            f"-L{torch_dir / 'lib'}", *(f"-l{lib}" for lib in libs),
            f"-Wl,-rpath,{torch_dir / 'lib'}",
        ]  # fmt: skip
        log.info(
            "offloadd: building %s for torch %s (once): %s",
            what or stem,
            torch.__version__,
            " ".join(cmd),
        )
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        except (OSError, subprocess.TimeoutExpired) as e:
            os.unlink(tmp)
            raise NativeBuildError(f"{compiler} failed: {e}") from e
        if done.returncode != 0:
            os.unlink(tmp)
            tail = "\n".join(done.stderr.strip().splitlines()[-12:])
            raise NativeBuildError(f"{compiler} exited with {done.returncode}:\n{tail}")
        os.replace(tmp, target)
    return target
