"""MaxPool1d/2d/3d saving compact indices and not the input.

Plain PyTorch's ``max_pool*_with_indices`` node saves the input and int64 indices (the flat
position of each maximum in its input plane). ``max_pool*_with_indices_backward`` reads the input's
shape only, and an index is determined by its offset inside its window, which is below the kernel's
volume: here the offsets are saved in the smallest integer dtype that holds them (uint8 up to 256
window positions, int16, int32) and the input not at all. Backward rebuilds the int64 indices with
the same arithmetic in reverse and calls the same aten backward op with a placeholder of the
input's shape (Note [placeholder]): bitwise plain's gradient. Padding, dilation, ``ceil_mode``
and any stride are handled (the window of an output position starts at
``o * stride - padding``). On contiguous indices memsave's kernels (:mod:`offloadd.memsave.kernels`)
do this arithmetic in one pass each way; the torch ops below (several passes of int64 division,
several times slower: docs/benchmarks/memsave_kernels_cpu-2core_2026-11-24.md) serve where the
kernels cannot.

Left to plain PyTorch: ``return_indices=True`` (the caller holds the int64 indices anyway),
unbatched inputs, inputs that are not contiguous, and devices other than the CPU.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from offloadd.memsave.frozen_gate import gated_off
from offloadd.memsave.kernels import native
from offloadd.memsave.once_differentiable import once_differentiable
from offloadd.memsave.placeholder import placeholder

__all__ = [
    "MemsaveMaxPool1d",
    "MemsaveMaxPool2d",
    "MemsaveMaxPool3d",
    "compact_indices",
    "expand_indices",
    "max_pool_compact",
]

_Geometry = tuple[list[int], list[int], list[int], list[int]]  # kernel, stride, padding, dilation


def _offset_dtype(volume: int) -> torch.dtype:
    if volume <= 256:
        return torch.uint8
    if volume <= 1 << 15:
        return torch.int16
    return torch.int32


def _starts(out_shape: torch.Size, geometry: _Geometry, device: torch.device) -> list[torch.Tensor]:
    """Per spatial dim, the first input position of each output position's window, shaped to
    broadcast against the output's spatial dims."""
    _, stride, padding, _ = geometry
    nd = len(stride)
    starts = []
    for d in range(nd):
        size = out_shape[-nd + d]
        start = torch.arange(size, device=device) * stride[d] - padding[d]
        starts.append(start.view([size] + [1] * (nd - 1 - d)))
    return starts


def compact_indices(
    indices: torch.Tensor, in_shape: torch.Size, geometry: _Geometry
) -> torch.Tensor:
    """The window offsets of ``indices`` (flat positions in each input plane, int64)."""
    kernel, _, _, dilation = geometry
    nd = len(kernel)
    spatial = list(in_shape[-nd:])
    starts = _starts(indices.shape, geometry, indices.device)
    offset = torch.zeros((), dtype=torch.int64, device=indices.device)
    rest = indices
    for d in range(nd - 1, -1, -1):
        pos = rest % spatial[d] if d else rest
        rest = rest // spatial[d]
        k = (pos - starts[d]) // dilation[d]
        offset = offset + k * math.prod(kernel[d + 1 :])
    return offset.to(_offset_dtype(math.prod(kernel)))


def expand_indices(
    offsets: torch.Tensor, in_shape: torch.Size, geometry: _Geometry
) -> torch.Tensor:
    """The int64 indices that :func:`compact_indices` compacted."""
    kernel, _, _, dilation = geometry
    nd = len(kernel)
    spatial = list(in_shape[-nd:])
    starts = _starts(offsets.shape, geometry, offsets.device)
    rest = offsets.to(torch.int64)
    index = torch.zeros((), dtype=torch.int64, device=offsets.device)
    for d in range(nd - 1, -1, -1):
        k = rest % kernel[d] if d else rest
        rest = rest // kernel[d]
        pos = starts[d] + k * dilation[d]
        index = index + pos * math.prod(spatial[d + 1 :])
    return index


