"""Build hook for the optional native I/O engine (csrc/); everything else is in pyproject.toml.

The extension is optional: if the compiler or headers are missing, ``pip install`` still
succeeds, ``import offloadd`` still works, and ``engine = "auto"`` logs that it fell back to
the Python engine and why.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "offloadd._native",
            sources=["csrc/native.c"],
            extra_compile_args=["-O2", "-std=gnu11", "-Wall", "-Wextra", "-Wno-unused-parameter"],
            extra_link_args=["-pthread"],
            optional=True,
        )
    ]
)
