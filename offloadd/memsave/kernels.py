"""memsave's native kernels (csrc/memsave/kernels.cpp): a ReLU and its bit mask in one pass, a mask
back into a gradient in one pass, and MaxPool's indices to window offsets and back; and, in the
same library, memsave's two hottest autograd functions in C++ (csrc/memsave/autograd_ops.cpp).

The library is the extension module ``offloadd.memsave._kernels``, built by offloadd's install
against the torch installed then (setup.py; nothing is compiled at run time); importing it
registers its torch ops, ``torch.ops.offloadd_memsave.*`` (the kernels' through
csrc/memsave/kernel_ops.cpp). :func:`native` returns them when they can serve: the module built
and loaded, and the CPU with AVX2. Otherwise it returns ``None``, says why once per process in
the log (a warning naming the module where it is not built or does not load), and memsave keeps
its torch-op path (:mod:`offloadd.memsave.bits`, :mod:`offloadd.memsave.pool`: bitwise the same
results, more passes over memory). The mask kernels take contiguous float32 or bfloat16 CPU tensors
(:func:`serves`), the pooling ones contiguous CPU indices; callers keep the torch-op path for
anything else. ``OFFLOADD_MEMSAVE_KERNELS=0`` turns them off.

Note: [C++ functions]
~~~~~~~~~~~~~~~~~~~~~
A Python ``autograd.Function`` costs tens of microseconds per call beyond the op it wraps: its
context is built in Python, and backward has the engine take the GIL to call back into Python.
A ResNet-101 step has 104 frozen convolutions and 100 ReLUs, so at small images those calls are
a visible share of memsave's step over plain's. So the ReLU that keeps bits and the selective
convolution are also C++ ops (csrc/memsave/autograd_ops.cpp),
registered as ``torch.ops.offloadd_memsave.*`` when the library loads, and written as PyTorch's
generated autograd kernels are: a typed backward Node, ``set_history`` (``rebase_history`` in
place), because ``torch::autograd::Function`` costs more per call in its generic context. They
run the same forward, save the same tensors (offloadd's hooks see them), call the same backward
ops on the same arguments and behave as ``once_differentiable``; per call they cost little more
than torch's own ops (the figures, before and after:
docs/benchmarks/memsave_cppops_cpu-2core_2026-11-24.md).
:func:`~offloadd.memsave.pointwise.relu_bits` and :func:`~offloadd.memsave.conv.conv_selective`
call them when :func:`native` serves and their Python functions otherwise, so the tests compare
both paths with plain PyTorch. The rest (LeakyReLU, Dropout, MaxPool, BatchNorm and the norms)
stay Python: one call per model, or absent from the models where the step time counts.
Forward-mode AD through them is refused by name, as a Python function without ``jvp`` refuses it.

Note: [compiled autograd]
~~~~~~~~~~~~~~~~~~~~~~~~~
Compiled autograd (``torch._dynamo.config.compiled_autograd``) traces backward node by node and
needs each node's ``compiled_args``; the C++ nodes above have none it could use, while the Python
functions trace like any ``autograd.Function``. So :func:`node_kernels`, which the two ops
above ask, gives ``None`` (the Python functions) while that setting is on at forward, and the
C++ nodes' ``compiled_args`` raise an error naming the node and this remedy for the one case
left: compiled autograd switched on around backward only, after a forward that built C++ nodes.
Under ``torch.compile`` the kernels are never called (:func:`native` is ``None`` while dynamo
traces: they read raw pointers, which fake tensors have not): the compiled region runs memsave's
Python functions, which dynamo traces into the graph.
"""

from __future__ import annotations

import importlib
import logging
import math
import os
import platform
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

__all__ = [
    "DTYPES",
    "ENV",
    "EXTENSION",
    "Kernels",
    "native",
    "node_kernels",
    "serves",
    "torch_ops_only",
]

log = logging.getLogger("offloadd")

ENV = "OFFLOADD_MEMSAVE_KERNELS"
EXTENSION = "offloadd.memsave._kernels"
"""The extension module that holds the kernels (built by offloadd's install)."""
DTYPES = (torch.float32, torch.bfloat16)
"""The dtypes of the mask kernels."""


