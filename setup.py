"""Build steps that pyproject.toml cannot express.

1. Every native library, compiled here, once, by the package build (``pip install``, a wheel,
   ``pip install -e``); nothing is compiled at run time. One folder of csrc/ per library (and
   csrc/tests/, the C libraries' C tests, which no install builds: docs/native.md):

   ========================  ==============================  =====================================
   csrc/                     extension module                binding
   ========================  ==============================  =====================================
   io_native/*.c             offloadd.io._native             CPython C API (no torch)
   codec/*.c                 offloadd.codec._kernels         CPython C API (no torch)
   write_guard/*.c           offloadd.relay._write_guard     CPython C API (no torch)
   hot_path/*.c              offloadd.runtime._held          CPython C API (no torch)
   host_allocator/*.cpp      offloadd.runtime._host_cache    torch ops (torch.utils.cpp_extension)
   memsave/*.cpp             offloadd.memsave._kernels       torch ops (torch.utils.cpp_extension)
   ========================  ==============================  =====================================

   The torch-linked libraries register ``torch.ops.offloadd_host_cache.*`` and
   ``torch.ops.offloadd_memsave.*`` when their (otherwise empty) module is imported; they must be
   built against the torch they run with, so this build needs torch importable: install torch
   first, then ``pip install --no-build-isolation .`` (pip's build isolation would build against
   another torch, fetched from PyPI). The four C libraries link only libc: built without torch,
   they survive a torch upgrade, and they release the GIL on their own threads (docs/native.md).

2. All six are optional. A library that fails to build (or a torch library, where torch is not
   importable here) does not fail the install: the build says which one and why, and at run time
   offloadd uses that library's fallback and warns, naming it (docs/native.md). pip shows a
   build's output only with ``-v``, so that notice also goes to the terminal (/dev/tty) when
   there is one.
3. offloadd.pth: the start-up hook (see offloadd_boot.py) must land at the top of site-packages,
   for ``pip install .`` (a wheel) and ``pip install -e .`` (an editable wheel) alike.
"""

from __future__ import annotations

import os
import platform
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.command.build_py import build_py

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from offloadd_boot import PTH_LINE  # standard library only: safe at build time

PTH_NAME = "offloadd.pth"
C_FLAGS = ["-std=gnu11", "-Wall", "-Wextra", "-Wno-unused-parameter"]
REBUILD = "install torch first, then: pip install --no-build-isolation . (docs/native.md)"

try:  # the torch libraries are built against the torch importable here
    from torch.utils.cpp_extension import BuildExtension, CppExtension
except ImportError as e:  # pip's isolated build, or no torch yet
    TORCH_MISSING: str | None = f"torch is not importable in this build ({e})"
else:
    TORCH_MISSING = None


def c_extensions() -> list[Extension]:
    return [
        Extension(
            "offloadd.io._native",
            # every .c of csrc/io_native but faults.c, which only the tests' build compiles in
            # (-DOFFLOADD_FAULTS: tests/io/native_build.py, docs/native.md)
            sources=[
                "csrc/io_native/engine.c",
                "csrc/io_native/posix_io.c",
                "csrc/io_native/ring.c",
                "csrc/io_native/uring_backend.c",
                "csrc/io_native/module.c",
            ],
            depends=[
                "csrc/io_native/engine.h",
                "csrc/io_native/faults.h",
                "csrc/io_native/posix_io.h",
                "csrc/io_native/request.h",
                "csrc/io_native/ring.h",
            ],
            # hidden: the engine's C functions (engine_*, ring_*) are not the module's interface
            extra_compile_args=["-O2", *C_FLAGS, "-fvisibility=hidden"],
            extra_link_args=["-pthread"],
            optional=True,
        ),
        Extension(
            "offloadd.codec._kernels",
            sources=["csrc/codec/codec.c", "csrc/codec/module.c"],
            depends=["csrc/codec/codec.h"],
            # -ffp-contract=off: no fused multiply-add, so results match the torch path bitwise
            extra_compile_args=[
                "-O3",
                *C_FLAGS,
                "-Wno-missing-field-initializers",
                "-ffp-contract=off",
                "-fvisibility=hidden",
            ],
            optional=True,
        ),
        Extension(
            "offloadd.runtime._held",
            sources=["csrc/hot_path/held.c", "csrc/hot_path/passing.c"],
            depends=["csrc/hot_path/passing.h"],
            extra_compile_args=["-O2", *C_FLAGS, "-Wno-missing-field-initializers"],
            optional=True,
        ),
        Extension(
            "offloadd.relay._write_guard",
            sources=["csrc/write_guard/guard.c", "csrc/write_guard/chain.c"],
            depends=["csrc/write_guard/guard.h"],
            extra_compile_args=["-O2", *C_FLAGS],
            optional=True,
        ),
    ]


TORCH_LIBRARIES = {
    "offloadd.runtime._host_cache": "the host cache (host_allocator = 'caching')",
    "offloadd.memsave._kernels": "memsave's kernels and C++ autograd ops",
}
"""The torch-linked extension modules, with what they are to a user."""


