"""Conv1d/2d/3d and ConvTranspose1d/2d/3d that save their input only when the weight's gradient
will be computed.

Plain PyTorch's ``ConvolutionBackward0`` saves the input and the weight whatever requires grad.
The input gradient needs the weight only, the bias gradient only the output's gradient; the input
is read only for the weight's gradient. Here, at each forward, ``ctx.needs_input_grad`` decides:
the input is saved (through ``save_for_backward``, so offloadd's hooks see it) only when the
weight requires grad; the weight (a parameter: saving it costs nothing) always.
Backward calls ``aten.convolution_backward`` with the arguments autograd passes it (the input or,
when it is not read, an uninitialised stand-in of its shape: Note [placeholder]) and the same output mask, so
the gradients are bitwise those of plain PyTorch.

Forward calls ``torch.convolution``, the op ``F.conv*`` reach, so the output is plain's.

Note: [autocast]
~~~~~~~~~~~~~~~~
Autocast casts at ``conv1d``/``conv2d``/``conv_transpose2d``..., the ops ``F.conv*`` call, not at
``convolution`` below them: called directly, ``convolution`` would compute in float32 where
plain computes in bfloat16 or float16, a different output and different gradients (it did, until
a test compared memsave with plain under ``torch.autocast``). So while autocast is on for the
input's device, the module runs plain PyTorch's forward (and saves what plain saves). A
trainable weight needs the input, so then the module runs plain PyTorch's forward: nothing
changes for a fully trainable model (same saved tensors, no extra Python). Also left to plain
PyTorch: string padding (``"same"``/``"valid"``), unbatched inputs, non-contiguous inputs
(channels-last: the backward's layout would differ), and subclasses of the conv classes (only
the exact classes are replaced). Non-zero
padding modes pad first (an ordinary autograd op), then convolve with zero padding, as
``nn.Conv*`` does.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from offloadd.memsave.kernels import node_kernels
from offloadd.memsave.once_differentiable import once_differentiable
from offloadd.memsave.placeholder import uninitialised

__all__ = [
    "MemsaveConv1d",
    "MemsaveConv2d",
    "MemsaveConv3d",
    "MemsaveConvTranspose1d",
    "MemsaveConvTranspose2d",
    "MemsaveConvTranspose3d",
    "conv_selective",
]

_CONVOLUTION_BACKWARD = torch.ops.aten.convolution_backward.default
_Params = tuple[list[int], list[int], list[int], bool, list[int], int]


class _ConvSelective(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        params: _Params,
    ) -> torch.Tensor:
        stride, padding, dilation, transposed, output_padding, groups = params
        out = torch.convolution(
            x, weight, bias, stride, padding, dilation, transposed, output_padding, groups
        )
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        ctx.params = params
        ctx.mask = [need_x, need_w, bool(need_b)]
        ctx.bias_sizes = None if bias is None else list(bias.shape)
        ctx.x_meta = (x.shape, x.dtype, x.device)
        # The weight is always saved, as in plain: it is a parameter (free to keep), and the
        # kernel that computes the weight's gradient then sees the real weight's layout.
        ctx.save_for_backward(x if need_w else None, weight)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        if x is None:
            x = uninitialised(*ctx.x_meta)
        stride, padding, dilation, transposed, output_padding, groups = ctx.params
        gx, gw, gb = _CONVOLUTION_BACKWARD(
            grad,
            x,
            weight,
            ctx.bias_sizes,
            stride,
            padding,
            dilation,
            transposed,
            output_padding,
            groups,
            ctx.mask,
        )
        return gx, gw, gb, None


def conv_selective(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    params: _Params,
) -> torch.Tensor:
    """``aten.convolution(x, weight, bias, *params)`` saving only what the gradients that will be
    computed read. ``x`` must be batched and contiguous unless ``weight`` requires grad."""
    k = node_kernels()
    if k is not None:  # the same function in C++: Note [C++ functions] in kernels.py
        out: torch.Tensor = k.conv_selective(x, weight, bias, *params)
        return out
    out = _ConvSelective.apply(x, weight, bias, params)
    return out


def _selective(
    weight: torch.Tensor, bias: torch.Tensor | None, x: torch.Tensor, nd: int, padding: Any
) -> bool:
    """Whether the selective function saves less than plain here: a graph is built and the
    weight is frozen (with a trainable weight both save the input and the weight, and plain's
    forward costs less)."""
    if weight.requires_grad or not torch.is_grad_enabled():
        return False
    if not (x.requires_grad or (bias is not None and bias.requires_grad)):
        return False
    if torch.is_autocast_enabled(x.device.type):  # Note [autocast]
        return False
    return x.dim() == nd + 2 and not isinstance(padding, str) and x.is_contiguous()


class _MemsaveConvNd:
    """The forward shared by the six classes (mixed in before the nn class)."""

    _nd: int = 0
    _transposed = False

    def _memsave_forward(self, x: torch.Tensor, output_size: list[int] | None) -> torch.Tensor:
        conv: Any = self
        weight: torch.Tensor = conv.weight
        bias: torch.Tensor | None = conv.bias
        if not _selective(weight, bias, x, self._nd, conv.padding):
            return _plain_forward(conv, x, output_size)
        if self._transposed:
            if conv.padding_mode != "zeros":
                return _plain_forward(conv, x, output_size)
            output_padding = conv._output_padding(
                x, output_size, conv.stride, conv.padding, conv.kernel_size, self._nd, conv.dilation
            )
            params: _Params = (
                list(conv.stride),
                list(conv.padding),
                list(conv.dilation),
                True,
                list(output_padding),
                conv.groups,
            )
            return conv_selective(x, weight, bias, params)
        padding = list(conv.padding)
        if conv.padding_mode != "zeros":
            x = F.pad(x, conv._reversed_padding_repeated_twice, mode=conv.padding_mode)
            padding = [0] * self._nd
            if not x.is_contiguous():
                return _plain_forward(conv, x, output_size, padded=True)
        params = (
            list(conv.stride),
            padding,
            list(conv.dilation),
            False,
            [0] * self._nd,
            conv.groups,
        )
        return conv_selective(x, weight, bias, params)


def _plain_forward(
    conv: Any, x: torch.Tensor, output_size: list[int] | None, padded: bool = False
) -> torch.Tensor:
    base: Any = type(conv).__mro__[2]  # the nn class after the mixin
    if padded:  # x is already padded: convolve with zero padding, as nn.Conv*._conv_forward does
        fn = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}[conv._nd]
        out: torch.Tensor = fn(
            x, conv.weight, conv.bias, conv.stride, 0, conv.dilation, conv.groups
        )
        return out
    out = base.forward(conv, x, output_size) if conv._transposed else base.forward(conv, x)
    return out


class MemsaveConv1d(_MemsaveConvNd, nn.Conv1d):
    """:class:`torch.nn.Conv1d` saving its input only when the weight's gradient needs it."""

    _nd = 1

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return self._memsave_forward(input, None)


