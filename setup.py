"""Build steps that pyproject.toml cannot express.

1. The optional native I/O engine (csrc/native.c -> offloadd.io._native). If the compiler or the
   headers are missing, ``pip install`` still succeeds, ``import offloadd`` still works, and
   ``engine = "auto"`` logs that it fell back to the Python engine and why. The codec's fused
   quantisation kernels (csrc/codec.c -> offloadd.codec._kernels) are optional the same way:
   without them the codec runs as torch ops.
2. The C++ sources compiled at first use against the torch they run with (the host cache,
   csrc/host_allocator.cpp, and memsave's kernels and C++ autograd functions,
   csrc/memsave_kernels.{cpp,h} and csrc/memsave_ops.cpp; see
   offloadd/native_build.py) go into the package, as offloadd/csrc/.
3. offloadd.pth: the start-up hook (see offloadd_boot.py) must land at the top of site-packages,
   for ``pip install .`` (a wheel) and ``pip install -e .`` (an editable wheel) alike.
"""

from __future__ import annotations

import os
import sys

from setuptools import Extension, setup
from setuptools.command.build_py import build_py

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from offloadd_boot import PTH_LINE  # standard library only: safe at build time

PTH_NAME = "offloadd.pth"
FIRST_USE_SOURCES = (
    "host_allocator.cpp",
    "memsave_kernels.cpp",
    "memsave_kernels.h",
    "memsave_ops.cpp",
)


class BuildPyWithPth(build_py):
    """build_py that also writes offloadd.pth at the root of what becomes site-packages, and
    copies the sources compiled at first use into the package (an editable install finds them in
    csrc/).

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
        if not getattr(self, "editable_mode", False):
            csrc = os.path.join(self.build_lib, "offloadd", "csrc")
            os.makedirs(csrc, exist_ok=True)
            for name in FIRST_USE_SOURCES:
                self.copy_file(os.path.join("csrc", name), os.path.join(csrc, name))
        path = os.path.join(root, PTH_NAME)
        with open(path, "w", encoding="utf-8") as f:
            f.write(PTH_LINE)

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        outputs = list(super().get_outputs(include_bytecode))
        if not getattr(self, "editable_mode", False):
            outputs.append(os.path.join(self.build_lib, PTH_NAME))
            for name in FIRST_USE_SOURCES:
                outputs.append(os.path.join(self.build_lib, "offloadd", "csrc", name))
        return outputs


setup(
    cmdclass={"build_py": BuildPyWithPth},
    ext_modules=[
        Extension(
            "offloadd.io._native",
            sources=["csrc/native.c"],
            extra_compile_args=["-O2", "-std=gnu11", "-Wall", "-Wextra", "-Wno-unused-parameter"],
            extra_link_args=["-pthread"],
            optional=True,
        ),
        Extension(
            "offloadd.codec._kernels",
            sources=["csrc/codec.c"],
            # -ffp-contract=off: no fused multiply-add, so results match the torch path bitwise
            extra_compile_args=[
                "-O3",
                "-std=gnu11",
                "-Wall",
                "-Wextra",
                "-Wno-unused-parameter",
                "-Wno-missing-field-initializers",
                "-ffp-contract=off",
            ],
            optional=True,
        ),
    ],
)