def torch_extensions() -> list[Extension]:
    """The torch libraries this machine builds (memsave's kernels are x86-64 code)."""
    out = [
        CppExtension(
            "offloadd.runtime._host_cache",
            sources=["csrc/host_allocator/host_allocator.cpp"],
            extra_compile_args=["-O2", "-std=c++20"],
            optional=True,
        )
    ]
    if platform.machine() in ("x86_64", "AMD64"):
        out.append(
            CppExtension(
                "offloadd.memsave._kernels",
                sources=[
                    "csrc/memsave/kernels.cpp",
                    "csrc/memsave/kernel_ops.cpp",
                    "csrc/memsave/autograd_ops.cpp",
                ],
                depends=["csrc/memsave/kernels.h"],
                # torch 2.13's autograd headers want C++20; OpenMP: at::parallel_for's loop
                extra_compile_args=["-O3", "-std=c++20", "-fopenmp"],
                extra_link_args=["-fopenmp"],
                optional=True,
            )
        )
    return out


def announce(lines: list[str]) -> None:
    """Say ``lines`` on stderr, and on the terminal where stderr is not one (pip hides a
    build's output unless it fails or runs with -v)."""
    text = "\n".join(["", "=" * 78, *lines, "=" * 78, ""]) + "\n"
    sys.stderr.write(text)
    sys.stderr.flush()
    if sys.stderr.isatty():
        return
    try:
        with open("/dev/tty", "w", encoding="utf-8") as tty:
            tty.write(text)
    except OSError:
        pass  # no terminal (CI): the notice is in the build log (pip -v)


class BuildNativeMixin:
    """build_ext that builds the C libraries with setuptools' compiler as it is and the torch
    libraries with torch's BuildExtension, and turns an optional library's failure into a
    notice naming it and the error."""

    extensions: list[Extension]

    def initialize_options(self) -> None:
        super().initialize_options()  # type: ignore[misc]
        self.skipped: list[tuple[str, str]] = []
        """(extension module, why) of each optional library not built."""

    def run(self) -> None:
        if TORCH_MISSING is not None:
            self.skipped += [(name, TORCH_MISSING) for name in TORCH_LIBRARIES]
        super().run()  # type: ignore[misc]
        if self.skipped:
            lines = ["offloadd: WARNING: native libraries NOT built (offloadd runs without them):"]
            for name, why in self.skipped:
                what = TORCH_LIBRARIES.get(name)
                lines.append(f"  {name}{f', {what}' if what else ''}: {why}")
            if any(why != TORCH_MISSING for _, why in self.skipped):
                lines.append("A compiler's messages are in the build log (pip install -v).")
            lines.append(f"Their fallbacks are in docs/native.md. To build them: {REBUILD}")
            announce(lines)

    def build_extension(self, ext: Extension) -> None:
        try:
            super().build_extension(ext)  # type: ignore[misc]
        except Exception as e:  # a compiler error, or torch's build tools' RuntimeError
            if not ext.optional:
                raise
            why = " ".join(str(e).split())[-600:] or type(e).__name__
            self.skipped.append((ext.name, why))


class BuildC(BuildNativeMixin, build_ext):
    """Where torch is not importable: the C libraries only."""


if TORCH_MISSING is None:

    class BuildNative(BuildNativeMixin, BuildExtension):
        def build_extensions(self) -> None:
            everything = self.extensions
            torch_made = [e for e in everything if e.name in TORCH_LIBRARIES]
            try:
                # the C libraries first, before BuildExtension wraps the compiler with its flags
                self.extensions = [e for e in everything if e not in torch_made]
                build_ext.build_extensions(self)
                self.extensions = torch_made
                try:
                    super().build_extensions()
                except Exception as e:  # before any library (torch's compiler checks)
                    failed = {name for name, _ in self.skipped}
                    why = " ".join(str(e).split())[-600:] or type(e).__name__
                    self.skipped += [(x.name, why) for x in torch_made if x.name not in failed]
            finally:
                self.extensions = everything

    BUILD_EXT: type[build_ext] = BuildNative.with_options(use_ninja=False)
else:
    BUILD_EXT = BuildC


class BuildPyWithPth(build_py):
    """build_py that also writes offloadd.pth at the root of what becomes site-packages.

    A regular build puts it into build_lib, the wheel's root. An editable build does not copy
    build_lib into the wheel; there the ``install`` command's install_lib is the directory that
    is zipped into the editable wheel (setuptools' editable_wheel sets it up that way for
    data, headers and scripts), so the .pth goes there."""

    def run(self) -> None:
        super().run()
        if getattr(self, "editable_mode", False):
            root = self.get_finalized_command("install").install_lib
        else:
            root = self.build_lib
        os.makedirs(root, exist_ok=True)
        path = os.path.join(root, PTH_NAME)
        with open(path, "w", encoding="utf-8") as f:
            f.write(PTH_LINE)

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        outputs = list(super().get_outputs(include_bytecode))
        if not getattr(self, "editable_mode", False):
            outputs.append(os.path.join(self.build_lib, PTH_NAME))
        return outputs


ext_modules: list[Extension] = c_extensions() + (
    torch_extensions() if TORCH_MISSING is None else []
)

setup(
    cmdclass={"build_py": BuildPyWithPth, "build_ext": BUILD_EXT},
    ext_modules=ext_modules,
)
