"""memsave's native kernels (csrc/memsave_kernels.cpp): a ReLU and its bit mask in one pass, a mask
back into a gradient in one pass, and MaxPool's indices to window offsets and back; and, in the
same library, memsave's two hottest autograd functions in C++ (csrc/memsave_ops.cpp).

:func:`native` returns them when they can serve: built at first use against the installed torch
(:mod:`offloadd.native_build`, about 25 seconds on two cores, once: cached), loaded, and the CPU
has AVX2. Otherwise
it returns ``None`` and says why once in the log, and memsave keeps its torch-op path
(:mod:`offloadd.memsave.bits`, :mod:`offloadd.memsave.pool`: bitwise the same results, more
passes over memory). The mask kernels take contiguous float32 or bfloat16 CPU tensors
(:func:`serves`), the pooling ones contiguous CPU indices; callers keep the torch-op path for
anything else. ``OFFLOADD_MEMSAVE_KERNELS=0`` turns them off.

Note: [C++ functions]
~~~~~~~~~~~~~~~~~~~~~
A Python ``autograd.Function`` costs tens of microseconds per call beyond the op it wraps: its
context is built in Python, and backward has the engine take the GIL to call back into Python.
A ResNet-101 step has 104 frozen convolutions and 100 ReLUs: measured at 64 px, batch 2, memsave
took 12 ms more than plain in forward and 13 ms more in backward (of 76 and 63 ms). So the ReLU
that keeps bits and the selective convolution are also C++ ops (csrc/memsave_ops.cpp),
registered as ``torch.ops.offloadd_memsave.*`` when the library loads, and written as PyTorch's
generated autograd kernels are: a typed backward Node, ``set_history`` (``rebase_history`` in
place). (``torch::autograd::Function``, tried first, spent 14 us forward and 7 us backward per
call in its generic context.) They run the same forward, save the same tensors (offloadd's hooks
see them), call the same backward ops on the same arguments and behave as
``once_differentiable``. Per call on a tiny tensor: the ReLU 3.4 us (torch's relu: 3.0), the
convolution 12.9 us (``F.conv2d``: 7.5); at 64 px, batch 2, backward is now 2 ms over plain.
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

import ctypes
import logging
import math
import os
import platform
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from offloadd import native_build
from offloadd.memsave.bits import packed_bytes

__all__ = ["DTYPES", "ENV", "Kernels", "native", "node_kernels", "serves", "torch_ops_only"]

log = logging.getLogger("offloadd")

ENV = "OFFLOADD_MEMSAVE_KERNELS"
_SOURCE = "memsave_kernels.cpp"
_ALSO = ("memsave_kernels.h", "memsave_ops.cpp")
DTYPES = {torch.float32: 0, torch.bfloat16: 1}
"""The dtypes of the mask kernels, with their code in csrc/memsave_kernels.cpp."""
_OFFSETS = {torch.uint8: 0, torch.int16: 1, torch.int32: 2}
_P = ctypes.c_void_p
_N = ctypes.c_int64
_I = ctypes.c_int


class Kernels:
    """The loaded library. Every tensor passed is a contiguous CPU tensor."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        lib.offloadd_masks_vectorised.restype = _I
        lib.offloadd_masks_relu_f32.argtypes = [_P, _P, _P, _N]
        lib.offloadd_masks_pack.argtypes = [_P, _I, _I, _P, _N]
        lib.offloadd_masks_select_f32.argtypes = [_P, _P, _P, _N]
        lib.offloadd_masks_expand.argtypes = [_P, _P, _N, _I]
        for fn in ("relu_f32", "pack", "select_f32", "expand"):
            getattr(lib, f"offloadd_masks_{fn}").restype = None
        for pool in (lib.offloadd_pool_compact, lib.offloadd_pool_expand):
            pool.argtypes = [_P, _P, _I, _N, _P]
            pool.restype = None
        self._lib = lib
        self.vectorised = bool(lib.offloadd_masks_vectorised())
        ops = torch.ops.offloadd_memsave  # registered by loading the library: Note [C++ functions]
        self.relu_bits = ops.relu_bits.default
        """``relu_bits(x)``: the ReLU keeping bits, for tensors :func:`serves` takes."""
        self.relu_bits_ = ops.relu_bits_.default
        """``relu_bits_(x)``: the same in place."""
        self.conv_selective = ops.conv_selective.default
        """``conv_selective(x, weight, bias, stride, padding, dilation, transposed,
        output_padding, groups)``: :func:`offloadd.memsave.conv.conv_selective`."""

    def relu(self, x: torch.Tensor, inplace: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """``relu(x)`` (into ``x`` if ``inplace``) and the packed bits of ``not (result <= 0)``:
        the kernel alone (memsave's ReLU calls it from C++, through :attr:`relu_bits`)."""
        n = x.numel()
        bits = torch.empty(packed_bytes(n), dtype=torch.uint8)
        if x.dtype == torch.float32:
            out = x if inplace else torch.empty_like(x)
            self._lib.offloadd_masks_relu_f32(x.data_ptr(), out.data_ptr(), bits.data_ptr(), n)
        else:  # the op itself is torch's (bfloat16 rounding of NaN payloads is torch's business)
            out = torch.relu_(x) if inplace else torch.relu(x)
            self._lib.offloadd_masks_pack(out.data_ptr(), DTYPES[x.dtype], 0, bits.data_ptr(), n)
        return out, bits

    def pack(self, t: torch.Tensor, positive: bool) -> torch.Tensor:
        """The packed bits of ``t > 0`` if ``positive``, else of ``not (t <= 0)``."""
        n = t.numel()
        bits = torch.empty(packed_bytes(n), dtype=torch.uint8)
        self._lib.offloadd_masks_pack(
            t.data_ptr(), DTYPES[t.dtype], int(positive), bits.data_ptr(), n
        )
        return bits

    def select(self, grad: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
        """A new tensor: float32 ``grad`` where the bit is set, ``+0`` elsewhere (bfloat16: see
        csrc/memsave_kernels.cpp)."""
        out = torch.empty_like(grad)
        self._lib.offloadd_masks_select_f32(
            grad.data_ptr(), bits.data_ptr(), out.data_ptr(), grad.numel()
        )
        return out

    def expand(
        self, bits: torch.Tensor, shape: torch.Size | tuple[int, ...], dtype: torch.dtype
    ) -> torch.Tensor:
        """A new contiguous tensor of ``shape``: 1 where the bit is set, 0 elsewhere."""
        out = torch.empty(shape, dtype=dtype)
        self._lib.offloadd_masks_expand(bits.data_ptr(), out.data_ptr(), out.numel(), DTYPES[dtype])
        return out

    def pool_compact(
        self,
        indices: torch.Tensor,
        in_shape: torch.Size,
        geometry: _Geometry,
        dtype: torch.dtype,
    ) -> torch.Tensor:
        """``compact_indices`` of :mod:`offloadd.memsave.pool`, into ``dtype``, in one pass."""
        offsets = torch.empty(indices.shape, dtype=dtype)
        planes, g = _pool_args(indices.shape, in_shape, geometry)
        self._lib.offloadd_pool_compact(
            indices.data_ptr(), offsets.data_ptr(), _OFFSETS[dtype], planes, ctypes.addressof(g)
        )
        return offsets

    def pool_expand(
        self, offsets: torch.Tensor, in_shape: torch.Size, geometry: _Geometry
    ) -> torch.Tensor:
        """``expand_indices`` of :mod:`offloadd.memsave.pool`: int64 indices, in one pass."""
        indices = torch.empty(offsets.shape, dtype=torch.int64)
        planes, g = _pool_args(offsets.shape, in_shape, geometry)
        self._lib.offloadd_pool_expand(
            offsets.data_ptr(),
            indices.data_ptr(),
            _OFFSETS[offsets.dtype],
            planes,
            ctypes.addressof(g),
        )
        return indices


_Geometry = tuple[list[int], list[int], list[int], list[int]]  # kernel, stride, padding, dilation


def _pool_args(
    out_shape: torch.Size, in_shape: torch.Size, geometry: _Geometry
) -> tuple[int, ctypes.Array[ctypes.c_int64]]:
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
    return planes, (ctypes.c_int64 * 18)(*(v for row in rows for v in row))


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
        path = native_build.build(
            _SOURCE,
            also=_ALSO,
            flags=["-std=c++20", "-O3", "-fopenmp"],  # torch 2.13's autograd headers want C++20
            libs=["c10", "torch_cpu"],
            what="memsave's kernels",
        )
        lib = Kernels(ctypes.CDLL(str(path)))
    except (native_build.NativeBuildError, OSError) as e:
        log.warning("offloadd: memsave's kernels are unavailable, torch ops instead: %s", e)
        return None
    if not lib.vectorised:
        log.info("offloadd: this CPU lacks AVX2: memsave's kernels stay off; torch ops instead")
        return None
    return lib


def native() -> Kernels | None:
    """The kernels, built and loaded at the first call; ``None`` where they cannot serve, and
    while dynamo traces (Note [compiled autograd])."""
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