_WITH_INDICES = {
    1: (torch.ops.aten.max_pool2d_with_indices, torch.ops.aten.max_pool2d_with_indices_backward),
    2: (torch.ops.aten.max_pool2d_with_indices, torch.ops.aten.max_pool2d_with_indices_backward),
    3: (torch.ops.aten.max_pool3d_with_indices, torch.ops.aten.max_pool3d_with_indices_backward),
}


class _MaxPoolCompact(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, geometry: _Geometry, ceil_mode: bool) -> torch.Tensor:
        nd = len(geometry[0])
        fwd, _ = _WITH_INDICES[nd]
        out, indices = fwd(x, *geometry, ceil_mode)
        ctx.geometry = geometry
        ctx.ceil_mode = ceil_mode
        ctx.x_meta = (x.shape, x.dtype, x.device)
        k = native() if indices.is_contiguous() else None
        if k is not None:  # the same arithmetic in one pass (csrc/memsave/kernels.cpp)
            dtype = _offset_dtype(math.prod(geometry[0]))
            offsets = k.pool_compact(indices, x.shape, geometry, dtype)
        else:
            offsets = compact_indices(indices, x.shape, geometry)
        ctx.save_for_backward(offsets)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        (offsets,) = ctx.saved_tensors
        shape = ctx.x_meta[0]
        k = native() if offsets.is_contiguous() else None
        if k is not None:
            indices = k.pool_expand(offsets, shape, ctx.geometry)
        else:
            indices = expand_indices(offsets, shape, ctx.geometry)
        _, bwd = _WITH_INDICES[len(ctx.geometry[0])]
        x = placeholder(*ctx.x_meta)
        gx = bwd(grad, x, *ctx.geometry, ctx.ceil_mode, indices)
        return gx, None, None


def max_pool_compact(x: torch.Tensor, geometry: _Geometry, ceil_mode: bool) -> torch.Tensor:
    """``max_pool{nd}d(x, *geometry, ceil_mode)`` (``nd = len(kernel)``; 2 or 3, a 1d pool is
    given as 2d on an unsqueezed input) saving compact indices only."""
    out: torch.Tensor = _MaxPoolCompact.apply(x, geometry, ceil_mode)
    return out


def _tuple(v: Any, nd: int) -> list[int]:
    return list(v) if isinstance(v, (tuple, list)) else [int(v)] * nd


class _MemsaveMaxPool:
    _nd = 0

    def _memsave_forward(self, x: torch.Tensor) -> torch.Tensor:
        pool: Any = self
        base: Any = type(self).__mro__[2]
        nd = self._nd
        plain = (
            pool.return_indices
            or gated_off(pool)  # Note [fully trainable]
            or not (torch.is_grad_enabled() and x.requires_grad)
            or x.dim() != nd + 2
            or x.device.type != "cpu"
            or not x.is_contiguous()
        )
        if plain:
            out: torch.Tensor = base.forward(pool, x)
            return out
        stride = pool.stride if pool.stride is not None else pool.kernel_size
        geometry = (
            _tuple(pool.kernel_size, nd),
            _tuple(stride if stride != [] else pool.kernel_size, nd),
            _tuple(pool.padding, nd),
            _tuple(pool.dilation, nd),
        )
        if nd == 1:  # aten's max_pool1d_with_indices is max_pool2d's on (N, C, 1, L)
            g2 = ([1] + geometry[0], [1] + geometry[1], [0] + geometry[2], [1] + geometry[3])
            return max_pool_compact(x.unsqueeze(-2), g2, pool.ceil_mode).squeeze(-2)
        return max_pool_compact(x, geometry, pool.ceil_mode)


class MemsaveMaxPool1d(_MemsaveMaxPool, nn.MaxPool1d):
    """:class:`torch.nn.MaxPool1d` saving window offsets instead of the input and int64 indices."""

    _nd = 1

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return self._memsave_forward(input)


class MemsaveMaxPool2d(_MemsaveMaxPool, nn.MaxPool2d):
    """:class:`torch.nn.MaxPool2d` saving window offsets instead of the input and int64 indices."""

    _nd = 2

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return self._memsave_forward(input)


class MemsaveMaxPool3d(_MemsaveMaxPool, nn.MaxPool3d):
    """:class:`torch.nn.MaxPool3d` saving window offsets instead of the input and int64 indices."""

    _nd = 3

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return self._memsave_forward(input)