class Kernels:
    """The loaded library's ops. Every tensor passed is a contiguous CPU tensor (the ops check)."""

    def __init__(self, ops: Any) -> None:
        self.vectorised = bool(ops.vectorised())
        """Whether the CPU has AVX2 (:func:`native` serves nothing without it)."""
        self._relu_mask = ops.relu_mask.default
        self._relu_mask_ = ops.relu_mask_.default
        self._pack = ops.pack_mask.default
        self._select = ops.select_mask.default
        self._expand = ops.expand_mask.default
        self._pool_compact = ops.pool_compact.default
        self._pool_expand = ops.pool_expand.default
        # the autograd functions in C++: Note [C++ functions]
        self.relu_bits = ops.relu_bits.default
        """``relu_bits(x)``: the ReLU keeping bits, for tensors :func:`serves` takes."""
        self.relu_bits_ = ops.relu_bits_.default
        """``relu_bits_(x)``: the same in place."""
        self.conv_selective = ops.conv_selective.default
        """``conv_selective(x, weight, bias, stride, padding, dilation, transposed,
        output_padding, groups)``: :func:`offloadd.memsave.conv.conv_selective`."""

    def relu(self, x: torch.Tensor, inplace: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """``relu(x)`` (into ``x`` if ``inplace``) and the packed bits of ``not (result <= 0)``:
        the kernel alone (memsave's ReLU calls it from C++, through :attr:`relu_bits`). For
        bfloat16 the op itself is torch's (its rounding of NaN payloads is torch's business)."""
        if inplace:
            return x, self._relu_mask_(x)
        out, bits = self._relu_mask(x)
        return out, bits

    def pack(self, t: torch.Tensor, positive: bool) -> torch.Tensor:
        """The packed bits of ``t > 0`` if ``positive``, else of ``not (t <= 0)``."""
        bits: torch.Tensor = self._pack(t, positive)
        return bits

    def select(self, grad: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
        """A new tensor: float32 ``grad`` where the bit is set, ``+0`` elsewhere (bfloat16: see
        csrc/memsave/kernels.cpp)."""
        out: torch.Tensor = self._select(grad, bits)
        return out

    def expand(
        self, bits: torch.Tensor, shape: torch.Size | tuple[int, ...], dtype: torch.dtype
    ) -> torch.Tensor:
        """A new contiguous tensor of ``shape``: 1 where the bit is set, 0 elsewhere."""
        out: torch.Tensor = self._expand(bits, list(shape), dtype)
        return out

    def pool_compact(
        self,
        indices: torch.Tensor,
        in_shape: torch.Size,
        geometry: _Geometry,
        dtype: torch.dtype,
    ) -> torch.Tensor:
        """``compact_indices`` of :mod:`offloadd.memsave.pool`, into ``dtype``, in one pass."""
        planes, g = _pool_args(indices.shape, in_shape, geometry)
        offsets: torch.Tensor = self._pool_compact(indices, planes, g, dtype)
        return offsets

    def pool_expand(
        self, offsets: torch.Tensor, in_shape: torch.Size, geometry: _Geometry
    ) -> torch.Tensor:
        """``expand_indices`` of :mod:`offloadd.memsave.pool`: int64 indices, in one pass."""
        planes, g = _pool_args(offsets.shape, in_shape, geometry)
        indices: torch.Tensor = self._pool_expand(offsets, planes, g)
        return indices


_Geometry = tuple[list[int], list[int], list[int], list[int]]  # kernel, stride, padding, dilation


def _pool_args(
    out_shape: torch.Size, in_shape: torch.Size, geometry: _Geometry
) -> tuple[int, list[int]]:
    """The planes and the 18 geometry integers of csrc's Pool (2d as 3d with a depth of 1)."""
    kernel, stride, padding, dilation = geometry
    nd = len(kernel)
    lead = 3 - nd
    rows = [
        [1] * lead + list(in_shape[-nd:]),
        [1] * lead + list(out_shape[-nd:]),
        [1] * lead + list(kernel),
        [1] * lead + list(stride),
        [0] * lead + list(padding),
        [1] * lead + list(dilation),
    ]
    planes = math.prod(out_shape[:-nd])
    return planes, [v for row in rows for v in row]


_lock = threading.Lock()
_state: list[Kernels | None] = []  # empty until the first call of native()
_torch_ops_only = 0  # depth of torch_ops_only(): a global, read on every memsaved call


def _load() -> Kernels | None:
    if os.environ.get(ENV, "1").strip().lower() in ("0", "false", "no", "off"):
        log.info("offloadd: memsave's kernels are off (%s); torch ops instead", ENV)
        return None
    if platform.machine() not in ("x86_64", "AMD64"):
        log.info("offloadd: memsave's kernels need x86-64 with AVX2; torch ops instead")
        return None
    try:
        importlib.import_module(EXTENSION)  # registers torch.ops.offloadd_memsave
    except (ImportError, OSError) as e:
        log.warning(
            "offloadd: memsave's native library %s is not built or does not load (%s): memsave "
            "runs its Python path (the same results, slower). Build it by reinstalling offloadd "
            "with torch installed: pip install --no-build-isolation . (docs/native.md)",
            EXTENSION,
            e,
        )
        return None
    lib = Kernels(torch.ops.offloadd_memsave)
    if not lib.vectorised:
        log.info("offloadd: this CPU lacks AVX2: memsave's kernels stay off; torch ops instead")
        return None
    return lib


def native() -> Kernels | None:
    """The kernels, loaded at the first call; ``None`` where they cannot serve, and while dynamo
    traces (Note [compiled autograd])."""
    if _torch_ops_only or torch.compiler.is_compiling():
        return None
    if not _state:
        with _lock:
            if not _state:
                _state.append(_load())
    return _state[0]


def node_kernels() -> Kernels | None:
    """:func:`native`, for the ops whose backward is a C++ node: ``None`` while compiled autograd
    is configured (Note [compiled autograd])."""
    dynamo = sys.modules.get("torch._dynamo")
    if dynamo is not None and dynamo.config.compiled_autograd:
        return None
    return native()


def serves(t: torch.Tensor) -> bool:
    """Whether the kernels take ``t``: a non-empty contiguous float32/bfloat16 CPU tensor."""
    return t.is_cpu and t.dtype in DTYPES and t.is_contiguous() and t.numel() > 0


@contextmanager
def torch_ops_only() -> Iterator[None]:
    """Inside, memsave uses the torch-op path, in every thread (the tests compare both)."""
    global _torch_ops_only
    _torch_ops_only += 1
    try:
        yield
    finally:
        _torch_ops_only -= 1