class MemsaveConv2d(_MemsaveConvNd, nn.Conv2d):
    """:class:`torch.nn.Conv2d` saving its input only when the weight's gradient needs it."""

    _nd = 2

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return self._memsave_forward(input, None)


class MemsaveConv3d(_MemsaveConvNd, nn.Conv3d):
    """:class:`torch.nn.Conv3d` saving its input only when the weight's gradient needs it."""

    _nd = 3

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return self._memsave_forward(input, None)


class MemsaveConvTranspose1d(_MemsaveConvNd, nn.ConvTranspose1d):
    """:class:`torch.nn.ConvTranspose1d` saving its input only when the weight's gradient needs it."""

    _nd = 1
    _transposed = True

    def forward(self, input: torch.Tensor, output_size: list[int] | None = None) -> torch.Tensor:
        return self._memsave_forward(input, output_size)


class MemsaveConvTranspose2d(_MemsaveConvNd, nn.ConvTranspose2d):
    """:class:`torch.nn.ConvTranspose2d` saving its input only when the weight's gradient needs it."""

    _nd = 2
    _transposed = True

    def forward(self, input: torch.Tensor, output_size: list[int] | None = None) -> torch.Tensor:
        return self._memsave_forward(input, output_size)


class MemsaveConvTranspose3d(_MemsaveConvNd, nn.ConvTranspose3d):
    """:class:`torch.nn.ConvTranspose3d` saving its input only when the weight's gradient needs it."""

    _nd = 3
    _transposed = True

    def forward(self, input: torch.Tensor, output_size: list[int] | None = None) -> torch.Tensor:
        return self._memsave_forward(input, output_size)
